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
- block weights (Q4_*, Q5_*, Q8_0, Q2_0 / Q1_0 and the K-quants, in block_layout.py's forms): kept packed
  for steps of up to GEMV_MAX_TOKENS tokens (block_gemv.py: one PDL launch that also takes the RMSNorm,
  the gated activation and the residual), plus an f32 copy that cuBLAS runs for longer steps (prefill,
  batched decode).
- dense (F16 / BF16 / F32) weights: f32 on the device; F.linear with TF32 and reduced-precision
  reductions off, so results stay within fp32 summation-order tolerance of the CPU backends.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from bitserve.errors import UnsupportedModel
from bitserve.kernels.backend import FusedOps, KernelBackend, LinearMode, PreparedLinear
from bitserve.kernels.cuda.block_layout import HELD_AS, repack_for_gemv
from bitserve.kernels.cuda.linears import CudaBlockLinear, CudaDenseLinear, CudaTernaryLinear
from bitserve.kernels.cuda.ternary_pack import GROUP, pack_ternary_planes
from bitserve.kernels.packed import Layout, PackedWeight, TernaryCodes
from bitserve.kernels.plan import CompiledDecoder, DecoderPlan
from bitserve.kernels.reference import ternary
from bitserve.kernels.reference.backend import ReferenceBackend
from bitserve.kernels.reference.dense import check_dense_weight
from bitserve.kernels.reference.dequant import block_rows, dequantize
from bitserve.kernels.tuning import DEFAULT_TUNING, KernelTuning

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


class CudaBackend(KernelBackend):
    """Linear-layer compute on one CUDA device (see the module docstring)."""

    name = "cuda"

    def __init__(self, device: torch.device | str = "cuda", tuning: KernelTuning = DEFAULT_TUNING) -> None:
        self.device = torch.device(device)
        self.tuning = tuning
        if self.device.type == "cuda":
            configure_numerics()
            from bitserve.kernels.cuda.pdl import configure_pdl  # NOTE: deferred: imports Triton

            configure_pdl(self.device, tuning.cuda_pdl)
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
        """Every block layout with a GEMV form (block_layout.HELD_AS: Q4_*, Q5_*, Q8_0, Q2_0 / Q1_0, the
        K-quants) -> CudaBlockLinear (packed for the GEMV, f32 for cuBLAS), its layout the form's name;
        None otherwise."""
        if weight.layout not in HELD_AS:
            return None
        m, k = weight.shape
        layout, parts = repack_for_gemv(block_rows(weight), weight.layout, k)
        extras = {"dense": dequantize(weight).to(self.device).contiguous()}
        if "m" in parts:
            extras["m"] = parts["m"].to(self.device)
        codes, d = parts["codes"].to(self.device), parts["d"].to(self.device)
        return CudaBlockLinear(m, k, layout, None, codes, d, self.name, extras)

    def fuse_group(self, weights: Sequence[PreparedLinear]) -> tuple[PreparedLinear, list[int]] | None:
        """q/k/v and gate/up stacked into one weight when all are CudaTernaryLinear (row scales keep each
        weight's own scale), all CudaDenseLinear, or all CudaBlockLinear of one layout: one kernel launch
        per group."""
        if len(weights) < 2 or len({w.in_features for w in weights}) != 1:
            return None
        strategy = type(weights[0])
        if strategy not in (CudaTernaryLinear, CudaDenseLinear, CudaBlockLinear) or any(
            type(w) is not strategy for w in weights
        ):
            return None
        if strategy is CudaBlockLinear:
            return self._stack_blocks(weights)
        offsets = _row_offsets(weights)
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

    def _stack_blocks(self, weights: Sequence[PreparedLinear]) -> tuple[PreparedLinear, list[int]] | None:
        """CudaBlockLinear weights of one layout stacked row-wise (every part is per row)."""
        if len({w.layout for w in weights}) != 1:
            return None
        offsets = _row_offsets(weights)
        extras = {name: torch.cat([w.extras[name] for w in weights]) for name in weights[0].extras}
        first = weights[0]
        stacked = CudaBlockLinear(
            sum(w.out_features for w in weights),
            first.in_features,
            first.layout,
            None,
            torch.cat([w.data for w in weights]),
            torch.cat([w.scale for w in weights]),  # type: ignore[misc]
            self.name,
            extras,
        )
        return stacked, offsets

    def fused_ops(self) -> FusedOps | None:
        """None: the generic layers run eager torch on the device; the compiled forward
        (kernels/cuda/decoder.py) calls the fused Triton kernels itself."""
        return None

    def compile_decoder(self, plan: DecoderPlan) -> CompiledDecoder | None:
        """The fused Triton chain (kernels/cuda/decoder.py); its tables and norms go to the device now.
        Raises UnsupportedModel for what it cannot run (ggml numerics, an activation without a kernel)."""
        from bitserve.kernels.cuda.decoder import CudaDecoder  # NOTE: deferred: imports Triton

        return CudaDecoder(plan, self.device, self.tuning)

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


def _row_offsets(weights: Sequence[PreparedLinear]) -> list[int]:
    """Where each weight's rows start in the stacked weight."""
    offsets = [0]
    for weight in weights[:-1]:
        offsets.append(offsets[-1] + weight.out_features)
    return offsets
