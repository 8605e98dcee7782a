"""The gated pair epilogue of the ternary linear: act(gate) * up where gate and up are made.

The stacked [gate | up] weight's rows are interleaved (gated_row_order: row 2p is gate row p, row 2p + 1
up row p), so a program of the GEMV (or a GEMM tile) holds both rows of a pair and writes
out[t, p] = act(gate) * up, f32 [T, I], instead of [T, 2I] for the next kernel to read back. Wdown's
norm_quantize then reads I values a token, not 2I, and runs no activation. Numerics are quantize.py's
`gated_product`, the same code (relu2: r = max(g, 0), (r * r) * u; silu: g / (1 + exp(-g)) * u with the
accurate expf), so Wdown's input is bit-identical.

Measured (2B-4T I2_S batch-1 graph replay, A/B on one machine): -13 µs a step on an H100 (1.105 ->
1.092 ms), -16 µs on an H200. RoPE and the KV-cache write in the q|k|v GEMV's epilogue the same way
(rows permuted into rotation pairs) measured slower: +22 to +44 µs a step (benchmarks/RESULTS.md,
2026-11-27 13:10–14:00).
Imports triton: load only on the CUDA path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bitserve.kernels.cuda.quantize import ACTIVATIONS, gated_product

# a pair kind is quantize.py's activation code: the epilogue computes what norm_quantize would
PAIR_NONE = ACTIVATIONS[None]
GATED_PAIRS = {name: code for name, code in ACTIVATIONS.items() if name is not None}


def gated_row_order(intermediate: int) -> torch.Tensor:
    """[gate | up] rows (2I) -> the order whose row 2p is gate row p and row 2p + 1 up row p: int64 [2I]."""
    gate = torch.arange(intermediate)
    return torch.stack([gate, gate + intermediate], dim=1).reshape(-1)


def out_width(pair: int, rows: int) -> int:
    """Columns of the output a weight of `rows` rows writes under `pair`."""
    if pair != PAIR_NONE and pair not in GATED_PAIRS.values():
        raise ValueError(f"unknown pair epilogue {pair}")
    if pair != PAIR_NONE and rows % 2:
        raise ValueError(f"a gated pair epilogue needs an even number of rows, got {rows}")
    return rows if pair == PAIR_NONE else rows // 2


@triton.jit
def pair_store(y, toks, tok_ok, pairs, pair_ok, out_ptr, M, PAIR: tl.constexpr, USE_LIBDEVICE: tl.constexpr):
    """y f32 [BT, BM]: finished rows of the interleaved weight (rows 2p, 2p + 1 = gate p, up p) ->
    out[toks, pairs] = act(gate) * up (out f32 [T, M / 2]); pairs [BP = BM / 2]."""
    BT: tl.constexpr = y.shape[0]
    BM: tl.constexpr = y.shape[1]
    gate, up = tl.split(tl.reshape(y, [BT, BM // 2, 2]))  # [BT, BP] each
    h = gated_product(gate, up, PAIR, USE_LIBDEVICE)
    mask = tok_ok[:, None] & pair_ok[None, :]
    tl.store(out_ptr + toks[:, None].to(tl.int64) * (M // 2) + pairs[None, :], h, mask=mask)
