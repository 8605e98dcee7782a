"""numba glue between the int8 GEMVs of a fused decode step (kernels/cpu/fast_decode.py).

Each function does, in one call, the small per-layer work between two matmuls and hands the next matmul
its int8 activations. A decode step of a 30-layer model then makes 8 calls per layer from Python instead
of ~40 torch / numba ones. Two kinds of weights take two kinds of activations, chosen by the type of the
`kp` argument at compile time (quantize_for below): None for the Q4 / Q8_0 block weights
(blockdot.quantize_block_q8: q int8 [Tp, K], dx / sx f32 [Tp, nb]), the padded width Kp (an int) for the
ternary int8 kernels (int8dot.quantize_int8: q int8 [Tp, Kp], s_act f32 [T], q_sum int32
[T]). The norm, RoPE and attention arithmetic is the fused kernels' (kernels/cpu/fused.py); the gated
activations are silu_mul / relu2_mul / gelu_mul below, which the module forward on the cpu backend calls
too.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit, prange, types
from numba.extending import overload

from bitserve.kernels.cpu.blockdot import quantize_block_q8
from bitserve.kernels.cpu.fused import paged_decode_attention_kernel, rms_norm_kernel, rotary_kernel
from bitserve.kernels.cpu.int8dot import quantize_int8


def quantize_for(x: np.ndarray, kp: int | None, padded: int) -> tuple:
    """x f32 [T, K] -> the next GEMV's int8 activations, T padded to `padded` rows (numba only)."""
    raise NotImplementedError("called from numba code only")


@overload(quantize_for)
def _quantize_for(x, kp, padded):  # noqa: ANN001, ANN202 - numba compares these names with the lambdas'
    # chosen by kp's type while typing: the two quantizers return different tuples, and a compile-time
    # choice (unlike a function argument) keeps the callers' on-disk cache valid
    if isinstance(kp, types.NoneType):
        return lambda x, kp, padded: quantize_block_q8(x, padded)
    return lambda x, kp, padded: quantize_int8(x, kp, padded)


@njit(nogil=True, cache=True)
def norm_quantize(x: np.ndarray, weight: np.ndarray, eps: float, kp: int | None, padded: int) -> tuple:
    """RMSNorm(x f32 [T, N]) -> int8 activations of it, T padded to `padded` rows."""
    normed = np.empty_like(x)
    rms_norm_kernel(x, weight, eps, normed)
    return quantize_for(normed, kp, padded)


@njit(nogil=True, cache=True)
def sub_norm_quantize(
    x: np.ndarray, sub_norm: np.ndarray | None, eps: float, kp: int | None, padded: int
) -> tuple:
    """int8 activations of x f32 [T, N], RMSNorm'd first where the model has a sub-norm there."""
    if sub_norm is None:
        return quantize_for(x, kp, padded)
    return norm_quantize(x, sub_norm, eps, kp, padded)


@njit(nogil=True, cache=True)
def residual_norm_quantize(
    x: np.ndarray, delta: np.ndarray, weight: np.ndarray, eps: float, kp: int | None, padded: int
) -> tuple:
    """x += delta (in place, both f32 [T, N]: the residual stream and a projection's output), then
    norm_quantize(x)."""
    for t in range(x.shape[0]):
        for i in range(x.shape[1]):
            x[t, i] += delta[t, i]
    return norm_quantize(x, weight, eps, kp, padded)


