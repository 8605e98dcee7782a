"""Batch-1 CUDA decode of SmolLM2-135M-shaped files in the block layouts the GEMV forms hold
(kernels/cuda/block_layout.py), each beside the same file on the f32 copies + cuBLAS path the forms
replaced, in one process on one card:

    python benchmarks/bench_gpu_forms.py [--out results.jsonl]

Files (written where missing by benchmarks/make_gpu_models.py from the carried vocab file, then requantized
by `bitserve quantize` for Q2_0): `q4_1` (every projection Q4_1: the Q4_1 form since the first CUDA
release), `q4_k_m` (llama.cpp's Q4_K_M types for SmolLM2: Q5_0, Q8_0, Q4_K, Q6_K), `q2_0` (the Bonsai
layout: d per 64 values). Rows: tok/s of each file on its forms (`gemv`) and with prepare_block declining
every layout but Q4_0 / Q4_1 / Q8_0 (`f32_copies`: what main ran for the others before the forms), and
their ratio.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.bench_gpu import ROOT, VOCAB, decode_rate, emit, load_on_cuda  # noqa: E402
from bitserve.kernels.cuda import backend as cuda_backend  # noqa: E402
from bitserve.kernels.packed import Layout  # noqa: E402
from bitserve.loader.quantize_file import quantize_gguf  # noqa: E402

FOLDER = Path("/tmp/bitserve-gpu")
FIRST_FORMS = (Layout.Q4_0, Layout.Q4_1, Layout.Q8_0)  # the layouts the GEMV held before the forms


def ensure_files() -> dict[str, Path]:
    maker = [sys.executable, str(ROOT / "benchmarks" / "make_gpu_models.py"), "smollm2"]
    files = {"q4_1": FOLDER / "smollm2-q4_1.gguf", "q4_k_m": FOLDER / "smollm2-q4_k_m.gguf"}
    for mix, path in files.items():
        if not path.exists():
            subprocess.run([*maker, str(path), "--tokenizer-from", str(VOCAB), "--mix", mix], check=True)
    files["q2_0"] = FOLDER / "smollm2-q2_0.gguf"
    if not files["q2_0"].exists():
        quantize_gguf(files["q4_1"], files["q2_0"], "Q2_0")
    return files


@contextmanager
def first_forms_only():
    """CudaBackend.prepare_block holding only Q4_0 / Q4_1 / Q8_0: the rest load as f32 copies."""
    held = cuda_backend.HELD_AS
    cuda_backend.HELD_AS = {layout: form for layout, form in held.items() if layout in FIRST_FORMS}
    try:
        yield
    finally:
        cuda_backend.HELD_AS = held


def rate(path: Path) -> float:
    llm = load_on_cuda(path, 1 << 30)
    try:
        return decode_rate(llm, 1, 128)["tok_s"]
    finally:
        llm.close()
        del llm
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=None, help="append the JSON rows to this file")
    args = parser.parse_args()
    for name, path in ensure_files().items():
        gemv = rate(path)
        with first_forms_only():
            copies = rate(path)
        row = {"bench": "forms", "model": f"smollm2-135m-{name}-shaped", "batch": 1}
        emit(row | {"gemv_tok_s": round(gemv, 1), "f32_copies_tok_s": round(copies, 1)}, args.out)
        emit(row | {"ratio_gemv_over_f32_copies": round(gemv / copies, 3)}, args.out)


if __name__ == "__main__":
    main()
