"""Per-token cost of grammar-constrained decoding on this CPU: xgrammar vs llguidance (issue 14).

Both engines get the same vocabulary (SmolLM2-135M-Instruct's 49,152 tokens, read from the embedded
GGUF through bitserve's tokenizer) and walk the same token sequence: a JSON document, tokenized as the
model would emit it, that satisfies each grammar. Per token we time what a serving step pays: fill the
sequence's row of an int32 bitmask [batch, ceil(vocab / 32)], then advance the matcher by the token.
We also time applying a [batch, vocab] bitmask to float32 logits (the one batched op per step), and
compiling each grammar. Prints one JSON line per (engine, grammar); medians over the walk.

    python benchmarks/bench_grammar_mask.py                  # both engines
    python benchmarks/bench_grammar_mask.py --engines llguidance --repeat 5
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from bitserve.loader.catalog import resolve_model
from bitserve.loader.gguf_reader import read_gguf
from bitserve.tokenizer.gguf_vocab import GGUFTokenizer, tokenizer_from_gguf

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer"},
        "city": {"enum": ["Paris", "London", "Tokyo"]},
        "tags": {"type": "array", "items": {"type": "string"}},
    },
    "required": ["name", "age", "city", "tags"],
    "additionalProperties": False,
}
DOCUMENT = '{"name": "Ada Lovelace", "age": 36, "city": "London", "tags": ["math", "poetry", "engines"]}'
GRAMMARS = {"json_schema": json.dumps(SCHEMA), "json_object": '{"type": "object"}'}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--engines", nargs="+", default=["xgrammar", "llguidance"])
    parser.add_argument("--repeat", type=int, default=3, help="walks of the document per grammar")
    parser.add_argument(
        "--batch", type=int, default=8, help="rows of the logits batch the mask is applied to"
    )
    return parser.parse_args(argv)


def vocabulary(tokenizer: GGUFTokenizer) -> list[bytes]:
    """Each id's bytes; special tokens carry llguidance's 0xFF prefix so that no grammar emits them."""
    return [
        (b"\xff" if tokenizer.is_special(i) else b"") + tokenizer.token_bytes(i)
        for i in range(tokenizer.vocab_size)
    ]


def median_us(samples: list[float]) -> float:
    return round(statistics.median(samples) * 1e6, 1)


@dataclass
class Engine:
    """One grammar engine's calls, so both are timed by the same loop (`bench`)."""

    name: str
    compile: Callable[[str], Any]  # JSON schema text -> grammar (checked, ready for matchers)
    new_matcher: Callable[[Any], Any]
    fill: Callable[[Any], None]  # fill row 0 of the engine's bitmask
    advance: Callable[[Any, int], bool]
    apply: Callable[[], None]  # the whole bitmask onto [batch, vocab] logits


def bench(engine: Engine, tokens: list[int], repeat: int, batch: int) -> list[dict]:
    rows = []
    for name, schema in GRAMMARS.items():
        start = time.perf_counter()
        grammar = engine.compile(schema)
        compile_s = time.perf_counter() - start
        fill_s, advance_s = [], []
        for _ in range(repeat):  # per token of each walk, a fresh matcher per walk
            matcher = engine.new_matcher(grammar)
            for token in tokens:
                start = time.perf_counter()
                engine.fill(matcher)
                middle = time.perf_counter()
                _check(engine.advance(matcher, token), token)
                fill_s.append(middle - start)
                advance_s.append(time.perf_counter() - middle)
        rows.append(_row(engine.name, name, compile_s, fill_s, advance_s, _time_apply(engine.apply), batch))
    return rows