@njit(nogil=True, cache=True, inline="always")
def _silu_mul_row(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    one = np.float32(1.0)
    for i in range(gate.shape[0]):
        g = gate[i]
        out[i] = g / (one + np.float32(math.exp(-g))) * up[i]


@njit(nogil=True, cache=True, inline="always")
def _relu2_mul_row(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    zero = np.float32(0.0)
    for i in range(gate.shape[0]):
        g = gate[i]
        r = zero if g <= zero else g
        out[i] = (r * r) * up[i]


# GELU's tanh approximation, 0.5 g (1 + tanh(sqrt(2 / pi) (g + 0.044715 g^3))), computed as the equal
# g / (1 + exp(-2 sqrt(2 / pi) (g + 0.044715 g^3))) (1 + tanh(z) = 2 / (1 + e^-2z)): libm's scalar expf
# is ~3x faster here than its tanhf (3.8 against 12.3 ns an element: tanhf cost ~4% of a Gemma step), and
# where tanh nears -1 this form keeps the bits 1 + tanh(z) cancels. torch's constants (f32 of sqrt(2 / pi)
# and of 0.044715); the doubling is exact.
GELU_TWO_BETA = np.float32(2.0) * np.float32(math.sqrt(2.0) * (2.0 / math.sqrt(math.pi)) * 0.5)
GELU_KAPPA = np.float32(0.044715)


@njit(nogil=True, cache=True, inline="always")
def _gelu_mul_row(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    one = np.float32(1.0)
    for i in range(gate.shape[0]):
        g = gate[i]
        inner = GELU_TWO_BETA * (g + GELU_KAPPA * (g * g * g))
        out[i] = g / (one + np.float32(math.exp(-inner))) * up[i]


# The step's activation codes (gated_quantize's `activation`): ints, not names, in compiled code
SILU, RELU2, GELU = 0, 1, 2


@njit(nogil=True, cache=True)
def silu_mul(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    """out = silu(gate) * up, all f32 [T, I] C-contiguous; silu(g) = g / (1 + e^-g) in f32. The one SiLU of
    the q8 mode: the module forward (CpuBackend.silu_and_mul) and the fast step both compute it with
    _silu_mul_row, elementwise and scalar (numba has no vector exp here: no SVML), so their results are
    identical, serial or parallel."""
    for t in range(gate.shape[0]):
        _silu_mul_row(gate[t], up[t], out[t])


@njit(nogil=True, cache=True)
def relu2_mul(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    """out = relu(gate)^2 * up, all f32 [T, I] C-contiguous, rounded as torch.relu(g).square() * up
    (two f32 products; NaN passes through relu as torch's does). The cpu backend's relu2 for both
    forwards (CpuBackend.relu2_and_mul)."""
    for t in range(gate.shape[0]):
        _relu2_mul_row(gate[t], up[t], out[t])


@njit(nogil=True, cache=True)
def gelu_mul(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    """out = gelu_tanh(gate) * up, all f32 [T, I] C-contiguous, in f32 by the sigmoid form above (SiLU's
    shape: last bits differ from torch's tanh form). The cpu backend's GELU for both forwards
    (CpuBackend.gelu_and_mul), so they agree to the bit."""
    for t in range(gate.shape[0]):
        _gelu_mul_row(gate[t], up[t], out[t])


# From this many tokens the gated activation (SiLU's scalar exp: ~0.2 ms a layer at 16 tokens) runs on
# numba's threads, in the lean step and CpuBackend's module forward alike; one fork/join (~30 us here)
# costs more than the work below it.
PARALLEL_GATE_TOKENS = 4


def is_parallel_gate(num_tokens: int) -> bool:
    return num_tokens >= PARALLEL_GATE_TOKENS


@njit(parallel=True, nogil=True, cache=True)
def silu_mul_parallel(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    """silu_mul over tokens in parallel (is_parallel_gate), the same elementwise arithmetic."""
    for t in prange(gate.shape[0]):
        _silu_mul_row(gate[t], up[t], out[t])


@njit(parallel=True, nogil=True, cache=True)
def relu2_mul_parallel(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    """relu2_mul over tokens in parallel (is_parallel_gate), the same elementwise arithmetic."""
    for t in prange(gate.shape[0]):
        _relu2_mul_row(gate[t], up[t], out[t])


@njit(parallel=True, nogil=True, cache=True)
def gelu_mul_parallel(gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    """gelu_mul over tokens in parallel (is_parallel_gate), the same elementwise arithmetic."""
    for t in prange(gate.shape[0]):
        _gelu_mul_row(gate[t], up[t], out[t])


@njit(nogil=True, cache=True)
def gated_mul(activation: int, parallel: bool, gate: np.ndarray, up: np.ndarray, out: np.ndarray) -> None:
    """out = act(gate) * up (f32 [T, I] each) for an activation code (SILU, RELU2, GELU), on numba's
    threads where `parallel`."""
    if activation == RELU2:
        if parallel:
            relu2_mul_parallel(gate, up, out)
        else:
            relu2_mul(gate, up, out)
    elif activation == GELU:
        if parallel:
            gelu_mul_parallel(gate, up, out)
        else:
            gelu_mul(gate, up, out)
    elif parallel:
        silu_mul_parallel(gate, up, out)
    else:
        silu_mul(gate, up, out)


@njit(nogil=True, cache=True)
def gated_quantize(
    gate_up: np.ndarray,
    intermediate: int,
    activation: int,
    sub_norm: np.ndarray | None,
    eps: float,
    kp: int | None,
    padded: int,
    parallel: bool,
) -> tuple:
    """gate_up f32 [T, 2 I] (gate columns, then up) -> int8 activations of act(gate) * up [T, I]
    (`activation`: SILU, RELU2 or GELU), through the FFN sub-norm where the model has one. `parallel`:
    the activation over tokens on numba's threads (batched steps: the scalar exp of SiLU is most of this
    call's time, and serial it left the second core idle); the elementwise arithmetic is the same either
    way."""
    gate = np.ascontiguousarray(gate_up[:, :intermediate])
    up = np.ascontiguousarray(gate_up[:, intermediate:])
    act = np.empty_like(gate)
    gated_mul(activation, parallel, gate, up, act)
    return sub_norm_quantize(act, sub_norm, eps, kp, padded)


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
    window: int,
    sub_norm: np.ndarray | None,
    eps: float,
    kp: int | None,
    padded: int,
) -> tuple:
    """One decode token per sequence (row t of qkv is sequence t). qkv f32 [T, (H + 2 KV) D]: q, k, v
    columns as the stacked projection writes them; RoPE on q and k, k and v written to their cache slots
    (pages f32 [num_blocks, block_size, KV, D]), paged attention over each sequence's seq_lens[t] keys
    (window > 0: its last `window` only), the attention sub-norm where the model has one, and the int8
    activations of the output [T, H D]."""
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
    paged_decode_attention_kernel(q, key_pages, value_pages, block_table, seq_lens, scale, window, out)
    return sub_norm_quantize(out.reshape(num_tokens, q_cols), sub_norm, eps, kp, padded)
