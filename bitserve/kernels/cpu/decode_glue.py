"""numba glue between the int8 block-weight GEMVs of a fused decode step (models/cpu_fast_decode.py).

Each function does, in one call, the small per-layer work between two matmuls and hands the next matmul
its int8 activations (blockdot.quantize_block_q8: q int8 [Tp, K], dx / sx f32 [Tp, nb]). A decode step
of a 30-layer model then makes 8 calls per layer from Python instead of ~40 torch / numba ones. The norm,
RoPE and attention arithmetic is the fused kernels' (kernels/cpu/fused.py); SiLU is silu_mul below, which
the module forward of the q8 mode calls too.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit

from bitserve.kernels.cpu.blockdot import quantize_block_q8
from bitserve.kernels.cpu.fused import paged_decode_attention_kernel, rms_norm_kernel, rotary_kernel


@njit(nogil=True, cache=True)
def norm_quantize(x: np.ndarray, weight: np.ndarray, eps: float, padded: int) -> tuple:
    """RMSNorm(x f32 [T, N]) -> int8 activations of it, T padded to `padded` rows."""
    normed = np.empty_like(x)
    rms_norm_kernel(x, weight, eps, normed)
    return quantize_block_q8(normed, padded)


@njit(nogil=True, cache=True)
def residual_norm_quantize(
    x: np.ndarray, delta: np.ndarray, weight: np.ndarray, eps: float, padded: int
) -> tuple:
    """x += delta (in place, both f32 [T, N]: the residual stream and a projection's output), then
    norm_quantize(x)."""
    for t in range(x.shape[0]):
        for i in range(x.shape[1]):
            x[t, i] += delta[t, i]
    return norm_quantize(x, weight, eps, padded)


@njit(nogil=True, cache=True)
def silu_mul(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    """out = silu(gate) * up, all f32 [T, I] C-contiguous; silu(g) = g / (1 + e^-g) in f32. The one SiLU of
    the q8 mode: the module forward (CpuBackend.silu_and_mul) and the fast step both call this
    specialization, so their results are identical."""
    one = np.float32(1.0)
    for t in range(gate.shape[0]):
        for i in range(gate.shape[1]):
            g = gate[t, i]
            out[t, i] = g / (one + np.float32(math.exp(-g))) * up[t, i]


@njit(nogil=True, cache=True)
def silu_mul_quantize(gate_up: np.ndarray, intermediate: int, padded: int) -> tuple:
    """gate_up f32 [T, 2 I] (gate columns, then up) -> int8 activations of silu(gate) * up [T, I]."""
    gate = np.ascontiguousarray(gate_up[:, :intermediate])
    up = np.ascontiguousarray(gate_up[:, intermediate:])
    act = np.empty_like(gate)
    silu_mul(gate, up, act)
    return quantize_block_q8(act, padded)


@njit(nogil=True, cache=True)
def rope_attend_quantize(
    qkv: np.ndarray,
    num_heads: int,
    num_kv_heads: int,
    positions: np.ndarray,
    cos: np.ndarray,
    sin: np.ndarray,
    rope_dim: int,
    is_neox: bool,
    key_pages: np.ndarray,
    value_pages: np.ndarray,
    slot_mapping: np.ndarray,
    block_table: np.ndarray,
    seq_lens: np.ndarray,
    scale: float,
    padded: int,
) -> tuple:
    """One decode token per sequence (row t of qkv is sequence t). qkv f32 [T, (H + 2 KV) D]: q, k, v
    columns as the stacked projection writes them; RoPE on q and k, k and v written to their cache slots
    (pages f32 [num_blocks, block_size, KV, D]), paged attention over each sequence's seq_lens[t] keys,
    and the int8 activations of the output [T, H D]."""
    num_tokens = qkv.shape[0]
    head_dim = key_pages.shape[3]
    block_size = key_pages.shape[1]
    q_cols, kv_cols = num_heads * head_dim, num_kv_heads * head_dim
    q = np.ascontiguousarray(qkv[:, :q_cols]).reshape(num_tokens, num_heads, head_dim)
    k = np.ascontiguousarray(qkv[:, q_cols : q_cols + kv_cols]).reshape(num_tokens, num_kv_heads, head_dim)
    rotary_kernel(q, k, positions, cos, sin, rope_dim, is_neox)
    for t in range(num_tokens):
        block, offset = slot_mapping[t] // block_size, slot_mapping[t] % block_size
        for h in range(num_kv_heads):
            for d in range(head_dim):
                key_pages[block, offset, h, d] = k[t, h, d]
                value_pages[block, offset, h, d] = qkv[t, q_cols + kv_cols + h * head_dim + d]
    out = np.empty_like(q)
    paged_decode_attention_kernel(q, key_pages, value_pages, block_table, seq_lens, scale, out)
    return quantize_block_q8(out.reshape(num_tokens, q_cols), padded)
