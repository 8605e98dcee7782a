"""CudaBackend: ternary linears as Triton W2A8 kernels on packed 2-bit weights; dense linears via cuBLAS.

Chosen once at load for a model placed on a CUDA device (`select_backend("cuda", device=...)`).
Runtime layouts:
- bitnet-mode ternary weights with one scale per tensor (I2_S, TL1/TL2, TQ files whose blocks share a
  d) and K % 128 == 0: Layout.TERNARY_2BIT in the plane layout of kernels/cuda/ternary_pack.py, with an
  f32 [M] scale per output row (so q/k/v and gate/up stack into one weight each). Activations are
  quantized per token by `norm_quantize` (which the CUDA decoder fuses with the RMSNorm or the gated
  activation before it) and multiplied by `ternary_linear`: exact int32 dots and the reference's f32
  epilogue, so outputs are bit-identical to the reference backend's for any batch size.
- anything else (float / llamacpp-tq modes, per-block scales, odd K): the reference backend's weight
  with its tensors on the device. Correct, slow (f64 integer matmuls), and logged once at load.
- dense and block-quantized (Q4/Q8/F16) weights: dequantized at load to f32 on the device; F.linear
  with TF32 and reduced-precision reductions off, so results stay within fp32 summation-order
  tolerance of the CPU backends.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from bitserve.errors import UnsupportedModel
from bitserve.kernels.backend import FusedOps, KernelBackend, LinearMode, PreparedLinear
from bitserve.kernels.cuda.ternary_pack import GROUP, pack_ternary_planes
from bitserve.kernels.packed import Layout, PackedWeight, TernaryCodes
from bitserve.kernels.reference import ternary
from bitserve.kernels.reference.backend import ReferenceBackend
from bitserve.kernels.reference.dense import check_dense_weight

logger = logging.getLogger(__name__)


def cuda_available() -> bool:
    """True when torch sees a CUDA device and Triton imports (the kernels' compiler)."""
    if not torch.cuda.is_available():
        return False
    try:  # NOTE: deferred: Triton is only needed (and only installed) on GPU machines
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def configure_numerics() -> None:
    """fp32 matmuls in fp32 (no TF32) and half matmuls with fp32 reductions: CPU parity over speed,
    which the big linears do not pay (they are ternary kernels or bandwidth-bound GEMVs)."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    torch.backends.cuda.matmul.allow_fp16_reduced_precision_reduction = False
    torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction = False


class CudaDenseLinear(PreparedLinear):
    """f32 [M, K] on the device: cuBLAS."""

    __slots__ = ()

    def run(self, x: torch.Tensor, acts: object) -> torch.Tensor:
        return torch.nn.functional.linear(x, self.data)


class CudaTernaryLinear(PreparedLinear):
    """Packed planes uint8 [M, K // 4] and an f32 [M] row scale: int8 activations, Triton W2A8 kernel."""

    __slots__ = ()
    activation_key = "int8"

    def quantize(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        from bitserve.kernels.cuda.quantize import norm_quantize

        return norm_quantize(x, None, 0.0)  # (q int8 [T, K], s_act f32 [T])

    def run(self, x: torch.Tensor, acts: object) -> torch.Tensor:
        q, s_act = acts  # type: ignore[misc]
        return self.run_quantized(q, s_act)

    def run_quantized(
        self, q: torch.Tensor, s_act: torch.Tensor, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """q int8 [T, K], s_act f32 [T] (+ residual f32 [T, M]) -> f32 [T, M]."""
        from bitserve.kernels.cuda.ternary_matmul import ternary_linear

        assert self.scale is not None  # invariant: ternary weights carry their row scales
        return ternary_linear(q, s_act, self.data, self.scale, residual=residual)


class CudaBackend(KernelBackend):
    """Linear-layer compute on one CUDA device (see the module docstring)."""

    name = "cuda"

    def __init__(self, device: torch.device | str = "cuda") -> None:
        self.device = torch.device(device)
        if self.device.type == "cuda":
            configure_numerics()
        self._reference = ReferenceBackend()

    def prepare_ternary(self, codes: TernaryCodes, *, mode: LinearMode) -> PreparedLinear:
        m, k = ternary.check_ternary_codes(codes)
        if mode.kernel_mode is LinearMode.BITNET:
            codes = ternary.collapse_block_scales(codes)
            if codes.is_per_tensor and k % GROUP == 0:
                packed = pack_ternary_planes(codes.values.to(self.device))  # uint8 [M, K // 4]
                scale = codes.scale.to(torch.float32).reshape(1).expand(m).contiguous().to(self.device)
                return CudaTernaryLinear(m, k, Layout.TERNARY_2BIT, mode, packed, scale, self.name)
        logger.warning(
            "cuda backend: a %dx%d ternary weight in %s mode runs on the reference path (slow): %s",
            m,
            k,
            mode.value,
            "per-block scales" if not codes.is_per_tensor else f"K not a multiple of {GROUP}",
        )
        return self._adopt(self._reference.prepare_ternary(codes, mode=mode))

    def prepare_dense(self, weight: torch.Tensor) -> PreparedLinear:
        m, k = check_dense_weight(weight)
        data = weight.to(self.device).contiguous()
        return CudaDenseLinear(m, k, Layout.DENSE, None, data, None, self.name)

    def prepare_block(self, weight: PackedWeight) -> PreparedLinear | None:
        """No packed block form yet: Q4/Q8 weights are dequantized to f32 on the device at load."""
        return None

    def fuse_group(self, weights: Sequence[PreparedLinear]) -> tuple[PreparedLinear, list[int]] | None:
        """q/k/v and gate/up stacked into one weight when all are CudaTernaryLinear (row scales keep each
        weight's own scale) or all CudaDenseLinear: one kernel launch per group."""
        if len(weights) < 2 or len({w.in_features for w in weights}) != 1:
            return None
        strategy = type(weights[0])
        if strategy not in (CudaTernaryLinear, CudaDenseLinear) or any(
            type(w) is not strategy for w in weights
        ):
            return None
        offsets = [0]
        for weight in weights[:-1]:
            offsets.append(offsets[-1] + weight.out_features)
        first = weights[0]
        data = torch.cat([w.data for w in weights])
        scale = torch.cat([w.scale for w in weights]) if strategy is CudaTernaryLinear else None  # type: ignore[misc]
        stacked = strategy(
            sum(w.out_features for w in weights),
            first.in_features,
            first.layout,
            first.mode,
            data,
            scale,
            self.name,
        )
        return stacked, offsets

    def fused_ops(self) -> FusedOps | None:
        """None: the generic layers run eager torch on the device; the CUDA decoder
        (models/cuda_decoder.py) calls the fused Triton kernels itself."""
        return None

    def _adopt(self, prepared: PreparedLinear) -> PreparedLinear:
        """A reference weight re-made as this backend's, its tensors on the device."""
        if prepared.mode is None:
            raise UnsupportedModel("internal: only ternary weights fall back to the reference path")
        extras = {name: t.to(self.device) for name, t in prepared.extras.items()}
        return type(prepared)(
            prepared.out_features,
            prepared.in_features,
            prepared.layout,
            prepared.mode,
            prepared.data.to(self.device),
            prepared.scale.to(self.device) if prepared.scale is not None else None,
            self.name,
            extras,
        )
