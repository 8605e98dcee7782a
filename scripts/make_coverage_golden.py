"""Generate the llama.cpp golden fixtures of the 2026 coverage work: architectures and llama.cpp's 1- and
2-bit weight types.

    python scripts/make_coverage_golden.py    # needs llama-cpp-python 0.3.36 (pip install '.[crossval]')

Writes tests/fixtures/golden/:
  coverage.json          per case (architecture x weight type): the converted file's sha256, and per prompt
                         llama.cpp's prompt token ids, its greedy continuation (an F32 KV cache), and at
                         every position of prompt + continuation its argmax, top-2 margin and logit range
                         (max - min), for the near-tie rule.
                         The files are random-init transformers checkpoints (bitserve/testing/
                         hf_checkpoints.py) converted by bitserve's loader/hf_convert.py: llama.cpp reads
                         the very bytes bitserve reads.
  low_bit_formats.npz    per type (q1_0, q2_0): float rows x, llama.cpp's quantize_<type> bytes of them, and
                         its dequantize_row_<type> of those bytes (libggml-base, called through ctypes).
The same comparison runs live with `bitserve crossval` (tests/models/test_coverage_golden.py).
"""

from __future__ import annotations

import ctypes
import hashlib
import json
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from bitserve.loader.catalog import resolve_model  # noqa: E402
from bitserve.loader.gguf_types import BLOCK_FORMATS, GGMLType  # noqa: E402
from bitserve.testing.hf_checkpoints import hf_gguf_case  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "golden"
CASES = [
    ("llama", "F32"),
    ("qwen2", "F32"),
    ("qwen3", "F32"),
    ("gemma3", "F32"),
    ("minicpm", "F32"),
    ("bitnet-silu", "TQ2_0"),  # a BitNet checkpoint converted to llama.cpp's `bitnet` arch and ternary type
    ("llama", "Q1_0"),
    ("llama", "Q2_0"),
    ("qwen3", "Q1_0"),
    ("qwen3", "Q2_0"),
]
PROMPTS = ["The capital of France is Paris, and", "def add(a, b):\n    return", "émigré 東京 🙂 1 2 3"]
NUM_TOKENS = 16
LOW_BIT_TYPES = {"q1_0": BLOCK_FORMATS[GGMLType.Q1_0], "q2_0": BLOCK_FORMATS[GGMLType.Q2_0]}
GGML_TYPE_F32 = 0


def _margin_and_range(logits: np.ndarray) -> tuple[float, float]:
    top = np.partition(logits, -2)[-2:]
    return round(float(abs(top[1] - top[0])), 6), round(float(logits.max() - logits.min()), 6)


def greedy_rows(llm: object, ids: list[int], num_tokens: int) -> tuple[list[int], list[np.ndarray]]:
    """llama.cpp's (a `Llama` with logits_all) greedy continuation of `ids` and its logits at every
    teacher-forced position (ids + continuation[:-1]): the prompt's rows from the batched prompt step,
    the continuation's from each one-token step."""
    llm.reset()  # type: ignore[attr-defined]
    llm.eval(ids)  # type: ignore[attr-defined]
    rows = [np.asarray(row, dtype=np.float32) for row in llm.scores[: len(ids) - 1]]  # type: ignore[attr-defined]
    continuation: list[int] = []
    for _ in range(num_tokens):
        logits = np.asarray(llm.scores[llm.n_tokens - 1], dtype=np.float32)  # type: ignore[attr-defined]
        rows.append(logits)
        continuation.append(int(np.argmax(logits)))
        llm.eval([continuation[-1]])  # type: ignore[attr-defined]
    return continuation, rows


