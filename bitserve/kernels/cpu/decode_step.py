"""The lean decode step's layer loop as one numba call (kernels/cpu/fast_decode.py), for ternary and for
Q4_0 / Q4_1 / Q8_0 block weights.

Run from Python, the loop made 8 calls a layer (4 GEMVs, 4 glue calls: kernels/cpu/decode_glue.py), each
paying numba's argument matching and a few NumPy / torch wrappers: 13-18 ms a step of 30 layers on the
2B-4T model, ~1-2 ms of SmolLM2's ~11 (benchmarks/RESULTS.md). Here the loop runs inside one compiled
call (~4 ms of glue left a 2B step), which calls the same glue functions and the same kernel entry points
(kernels/cpu/int8dot.py, blockdot.py) in the same order as the layers' own run_quantized, so its output
is the Python loop's to the bit.

Ternary weights are reached from one uint8 `base` array (kernels/cpu/ternary_step.address_span: the file
mapping for I2_S, else the span of the repacked arrays' addresses) through per-layer row-offset tables
stacked as [L, M]; block weights as a tuple of each layer's record array (kernels/cpu/block_step.py).
Row scales, norms and the KV caches are stacked [L, ...] (the engine allocates the caches as views of one
pool: runner/kv_cache.py), so a step passes a few arrays, not a few per layer.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
from numba import njit, types
from numba.extending import overload

from bitserve.kernels.cpu import blockdot, int8dot
from bitserve.kernels.cpu.decode_glue import (
    gated_quantize,
    norm_quantize,
    residual_norm_quantize,
    rope_attend_quantize,
)
from bitserve.kernels.cpu.fused import rms_norm_kernel
from bitserve.kernels.cpu.isa import Isa

# Index of each projection in the step's stacked tables (offsets, row_scales, out_scales).
QKV, O_PROJ, GATE_UP, DOWN = 0, 1, 2, 3


def _project(
    gemv: Callable, gemm: Callable, model: tuple, which: int, layer: int, acts: tuple, num_tokens: int
) -> np.ndarray:
    """Projection `which` (QKV, ...) of one layer on int8 activations -> f32 [num_tokens, M]; compiled
    code only (the overload below picks _project_ternary or _project_blocks by the model tuple's type)."""
    raise NotImplementedError("decode_step._project runs only inside numba-compiled code")


@overload(_project, jit_options={"nogil": True}, strict=False)
def _project_by_weight_kind(
    gemv: types.Type,
    gemm: types.Type,
    model: types.BaseTuple,
    which: types.Type,
    layer: types.Type,
    acts: types.Type,
    num_tokens: types.Type,
) -> Callable:
    # Chosen at compile time from the model tuple's first field (uint8 base array: ternary; a tuple per
    # projection of per-layer record arrays: blocks of one format; one flat tuple of record arrays:
    # blocks of mixed formats). Passing the projection as a function value instead made numba
    # refuse to cache the entry points ("uses dynamic globals"): a 63-69 s compile in every process.
    if isinstance(model.types[0], types.Array):
        return _project_ternary
    if isinstance(model.types[0].dtype, types.Array):  # one flat tuple of record arrays
        return _project_mixed_blocks
    return _project_blocks


def _project_ternary(
    gemv: Callable, gemm: Callable, model: tuple, which: int, layer: int, acts: tuple, num_tokens: int
) -> np.ndarray:
    """Projection `which` (QKV, ...) of one layer on int8 activations -> f32 [num_tokens, M]: the GEMV for
    one token, the GEMM tile above (Int8BitnetLinear.run_quantized's choice), then the `bitnet` arch's
    `.scale` products where the model has them."""
    base, offsets, row_scales, out_scales = model[0], model[1], model[2], model[3]
    row_off = offsets[which][layer]
    q, s_act, q_sum = acts
    out = np.empty((num_tokens, row_off.shape[0]), dtype=np.float32)
    if num_tokens == 1:
        gemv((base, row_off), q, q_sum, s_act, row_scales[which][layer], out)
    else:
        gemm((base, row_off), q, q_sum, s_act, row_scales[which][layer], out)
    _scale_outputs(out_scales, which, layer, out)
    return out


def _project_blocks(
    gemv: Callable, gemm: Callable, model: tuple, which: int, layer: int, acts: tuple, num_tokens: int
) -> np.ndarray:
    """The same for Q4_0 / Q4_1 / Q8_0 weights (Int8BlockLinear.run_quantized's calls): model[0][which]
    holds each layer's records uint8 [ceil(M / 4), nb, record], model[1][which] is M; acts (q, dx, sx)."""
    records, rows = model[0], model[1]
    q, dx, sx = acts
    out = np.empty((num_tokens, rows[which]), dtype=np.float32)
    if num_tokens == 1:
        gemv(records[which][layer], q, dx, sx, out)
    else:
        gemm(records[which][layer], q, dx, sx, out)
    return out


def _project_mixed_blocks(
    any_kind: Callable, unused: Callable, model: tuple, which: int, layer: int, acts: tuple, num_tokens: int
) -> np.ndarray:
    """The same for a model mixing block formats (block_step.MixedBlockStep): model[0] is one flat tuple
    of record arrays, model[1] int64 [4, L, P, 4] holds per projection and layer its parts (record index,
    kind, first output row, rows; rows 0 past the last part), model[2] each projection's M. Each part
    runs its kind's kernel (blockdot.ANY_KIND) over its own rows, as the module forward runs the
    projection's weights side by side; one part of all M rows writes the output directly."""
    records, parts, rows = model[0], model[1], model[2]
    q, dx, sx = acts
    out = np.empty((num_tokens, rows[which]), dtype=np.float32)
    table = parts[which, layer]
    for p in range(table.shape[0]):
        index, kind, start, count = table[p, 0], table[p, 1], table[p, 2], table[p, 3]
        if count == 0:
            break
        if count == out.shape[1]:
            any_kind(kind, records[index], q, dx, sx, out)
            continue
        part = np.empty((num_tokens, count), dtype=np.float32)
        any_kind(kind, records[index], q, dx, sx, part)
        out[:, start : start + count] = part
    return out


@njit(nogil=True, cache=True)
def _scale_outputs(out_scales: tuple | None, which: int, layer: int, out: np.ndarray) -> None:
    """out [T, M] *= the per-row `.scale` (LinearGroup's `out * scale`: one f32 product after the matmul),
    for a model that has them."""
    if out_scales is None:
        return
    scale = out_scales[which][layer]
    for t in range(out.shape[0]):
        for r in range(out.shape[1]):
            out[t, r] = out[t, r] * scale[r]


@njit(nogil=True, cache=True)
def _layer_vector(stacked: tuple | None, which: int, layer: int) -> np.ndarray | None:
    """Row `layer` of stacked[which] ([L, n] arrays), or None for a model without them (sub-norms)."""
    if stacked is None:
        return None
    return stacked[which][layer]


@njit(nogil=True, cache=True)
def _add_qkv_bias(qkv: np.ndarray, biases: np.ndarray | None, layer: int) -> None:
    """qkv f32 [T, M] += the layer's biases [M] (the module forward's `q + bq`: one f32 add), for a
    model that has them."""
    if biases is None:
        return
    bias = biases[layer]
    for t in range(qkv.shape[0]):
        for r in range(qkv.shape[1]):
            qkv[t, r] = qkv[t, r] + bias[r]


@njit(nogil=True, cache=True)
def _norm_qk_heads(
    qkv: np.ndarray, head_norms: tuple | None, layer: int, num_heads: int, num_kv_heads: int, eps: float
) -> None:
    """In place: each head of q and of k in qkv f32 [T, (H + 2 KVH) * D] RMSNorm'd with the layer's
    [head_dim] weights (rms_norm_kernel: the module forward's norm of [T * heads, D] rows), for a model
    that has them."""
    if head_norms is None:
        return
    q_norm, k_norm = head_norms[0][layer], head_norms[1][layer]
    head_dim, width = q_norm.shape[0], qkv.shape[1]
    flat = qkv.reshape(qkv.size)  # row t's q heads, then its k heads, are contiguous [heads, D] runs
    for t in range(qkv.shape[0]):
        q_start, k_start = t * width, t * width + num_heads * head_dim
        q = flat[q_start:k_start].reshape((num_heads, head_dim))
        rms_norm_kernel(q, q_norm, eps, q)
        k = flat[k_start : k_start + num_kv_heads * head_dim].reshape((num_kv_heads, head_dim))
        rms_norm_kernel(k, k_norm, eps, k)


@njit(nogil=True, cache=True)
def _add_bias_norm_heads(
    qkv: np.ndarray, qkv_extras: tuple, layer: int, num_heads: int, num_kv_heads: int, eps: float
) -> None:
    """What the model adds to q|k|v's output before RoPE: biases, then per-head q/k norms (each where
    the model has it)."""
    _add_qkv_bias(qkv, qkv_extras[0], layer)
    _norm_qk_heads(qkv, qkv_extras[1], layer, num_heads, num_kv_heads, eps)


@njit(nogil=True, cache=True)
def _post_norm(out: np.ndarray, post_norms: tuple | None, which: int, layer: int, eps: float) -> None:
    """In place: out f32 [T, hidden] (o_proj's output: which 0; down's: 1) RMSNorm'd with the layer's
    post-norm (Gemma; rms_norm_kernel, the module forward's norm), for a model that has them."""
    if post_norms is None:
        return
    rms_norm_kernel(out, post_norms[which][layer], eps, out)


@njit(nogil=True, cache=True)
def _attend_quantize(qkv: np.ndarray, model: tuple, step: tuple, layer: int) -> tuple:
    """qkv f32 [T, (H + 2 KVH) D] of one layer -> the int8 activations of its attention output [T, H D]:
    biases and q/k head norms, the layer's RoPE table (Gemma's sliding layers have their own), the KV
    write, attention over each sequence's keys (its last windows[layer] only, where > 0), the sub-norm
    (model and step as _decode_layers')."""
    sub_norms, qkv_extras, windows = model[5], model[6], model[8]
    positions, rope, kv_pool, slot_mapping, block_table, seq_lens, shape, eps = step[:8]
    cos, sin, rope_dim, is_neox, rope_of_layer = rope
    num_heads, num_kv_heads, attn_scale, kp_attn, padded = shape[0], shape[1], shape[3], shape[5], shape[7]
    _add_bias_norm_heads(qkv, qkv_extras, layer, num_heads, num_kv_heads, eps)
    table = rope_of_layer[layer]
    return rope_attend_quantize(
        qkv,
        num_heads,
        num_kv_heads,
        positions,
        cos[table],
        sin[table],
        rope_dim,
        is_neox,
        kv_pool[layer, 0],
        kv_pool[layer, 1],
        slot_mapping,
        block_table,
        seq_lens,
        attn_scale,
        windows[layer],
        _layer_vector(sub_norms, 0, layer),
        eps,
        kp_attn,
        padded,
    )


@njit(nogil=True, cache=True)
def _decode_layers(gemv: Callable, gemm: Callable, x: np.ndarray, model: tuple, step: tuple) -> None:
    """Every layer of one decode step (one token per sequence), x f32 [T, hidden] updated in place to the
    last layer's output (before the final norm). _project runs a projection (_project_ternary or
    _project_blocks, by the model's weight kind) with the variant's kernel entry points gemv / gemm.

    model (once per model, ternary_step.TernaryStep, block_step.BlockStep): ternary: base uint8
    [n]; offsets: row_off int64 [L, M] of qkv, o_proj, gate_up, down (byte offsets in base); row_scales:
    their f32 [L, M]; out_scales: their `.scale` products f32 [L, M], or None. Blocks: the records of
    each projection, one array a layer; the projections' row counts; None, None. Both then: norms: attn,
    ffn f32 [L, hidden]; sub_norms: attn f32 [L, H D], ffn f32 [L, I], or None; qkv_extras: (q|k|v
    biases f32 [L, (H + 2 KVH) D] or None, (q, k head norms f32 [L, D]) or None); post_norms: attn, ffn
    f32 [L, hidden] (Gemma: RMSNorm of o_proj's / down's output before its residual add) or None;
    windows: int64 [L], each layer's sliding window (0: none). step: positions int64 [T]; rope: (cos,
    sin: the model's R RoPE tables, f32 [max_positions, rope_dim / 2] each, rope_dim, is_neox, int64 [L]
    each layer's table); kv_pool f32 [L, 2, blocks, block_size, KV, D]; slot_mapping, block_table,
    seq_lens; shape: (heads, kv_heads, intermediate, attention scale, the glue's kp of the hidden,
    attention and intermediate widths, padded rows); eps; the activation (decode_glue.SILU, RELU2,
    GELU); parallel_gate."""
    norms, sub_norms, post_norms = model[4], model[5], model[7]
    kv_pool, shape, eps, activation, parallel_gate = step[2], step[6], step[7], step[8], step[9]
    intermediate, kp_hidden, kp_inter, padded = shape[2], shape[4], shape[6], shape[7]
    attn_norms, ffn_norms = norms
    num_tokens = x.shape[0]
    delta = np.zeros_like(x)  # the last projection's output, added to x by the next glue call
    for layer in range(kv_pool.shape[0]):
        if layer == 0:
            acts = norm_quantize(x, attn_norms[0], eps, kp_hidden, padded)
        else:
            acts = residual_norm_quantize(x, delta, attn_norms[layer], eps, kp_hidden, padded)
        qkv = _project(gemv, gemm, model, QKV, layer, acts, num_tokens)
        acts = _attend_quantize(qkv, model, step, layer)
        attn_out = _project(gemv, gemm, model, O_PROJ, layer, acts, num_tokens)
        _post_norm(attn_out, post_norms, 0, layer, eps)
        acts = residual_norm_quantize(x, attn_out, ffn_norms[layer], eps, kp_hidden, padded)
        gate_up = _project(gemv, gemm, model, GATE_UP, layer, acts, num_tokens)
        ffn_sub_norm = _layer_vector(sub_norms, 1, layer)
        acts = gated_quantize(
            gate_up, intermediate, activation, ffn_sub_norm, eps, kp_inter, padded, parallel_gate
        )
        delta = _project(gemv, gemm, model, DOWN, layer, acts, num_tokens)
        _post_norm(delta, post_norms, 1, layer, eps)
    for t in range(num_tokens):
        for i in range(x.shape[1]):
            x[t, i] += delta[t, i]


# One entry point per ISA (and block format), passing that variant's kernel entry points: a machine
# compiles (and caches) only what it runs (the VNNI kernels' instructions cannot even be compiled for an
# AVX2-only CPU). NOTE: written out, not made by a factory: numba does not cache closures (each process
# would compile the whole layer loop again, tens of seconds), nor functions taking dispatchers as
# arguments from Python.


@njit(nogil=True, cache=True)
def avx2_decode_layers(x: np.ndarray, model: tuple, step: tuple) -> None:
    _decode_layers(int8dot.avx2_gemv, int8dot.avx2_gemm, x, model, step)


@njit(nogil=True, cache=True)
def vnni_decode_layers(x: np.ndarray, model: tuple, step: tuple) -> None:
    _decode_layers(int8dot.vnni_gemv, int8dot.vnni_gemm, x, model, step)


@njit(nogil=True, cache=True)
def avx2_q4_1_decode_layers(x: np.ndarray, model: tuple, step: tuple) -> None:
    _decode_layers(blockdot.avx2_q4_1_gemv, blockdot.avx2_q4_1_gemm, x, model, step)


@njit(nogil=True, cache=True)
def avx2_q4_0_decode_layers(x: np.ndarray, model: tuple, step: tuple) -> None:
    _decode_layers(blockdot.avx2_q4_0_gemv, blockdot.avx2_q4_0_gemm, x, model, step)


@njit(nogil=True, cache=True)
def avx2_q8_0_decode_layers(x: np.ndarray, model: tuple, step: tuple) -> None:
    _decode_layers(blockdot.avx2_q8_0_gemv, blockdot.avx2_q8_0_gemm, x, model, step)


@njit(nogil=True, cache=True)
def vnni_q4_1_decode_layers(x: np.ndarray, model: tuple, step: tuple) -> None:
    _decode_layers(blockdot.vnni_q4_1_gemv, blockdot.vnni_q4_1_gemm, x, model, step)


@njit(nogil=True, cache=True)
def vnni_q4_0_decode_layers(x: np.ndarray, model: tuple, step: tuple) -> None:
    _decode_layers(blockdot.vnni_q4_0_gemv, blockdot.vnni_q4_0_gemm, x, model, step)


@njit(nogil=True, cache=True)
def vnni_q8_0_decode_layers(x: np.ndarray, model: tuple, step: tuple) -> None:
    _decode_layers(blockdot.vnni_q8_0_gemv, blockdot.vnni_q8_0_gemm, x, model, step)


@njit(nogil=True, cache=True)
def avx2_q2_0_decode_layers(x: np.ndarray, model: tuple, step: tuple) -> None:
    _decode_layers(blockdot.avx2_q2_0_gemv, blockdot.avx2_q2_0_gemm, x, model, step)


@njit(nogil=True, cache=True)
def avx2_q1_0_decode_layers(x: np.ndarray, model: tuple, step: tuple) -> None:
    _decode_layers(blockdot.avx2_q1_0_gemv, blockdot.avx2_q1_0_gemm, x, model, step)


@njit(nogil=True, cache=True)
def vnni_q2_0_decode_layers(x: np.ndarray, model: tuple, step: tuple) -> None:
    _decode_layers(blockdot.vnni_q2_0_gemv, blockdot.vnni_q2_0_gemm, x, model, step)


@njit(nogil=True, cache=True)
def vnni_q1_0_decode_layers(x: np.ndarray, model: tuple, step: tuple) -> None:
    _decode_layers(blockdot.vnni_q1_0_gemv, blockdot.vnni_q1_0_gemm, x, model, step)


@njit(nogil=True, cache=True)
def avx2_q5_0_decode_layers(x: np.ndarray, model: tuple, step: tuple) -> None:
    _decode_layers(blockdot.avx2_q5_0_gemv, blockdot.avx2_q5_0_gemm, x, model, step)


@njit(nogil=True, cache=True)
def avx2_q5_1_decode_layers(x: np.ndarray, model: tuple, step: tuple) -> None:
    _decode_layers(blockdot.avx2_q5_1_gemv, blockdot.avx2_q5_1_gemm, x, model, step)


@njit(nogil=True, cache=True)
def vnni_q5_0_decode_layers(x: np.ndarray, model: tuple, step: tuple) -> None:
    _decode_layers(blockdot.vnni_q5_0_gemv, blockdot.vnni_q5_0_gemm, x, model, step)


@njit(nogil=True, cache=True)
def vnni_q5_1_decode_layers(x: np.ndarray, model: tuple, step: tuple) -> None:
    _decode_layers(blockdot.vnni_q5_1_gemv, blockdot.vnni_q5_1_gemm, x, model, step)


@njit(nogil=True, cache=True)
def avx2_q4_k_decode_layers(x: np.ndarray, model: tuple, step: tuple) -> None:
    _decode_layers(blockdot.avx2_q4_k_gemv, blockdot.avx2_q4_k_gemm, x, model, step)


@njit(nogil=True, cache=True)
def vnni_q4_k_decode_layers(x: np.ndarray, model: tuple, step: tuple) -> None:
    _decode_layers(blockdot.vnni_q4_k_gemv, blockdot.vnni_q4_k_gemm, x, model, step)


@njit(nogil=True, cache=True)
def avx2_q5_k_decode_layers(x: np.ndarray, model: tuple, step: tuple) -> None:
    _decode_layers(blockdot.avx2_q5_k_gemv, blockdot.avx2_q5_k_gemm, x, model, step)


@njit(nogil=True, cache=True)
def vnni_q5_k_decode_layers(x: np.ndarray, model: tuple, step: tuple) -> None:
    _decode_layers(blockdot.vnni_q5_k_gemv, blockdot.vnni_q5_k_gemm, x, model, step)


@njit(nogil=True, cache=True)
def avx2_q6_k_decode_layers(x: np.ndarray, model: tuple, step: tuple) -> None:
    _decode_layers(blockdot.avx2_q6_k_gemv, blockdot.avx2_q6_k_gemm, x, model, step)


@njit(nogil=True, cache=True)
def vnni_q6_k_decode_layers(x: np.ndarray, model: tuple, step: tuple) -> None:
    _decode_layers(blockdot.vnni_q6_k_gemv, blockdot.vnni_q6_k_gemm, x, model, step)


@njit(nogil=True, cache=True)
def avx2_mixed_decode_layers(x: np.ndarray, model: tuple, step: tuple) -> None:
    _decode_layers(blockdot.avx2_any_kind, blockdot.avx2_any_kind, x, model, step)


@njit(nogil=True, cache=True)
def vnni_mixed_decode_layers(x: np.ndarray, model: tuple, step: tuple) -> None:
    _decode_layers(blockdot.vnni_any_kind, blockdot.vnni_any_kind, x, model, step)


MIXED_DECODE_LAYERS: dict[Isa, Callable[..., None]] = {
    Isa.AVX2: avx2_mixed_decode_layers,
    Isa.VNNI: vnni_mixed_decode_layers,
}
DECODE_LAYERS: dict[Isa, Callable[..., None]] = {Isa.AVX2: avx2_decode_layers, Isa.VNNI: vnni_decode_layers}
BLOCK_DECODE_LAYERS: dict[tuple[Isa, str], Callable[..., None]] = {
    (Isa.AVX2, "q4_1"): avx2_q4_1_decode_layers,
    (Isa.AVX2, "q4_0"): avx2_q4_0_decode_layers,
    (Isa.AVX2, "q8_0"): avx2_q8_0_decode_layers,
    (Isa.VNNI, "q4_1"): vnni_q4_1_decode_layers,
    (Isa.VNNI, "q4_0"): vnni_q4_0_decode_layers,
    (Isa.VNNI, "q8_0"): vnni_q8_0_decode_layers,
    (Isa.AVX2, "q2_0"): avx2_q2_0_decode_layers,
    (Isa.AVX2, "q1_0"): avx2_q1_0_decode_layers,
    (Isa.VNNI, "q2_0"): vnni_q2_0_decode_layers,
    (Isa.VNNI, "q1_0"): vnni_q1_0_decode_layers,
    (Isa.AVX2, "q5_0"): avx2_q5_0_decode_layers,
    (Isa.AVX2, "q5_1"): avx2_q5_1_decode_layers,
    (Isa.VNNI, "q5_0"): vnni_q5_0_decode_layers,
    (Isa.VNNI, "q5_1"): vnni_q5_1_decode_layers,
    (Isa.AVX2, "q4_k"): avx2_q4_k_decode_layers,
    (Isa.VNNI, "q4_k"): vnni_q4_k_decode_layers,
    (Isa.AVX2, "q5_k"): avx2_q5_k_decode_layers,
    (Isa.VNNI, "q5_k"): vnni_q5_k_decode_layers,
    (Isa.AVX2, "q6_k"): avx2_q6_k_decode_layers,
    (Isa.VNNI, "q6_k"): vnni_q6_k_decode_layers,
}
