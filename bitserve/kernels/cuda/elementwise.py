"""Small fused ops of the CUDA decoder's dense path (Triton): RMSNorm and the gated FFN activation.

Each is one launch where the eager torch layers make 3-8 (a SmolLM2 decode step is ~30 layers of
sub-10 µs kernels: launches, not bytes, bound it). Numerics follow layers/norm.py and
layers/activation.py: the sum of squares accumulates in float64, inv_rms = 1 / sqrt(fl32(ms) + eps) with
IEEE sqrt and division, then x * inv_rms * w as two f32 multiplies.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bitserve.kernels.cuda.pdl import launch_options, pdl_enter

ACTIVATIONS = {"silu": 0, "relu2": 1, "relu_sqr": 1, "gelu": 2}
MAX_ROW_BLOCK = 16384


@triton.jit
def inv_rms(sum_squares, num_cols, eps):
    """f64 sum of a row's squares -> f32 1 / sqrt(fl32(sum / num_cols) + eps), IEEE sqrt and division:
    layers/norm.py's arithmetic, shared by every kernel that normalizes a row."""
    mean_square = (sum_squares / num_cols).to(tl.float32)
    return tl.div_rn(1.0, tl.sqrt_rn(mean_square + eps))


@triton.jit
def activate(gate, ACT: tl.constexpr):
    """act(gate) f32 for ACTIVATIONS' code ACT (layers/activation.py's expressions, tl.exp)."""
    if ACT == 0:  # silu(g) = g * sigmoid(g)
        activated = gate / (1.0 + tl.exp(-gate))
    elif ACT == 1:  # relu(g)^2
        relu = tl.maximum(gate, 0.0)
        activated = relu * relu
    else:  # gelu, tanh approximation
        inner = 0.7978845608028654 * (gate + 0.044715 * gate * gate * gate)
        tanh = 2.0 / (1.0 + tl.exp(-2.0 * inner)) - 1.0
        activated = 0.5 * gate * (1.0 + tanh)
    return activated


@triton.jit
def _rms_norm_kernel(
    x_ptr, w_ptr, res_ptr, out_ptr, n_cols, x_stride, res_stride, out_stride, eps, BLOCK: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)  # a weight: read before the PDL wait
    pdl_enter(USE_PDL)
    x = tl.load(x_ptr + row * x_stride + cols, mask=mask, other=0.0)  # f32 [BLOCK]
    wide = x.to(tl.float64)
    scale = inv_rms(tl.sum(wide * wide, axis=0), n_cols, eps)
    normed = (x * scale) * w
    if HAS_RESIDUAL:  # Gemma's post-norm: residual + rms_norm(block output), as the module adds it
        normed = tl.load(res_ptr + row * res_stride + cols, mask=mask, other=0.0) + normed
    tl.store(out_ptr + row * out_stride + cols, normed.to(out_ptr.dtype.element_ty), mask=mask)


def rms_norm(
    x: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    out_dtype: torch.dtype = torch.float32,
    *,
    residual: torch.Tensor | None = None,
) -> torch.Tensor:
    """x f32 [T, N] (unit column stride), weight f32 [N] -> [T, N] in out_dtype: f32, or f16 / bf16
    rounded to nearest even from the f32 result (what .to(out_dtype) of the f32 output gives, in the
    same launch: the decode graphs' final norm feeds an F16 LM head so). residual f32 [T, N] (unit
    column stride), when given: residual + the f32 norm, in the same launch (f32 output only)."""
    num_rows, num_cols = x.shape
    if num_cols > MAX_ROW_BLOCK:
        raise ValueError(f"rms_norm rows of {num_cols} values exceed {MAX_ROW_BLOCK}")
    if out_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise ValueError(f"rms_norm writes f32, f16 or bf16, not {out_dtype}")
    if residual is not None and (
        residual.shape != x.shape
        or residual.dtype != torch.float32
        or residual.stride(1) != 1
        or out_dtype != torch.float32
    ):
        raise ValueError(f"rms_norm's residual must be f32 {tuple(x.shape)} with unit column stride")
    out = torch.empty((num_rows, num_cols), dtype=out_dtype, device=x.device)
    if num_rows:
        block = triton.next_power_of_2(num_cols)
        res, res_stride = (x, 0) if residual is None else (residual, residual.stride(0))
        _rms_norm_kernel[(num_rows,)](
            x, weight, res, out, num_cols, x.stride(0), res_stride, out.stride(0), eps, BLOCK=block,
            HAS_RESIDUAL=residual is not None, **launch_options(x.device),
        )  # fmt: skip
    return out


@triton.jit
def _act_mul_kernel(
    gu_ptr, out_ptr, width, gu_stride, out_stride,
    ACT: tl.constexpr, BLOCK: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    pdl_enter(USE_PDL)
    row = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    gate = tl.load(gu_ptr + row * gu_stride + cols, mask=mask, other=0.0)
    up = tl.load(gu_ptr + row * gu_stride + width + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * out_stride + cols, activate(gate, ACT) * up, mask=mask)


def act_and_mul(gate_up: torch.Tensor, activation: str) -> torch.Tensor:
    """gate_up f32 [T, 2 I] (gate columns first) -> act(gate) * up f32 [T, I]."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}")
    num_rows, width = gate_up.shape[0], gate_up.shape[1] // 2
    out = torch.empty((num_rows, width), dtype=torch.float32, device=gate_up.device)
    if num_rows:
        block = 1024
        grid = (num_rows, triton.cdiv(width, block))
        _act_mul_kernel[grid](
            gate_up,
            out,
            width,
            gate_up.stride(0),
            out.stride(0),
            ACT=ACTIVATIONS[activation],
            BLOCK=block,
            **launch_options(gate_up.device),
        )
    return out