def xgrammar_engine(tokenizer: GGUFTokenizer, batch: int) -> Engine:
    import xgrammar as xgr

    info = xgr.TokenizerInfo(
        [tokenizer.token_bytes(i) for i in range(tokenizer.vocab_size)],
        xgr.VocabType.RAW,
        vocab_size=tokenizer.vocab_size,
        stop_token_ids=sorted(tokenizer.eos_token_ids),
    )
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    bitmask = xgr.allocate_token_bitmask(batch, tokenizer.vocab_size)
    logits = torch.randn(batch, tokenizer.vocab_size)
    return Engine(
        "xgrammar",
        lambda schema: compiler.compile_json_schema(schema, any_whitespace=True, strict_mode=True),
        xgr.GrammarMatcher,
        lambda matcher: matcher.fill_next_token_bitmask(bitmask, 0),
        lambda matcher, token: matcher.accept_token(token),
        lambda: xgr.apply_token_bitmask_inplace(logits, bitmask),
    )


def llguidance_engine(tokenizer: GGUFTokenizer, batch: int) -> Engine:
    import llguidance
    import llguidance.torch as llg_torch

    class _Vocab:
        eos_token_id = tokenizer.eos_token_id
        bos_token_id = tokenizer.bos_token_id
        tokens = vocabulary(tokenizer)
        special_token_ids = [i for i in range(tokenizer.vocab_size) if tokenizer.is_special(i)]

        def __call__(self, text: bytes) -> list[int]:
            return tokenizer.encode(text.decode("utf-8", errors="replace"), add_special=False)

    ll_tokenizer = llguidance.LLTokenizer(llguidance.TokenizerWrapper(_Vocab()))
    bitmask = llg_torch.allocate_token_bitmask(batch, tokenizer.vocab_size)
    logits = torch.randn(batch, tokenizer.vocab_size)

    def compile_schema(schema: str) -> str:
        grammar = llguidance.LLMatcher.grammar_from_json_schema(schema)
        first = llguidance.LLMatcher(ll_tokenizer, grammar)  # builds the parser: part of the compile
        _check(not first.is_error(), first.get_error())
        return grammar

    return Engine(
        "llguidance",
        compile_schema,
        lambda grammar: llguidance.LLMatcher(ll_tokenizer, grammar),
        lambda matcher: llg_torch.fill_next_token_bitmask(matcher, bitmask, 0),
        lambda matcher, token: matcher.consume_token(token),
        lambda: llg_torch.apply_token_bitmask_inplace(logits, bitmask),
    )


def _check(ok: object, what: object) -> None:
    if not ok:
        raise RuntimeError(f"the grammar refused {what!r}")


def _time_apply(apply: Callable[[], None], repeats: int = 50) -> list[float]:
    apply()  # warm-up (first-call compilation, if any)
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        apply()
        samples.append(time.perf_counter() - start)
    return samples


def _row(
    engine: str,
    grammar: str,
    compile_s: float,
    fill_s: list[float],
    advance_s: list[float],
    apply_s: list[float],
    batch: int,
) -> dict:
    return {
        "engine": engine,
        "grammar": grammar,
        "compile_ms": round(compile_s * 1e3, 1),
        "tokens": len(fill_s),
        "mask_us_median": median_us(fill_s),
        "mask_us_p90": round(sorted(fill_s)[int(0.9 * len(fill_s))] * 1e6, 1),
        "mask_us_max": round(max(fill_s) * 1e6, 1),
        "advance_us_median": median_us(advance_s),
        f"apply_bitmask_{batch}rows_us_median": median_us(apply_s),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    tokenizer = tokenizer_from_gguf(read_gguf(resolve_model(args.model)).metadata)
    tokens = tokenizer.encode(DOCUMENT, add_special=False) + [tokenizer.eos_token_id]
    builders = {"xgrammar": xgrammar_engine, "llguidance": llguidance_engine}
    for engine in args.engines:
        try:
            rows = bench(builders[engine](tokenizer, args.batch), tokens, args.repeat, args.batch)
        except ImportError as exc:
            rows = [{"engine": engine, "error": f"cannot import: {exc}"}]
        for row in rows:
            sys.stdout.write(json.dumps(row) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
