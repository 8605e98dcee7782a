"""The ternary lean decode step's layer loop as one numba call (models/cpu_fast_decode.py).

Run from Python, the loop made 8 calls a layer (4 GEMVs, 4 glue calls: kernels/cpu/decode_glue.py), each
paying numba's argument matching and a few NumPy / torch wrappers: ~20 ms a step of 30 layers on the
2B-4T model, a fifth of its step. Here the loop runs inside one compiled call, which calls the same glue
functions and the same int8 kernel entry points (kernels/cpu/int8dot.py) in the same order, so its
output is the Python loop's to the bit.

Every layer's weights are reached from one uint8 `base` array (models/cpu_fast_decode.weight_span: the
file mapping for I2_S, else the span of the repacked arrays' addresses) through per-layer row-offset
tables stacked as [L, M]; row scales, norms and the KV caches are stacked [L, ...] likewise (the engine
allocates the caches as views of one pool: runner/kv_cache.py), so a step passes a few arrays, not a
few per layer.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import njit

from bitserve.kernels.cpu import int8dot
from bitserve.kernels.cpu.decode_glue import (
    gated_quantize,
    norm_quantize,
    residual_norm_quantize,
    rope_attend_quantize,
)
from bitserve.kernels.cpu.isa import Isa

# Index of each projection in the step's stacked tables (offsets, row_scales, out_scales).
QKV, O_PROJ, GATE_UP, DOWN = 0, 1, 2, 3


@njit(nogil=True, cache=True)
def _project(
    gemv: Callable,
    gemm: Callable,
    base: np.ndarray,
    row_off: np.ndarray,
    row_scale: np.ndarray,
    out_scales: tuple | None,
    which: int,
    layer: int,
    acts: tuple,
    num_tokens: int,
) -> np.ndarray:
    """One stacked int8 projection of one layer -> f32 [num_tokens, M]: the GEMV for one token, the GEMM
    tile above (Int8BitnetLinear.run_quantized's choice), then the `bitnet` arch's per-output `.scale`
    where the model has them (LinearGroup's `out * scale`: one f32 product after the matmul)."""
    q, s_act, q_sum = acts
    out = np.empty((num_tokens, row_off.shape[0]), dtype=np.float32)
    if num_tokens == 1:
        gemv((base, row_off), q, q_sum, s_act, row_scale, out)
    else:
        gemm((base, row_off), q, q_sum, s_act, row_scale, out)
    if out_scales is not None:
        scale = out_scales[which][layer]
        for t in range(num_tokens):
            for r in range(out.shape[1]):
                out[t, r] = out[t, r] * scale[r]
    return out


@njit(nogil=True, cache=True)
def _decode_layers(
    gemv: Callable,
    gemm: Callable,
    x: np.ndarray,
    base: np.ndarray,
    offsets: tuple,
    row_scales: tuple,
    out_scales: tuple | None,
    norms: tuple,
    sub_norms: tuple | None,
    positions: np.ndarray,
    rope: tuple,
    kv_pool: np.ndarray,
    slot_mapping: np.ndarray,
    block_table: np.ndarray,
    seq_lens: np.ndarray,
    shape: tuple,
    eps: float,
    relu2: bool,
    parallel_gate: bool,
) -> None:
    """Every layer of one decode step (one token per sequence), x f32 [T, hidden] updated in place to the
    last layer's output (before the final norm). See decode_step(isa) for the arguments."""
    cos, sin, rope_dim, is_neox = rope
    num_heads, num_kv_heads, intermediate, attn_scale, kp_hidden, kp_attn, kp_inter, padded = shape
    attn_norms, ffn_norms = norms
    num_tokens = x.shape[0]
    delta = np.zeros_like(x)  # the last projection's output, added to x by the next glue call
    for layer in range(kv_pool.shape[0]):
        if layer == 0:
            acts = norm_quantize(x, attn_norms[0], eps, kp_hidden, padded)
        else:
            acts = residual_norm_quantize(x, delta, attn_norms[layer], eps, kp_hidden, padded)
        qkv = _project(
            gemv, gemm, base, offsets[QKV][layer], row_scales[QKV][layer], out_scales, QKV, layer, acts,
            num_tokens,
        )  # fmt: skip
        attn_sub_norm = None if sub_norms is None else sub_norms[0][layer]
        acts = rope_attend_quantize(
            qkv,
            num_heads,
            num_kv_heads,
            positions,
            cos,
            sin,
            rope_dim,
            is_neox,
            kv_pool[layer, 0],
            kv_pool[layer, 1],
            slot_mapping,
            block_table,
            seq_lens,
            attn_scale,
            attn_sub_norm,
            eps,
            kp_attn,
            padded,
        )
        attn_out = _project(
            gemv, gemm, base, offsets[O_PROJ][layer], row_scales[O_PROJ][layer], out_scales, O_PROJ, layer,
            acts, num_tokens,
        )  # fmt: skip
        acts = residual_norm_quantize(x, attn_out, ffn_norms[layer], eps, kp_hidden, padded)
        gate_up = _project(
            gemv, gemm, base, offsets[GATE_UP][layer], row_scales[GATE_UP][layer], out_scales, GATE_UP,
            layer, acts, num_tokens,
        )  # fmt: skip
        ffn_sub_norm = None if sub_norms is None else sub_norms[1][layer]
        acts = gated_quantize(
            gate_up, intermediate, relu2, ffn_sub_norm, eps, kp_inter, padded, parallel_gate
        )
        delta = _project(
            gemv, gemm, base, offsets[DOWN][layer], row_scales[DOWN][layer], out_scales, DOWN, layer, acts,
            num_tokens,
        )  # fmt: skip
    for t in range(num_tokens):
        for i in range(x.shape[1]):
            x[t, i] += delta[t, i]


# One entry point per ISA, passing that ISA's kernel entry points: a machine compiles (and caches) only
# the variant it runs (the VNNI kernels' instructions cannot even be compiled for an AVX2-only CPU).


@njit(nogil=True, cache=True)
def avx2_decode_layers(
    x, base, offsets, row_scales, out_scales, norms, sub_norms, positions, rope, kv_pool,  # noqa: ANN001
    slot_mapping, block_table, seq_lens, shape, eps, relu2, parallel_gate,  # noqa: ANN001
) -> None:  # fmt: skip
    _decode_layers(
        int8dot.avx2_gemv, int8dot.avx2_gemm, x, base, offsets, row_scales, out_scales, norms, sub_norms,
        positions, rope, kv_pool, slot_mapping, block_table, seq_lens, shape, eps, relu2, parallel_gate,
    )  # fmt: skip


@njit(nogil=True, cache=True)
def vnni_decode_layers(
    x, base, offsets, row_scales, out_scales, norms, sub_norms, positions, rope, kv_pool,  # noqa: ANN001
    slot_mapping, block_table, seq_lens, shape, eps, relu2, parallel_gate,  # noqa: ANN001
) -> None:  # fmt: skip
    _decode_layers(
        int8dot.vnni_gemv, int8dot.vnni_gemm, x, base, offsets, row_scales, out_scales, norms, sub_norms,
        positions, rope, kv_pool, slot_mapping, block_table, seq_lens, shape, eps, relu2, parallel_gate,
    )  # fmt: skip


DECODE_LAYERS: dict[Isa, Callable[..., None]] = {Isa.AVX2: avx2_decode_layers, Isa.VNNI: vnni_decode_layers}