def llama_greedy(path: Path) -> list[dict]:
    """Per prompt: llama.cpp's ids, its greedy continuation, and for every position of the teacher-forced
    sequence (ids + continuation[:-1]) the argmax, top-2 margin and logit range: the prompt's from the
    batched prompt step, the continuation's from each one-token step."""
    from llama_cpp import Llama

    llm = Llama(
        model_path=str(path),
        n_ctx=256,
        n_threads=2,
        logits_all=True,
        verbose=False,
        seed=0,
        type_k=GGML_TYPE_F32,
        type_v=GGML_TYPE_F32,
    )
    out = []
    try:
        for prompt in PROMPTS:
            ids = llm.tokenize(prompt.encode("utf-8"), add_bos=False, special=False)
            continuation, rows = greedy_rows(llm, ids, NUM_TOKENS)
            margins, ranges = zip(*(_margin_and_range(row) for row in rows), strict=True)
            out.append(
                {
                    "ids": ids,
                    "continuation": continuation,
                    "argmax": [int(np.argmax(row)) for row in rows],
                    "margins": list(margins),
                    "ranges": list(ranges),
                }
            )
    finally:
        llm.close()
    return out


def make_coverage(out: Path, tokenizer_source: Path) -> None:
    cases = []
    with tempfile.TemporaryDirectory() as folder:
        for arch, weight_type in CASES:
            _, path = hf_gguf_case(arch, weight_type, tokenizer_source, Path(folder))
            sha = hashlib.sha256(path.read_bytes()).hexdigest()
            cases.append(
                {"arch": arch, "weight_type": weight_type, "sha256": sha, "prompts": llama_greedy(path)}
            )
    document = {"num_tokens": NUM_TOKENS, "prompts": PROMPTS, "cases": cases}
    (out / "coverage.json").write_text(
        json.dumps(document, indent=1, ensure_ascii=False) + "\n", encoding="utf-8"
    )


def ggml_base() -> ctypes.CDLL:
    import llama_cpp

    return ctypes.CDLL(os.path.join(os.path.dirname(llama_cpp.__file__), "lib", "libggml-base.so"))


def llama_quantize(lib: ctypes.CDLL, name: str, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(llama.cpp's quantize_<name> bytes of f32 [M, K] x, its dequantize_row_<name> of them)."""
    rows, cols = x.shape
    block = LOW_BIT_TYPES[name]
    buffer = (ctypes.c_uint8 * (rows * cols // block.block_size * block.type_size))()
    quantize = getattr(lib, f"quantize_{name}")
    quantize.restype = ctypes.c_size_t
    quantize.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p]
    quantize(np.ascontiguousarray(x).ctypes.data, buffer, rows, cols, None)
    values = np.empty((rows, cols), dtype=np.float32)
    dequantize = getattr(lib, f"dequantize_row_{name}")
    dequantize.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    dequantize(buffer, values.ctypes.data, rows * cols)
    return np.frombuffer(bytes(buffer), dtype=np.uint8).copy(), values


def low_bit_rows(seed: int = 0) -> np.ndarray:
    """f32 [16, 512]: normal rows plus the edges: an all-zero block, exact halves, tiny values, signs."""
    rng = np.random.default_rng(seed)
    x = (rng.standard_normal((16, 512)) * 0.05).astype(np.float32)
    x[0, :128] = 0.0  # d = 0 blocks
    x[1, :4] = [0.5, 0.25, -0.75, -0.25]  # roundf ties (w / d = +-0.5, +-1.5) after d = 0.75
    x[2, :128] = 1e-30  # values whose f16 d underflows
    x[3, 128:256] = -x[3, 128:256]
    x[4, :64] = np.linspace(-1.0, 2.0, 64, dtype=np.float32)  # Q2_0's code 3 (+2 d)
    return x


def make_low_bit(out: Path) -> None:
    lib = ggml_base()
    x = low_bit_rows()
    arrays = {"x": x}
    for name in LOW_BIT_TYPES:
        arrays[f"{name}_bytes"], arrays[f"{name}_values"] = llama_quantize(lib, name, x)
    np.savez_compressed(out / "low_bit_formats.npz", **arrays)


def main(out: Path = FIXTURES) -> int:
    out.mkdir(parents=True, exist_ok=True)
    make_low_bit(out)
    make_coverage(out, resolve_model("smollm2-135m-instruct"))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
