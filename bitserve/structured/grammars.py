"""GrammarCompiler: a model's vocabulary + xgrammar -> compiled grammars for Guides.

xgrammar was chosen over llguidance by measured per-token mask cost on this project's CPU with
SmolLM2's 49,152-token vocabulary (benchmarks/bench_grammar_mask.py, benchmarks/RESULTS.md). It is
imported on first use: it pulls in transformers, ~1.5 s that a server without structured requests
should not pay at start. One compiler per model instance, shared by the server (validation at the
edge, before admission) and the engine thread (the runner's matchers): xgrammar's compiler is
thread-safe and caches compiled grammars, so the runner's compile of a validated guide is a hit.
"""

from __future__ import annotations

import functools
import json
import re
import threading
from typing import TYPE_CHECKING, Any

import torch

from bitserve.errors import InvalidRequest
from bitserve.structured.guide import Guide, GuideKind
from bitserve.tokenizer.base import Tokenizer

if TYPE_CHECKING:
    import xgrammar

# xgrammar's C++ errors start with "[hh:mm:ss] /path/file.cc:NNN: "; the client needs what follows.
_CPP_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: (Check failed: \(.*?\) is false: )?")
# Compact JSON (", " and ": " separators, no free whitespace): a small model given free whitespace
# can spend its whole budget on newlines inside a JSON document.
JSON_SEPARATORS = (", ", ": ")
JSON_OBJECT_SCHEMA = '{"type": "object"}'
# Structural tags whose compact form is kept: each request's tag is compiled twice (the server's
# validation, then the runner), and a client tends to send the same tools again.
MAX_CACHED_STRUCTURAL_TAGS = 64


def _choice_grammar(choices: list[str]) -> str:
    """root ::= "a" | "b" | ...: each choice exactly, quoted as an EBNF string literal."""
    return "root ::= " + " | ".join(_ebnf_literal(choice) for choice in choices)


def _ebnf_literal(text: str) -> str:
    return '"' + "".join(_ebnf_char(char) for char in text) + '"'


def _ebnf_char(char: str) -> str:
    if char in '"\\':
        return "\\" + char
    if char.isprintable():
        return char
    return f"\\u{ord(char):04x}" if ord(char) <= 0xFFFF else f"\\U{ord(char):08x}"


@functools.lru_cache(maxsize=MAX_CACHED_STRUCTURAL_TAGS)
def compact_structural_tag(spec: str) -> str:
    """A structural tag's spec with its JSON schemas as compact-JSON grammars (_compact_json): built
    once per spec, since each schema's conversion costs a grammar build."""
    return json.dumps(_compact_json(json.loads(spec)))


def _compact_json(node: Any) -> Any:
    """A structural tag with each `json_schema` content swapped for the schema's grammar in compact
    JSON (JSON_SEPARATORS), as response_format gets: the tag's own JSON allows free whitespace."""
    import xgrammar

    if isinstance(node, list):
        return [_compact_json(item) for item in node]
    if not isinstance(node, dict):
        return node
    if node.get("type") == "json_schema":
        schema = json.dumps(node["json_schema"])
        grammar = xgrammar.Grammar.from_json_schema(schema, any_whitespace=False, separators=JSON_SEPARATORS)
        return {"type": "grammar", "grammar": str(grammar)}
    return {key: _compact_json(value) for key, value in node.items()}


def error_text(exc: BaseException) -> str:
    """xgrammar's message without its C++ source location."""
    text = str(exc).strip()
    return _CPP_PREFIX.sub("", text).strip() or type(exc).__name__


