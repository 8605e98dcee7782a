"""Batch-1 CUDA decode of SmolLM2-135M-shaped files in the block layouts the GEMV forms hold
(kernels/cuda/block_layout.py), each beside the same file on the f32 copies + cuBLAS path the forms
replaced, in one process on one card:

    python benchmarks/bench_gpu_forms.py [--out results.jsonl]

Files (written where missing by benchmarks/make_gpu_models.py from the carried vocab file, then requantized
by `bitserve quantize` for Q2_0): `q4_1` (every projection Q4_1: the Q4_1 form since the first CUDA
release), `q4_k_m` (llama.cpp's Q4_K_M types for SmolLM2: Q5_0, Q8_0, Q4_K, Q6_K), `q2_0` (the Bonsai
layout: d per 64 values). Rows: tok/s of each file on its forms (`gemv`) and with prepare_block declining
every layout but Q4_0 / Q4_1 / Q8_0 (`f32_copies`: what main ran for the others before the forms), and
their ratio. Then `kernel` rows at Bonsai-8B's (Qwen3-8B's) projection shapes, T = 1: the block GEMV on
Q2_0 / Q1_0 weights in their own 2- / 1-bit forms beside the same values in the nibble (Q4_1) form they
took before, µs per call from CUDA-graph replays over distinct weight copies (DRAM every call).
"""

from __future__ import annotations

import argparse
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from benchmarks.bench_gpu import ROOT, VOCAB, decode_rate, emit, graph_time_us, load_on_cuda  # noqa: E402
from benchmarks.gpu_read_floor import distinct_copies  # noqa: E402
from bitserve.kernels.cuda import backend as cuda_backend  # noqa: E402
from bitserve.kernels.cuda.block_layout import form_values, pack_codes, repack_for_gemv  # noqa: E402
from bitserve.kernels.packed import Layout  # noqa: E402
from bitserve.loader.low_bit_quantize import QUANTIZERS  # noqa: E402
from bitserve.loader.quantize_file import quantize_gguf  # noqa: E402

FOLDER = Path("/tmp/bitserve-gpu")
FIRST_FORMS = (Layout.Q4_0, Layout.Q4_1, Layout.Q8_0)  # the layouts the GEMV held before the forms
BONSAI_8B_SHAPES = ((24576, 4096), (4096, 12288), (6144, 4096))  # gate+up, down, q+k+v (Qwen3-8B)


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


def as_nibble_form(parts: dict[str, torch.Tensor], num_cols: int) -> dict[str, torch.Tensor]:
    """The same Q2_0 / Q1_0 values in the nibble form (d and m f32 per 32), as held before the 2- / 1-bit
    forms: codes c with value c d' + m (d' = d or 2 d, m = -d)."""
    values = form_values(parts, num_cols)  # f32 [M, K]
    d = parts["d"].float()  # [M, K / 32]
    scale = d * (2.0 if parts["codes"].shape[1] * 8 == num_cols else 1.0)
    codes = torch.round((values + d.repeat_interleave(32, dim=1)) / scale.repeat_interleave(32, dim=1))
    return {"codes": pack_codes(codes.to(torch.uint8), 4), "d": scale.contiguous(), "m": (-d).contiguous()}


def bench_low_bit_kernels(out: Path | None) -> None:
    from bitserve.kernels.cuda.block_gemv import block_gemv

    for layout in (Layout.Q2_0, Layout.Q1_0):
        for rows, cols in BONSAI_8B_SHAPES:
            weights = torch.randn(rows, cols).mul_(0.02).numpy()
            file_rows = torch.from_numpy(QUANTIZERS[layout.name](weights).reshape(rows, -1))
            _, own = repack_for_gemv(file_rows, layout, cols)
            row = {"bench": "kernel", "kernel": f"block GEMV {layout.name} {rows}x{cols} T=1"}
            x = torch.randn(1, cols, device="cuda")
            for name, parts in (("own_form", own), ("nibble_form", as_nibble_form(own, cols))):
                size = sum(t.numel() * t.element_size() for t in parts.values())
                copies = [{k: t.cuda() for k, t in parts.items()} for _ in range(distinct_copies(size))]
                us = graph_time_us(lambda i: block_gemv(x, copies[i], rows), len(copies))  # noqa: B023
                row |= {f"{name}_us": round(us, 2), f"{name}_GB_s": round(size / (us * 1e-6) / 1e9)}
            emit(row | {"speedup": round(row["nibble_form_us"] / row["own_form_us"], 3)}, out)


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
    bench_low_bit_kernels(args.out)


if __name__ == "__main__":
    main()