class GrammarCompiler:
    """Compiles Guides against one tokenizer. `vocab_size` is the logits' width (the model's
    embedding rows), which may exceed the tokenizer's vocabulary: ids past it are never allowed."""

    def __init__(self, tokenizer: Tokenizer, vocab_size: int) -> None:
        self._tokenizer = tokenizer
        self.vocab_size = max(vocab_size, tokenizer.vocab_size)
        self.stop_token_ids = sorted(tokenizer.eos_token_ids)
        self._lock = threading.Lock()
        self._compiler: xgrammar.GrammarCompiler | None = None

    def compile(self, guide: Guide) -> xgrammar.CompiledGrammar:
        """The compiled grammar; InvalidRequest (naming the request field) when it does not compile."""
        compiler = self._xgrammar_compiler()
        try:
            return self._compile(compiler, guide)
        except (RuntimeError, ValueError, TypeError) as exc:
            raise InvalidRequest(
                f"invalid {guide.param}: {error_text(exc)}",
                param=guide.param,
                hint=_HINTS[guide.kind],
            ) from None

    @staticmethod
    def _compile(compiler: xgrammar.GrammarCompiler, guide: Guide) -> xgrammar.CompiledGrammar:
        if guide.kind in (GuideKind.JSON_SCHEMA, GuideKind.JSON_OBJECT):
            schema = guide.spec if guide.kind == GuideKind.JSON_SCHEMA else JSON_OBJECT_SCHEMA
            return compiler.compile_json_schema(schema, any_whitespace=False, separators=JSON_SEPARATORS)
        if guide.kind == GuideKind.REGEX:
            return compiler.compile_regex(guide.spec)
        if guide.kind == GuideKind.CHOICE:
            return compiler.compile_grammar(_choice_grammar(guide.choices()))
        if guide.kind == GuideKind.STRUCTURAL_TAG:
            return compiler.compile_structural_tag(compact_structural_tag(guide.spec))
        return compiler.compile_grammar(guide.spec, root_rule_name="root")

    def _xgrammar_compiler(self) -> xgrammar.GrammarCompiler:
        with self._lock:
            if self._compiler is None:
                self._compiler = self._build()
            return self._compiler

    def _build(self) -> xgrammar.GrammarCompiler:
        import xgrammar  # NOTE: deferred: see the module docstring

        tokenizer = self._tokenizer
        # Special tokens get no bytes: xgrammar then treats them as special and never allows them
        # (a grammar's text could otherwise be spelled with "<|im_end|>", which ends the sequence).
        vocab = [
            b"" if tokenizer.is_special(token_id) else tokenizer.token_bytes(token_id)
            for token_id in range(tokenizer.vocab_size)
        ]
        vocab += [b""] * (self.vocab_size - len(vocab))
        info = xgrammar.TokenizerInfo(
            vocab, xgrammar.VocabType.RAW, vocab_size=self.vocab_size, stop_token_ids=self.stop_token_ids
        )
        return xgrammar.GrammarCompiler(info, max_threads=1)

    def validate(self, guide: Guide) -> None:
        """The server's check before admission: the guide compiles and its grammar allows some first
        token (`root ::= root` compiles but matches nothing). InvalidRequest otherwise."""
        matcher = self.matcher(guide)
        bitmask = torch.zeros((1, (self.vocab_size + 31) // 32), dtype=torch.int32)
        matcher.fill_next_token_bitmask(bitmask, 0)
        if not bitmask.any():
            raise InvalidRequest(
                f"invalid {guide.param}: it matches no text at all",
                param=guide.param,
                hint=_HINTS[guide.kind],
            )

    def matcher(self, guide: Guide) -> Any:
        """A fresh xgrammar.GrammarMatcher for `guide` (compiled, usually from the cache)."""
        import xgrammar

        return xgrammar.GrammarMatcher(self.compile(guide))


_HINTS = {
    GuideKind.JSON_SCHEMA: "send a JSON schema (draft 2020-12 keywords: type, properties, required, ...)",
    GuideKind.JSON_OBJECT: None,
    GuideKind.REGEX: "a regular expression in the usual (ECMAScript-like) syntax",
    GuideKind.CHOICE: "a list of strings",
    GuideKind.GRAMMAR: 'an EBNF/GBNF grammar with a root rule, e.g. root ::= "yes" | "no"',
    GuideKind.STRUCTURAL_TAG: "each tool's parameters must be a JSON schema of type object",
}
