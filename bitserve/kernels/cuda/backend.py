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
- Q4_0 / Q4_1 / Q8_0 weights: kept packed for steps of up to GEMV_MAX_TOKENS tokens (block_gemv.py: one
  PDL launch that also takes the RMSNorm, the gated activation and the residual), plus an f32 copy that
  cuBLAS runs for longer steps (prefill, batched decode).
- dense (F16 / BF16 / F32) weights: f32 on the device; F.linear with TF32 and reduced-precision
  reductions off, so results stay within fp32 summation-order tolerance of the CPU backends.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

import torch

from bitserve.errors import InvalidModelFile, UnsupportedModel
from bitserve.kernels.backend import FusedOps, KernelBackend, LinearMode, PreparedLinear
from bitserve.kernels.cuda.block_layout import BLOCK_LAYOUTS, GEMV_MAX_TOKENS, block_tile, repack_blocks
from bitserve.kernels.cuda.ternary_pack import GROUP, pack_ternary_planes
from bitserve.kernels.packed import Layout, PackedWeight, TernaryCodes
from bitserve.kernels.reference import ternary
from bitserve.kernels.reference.backend import ReferenceBackend
from bitserve.kernels.reference.dense import check_dense_weight
from bitserve.kernels.reference.dequant import dequantize, row_bytes_of

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


class CudaBlockLinear(PreparedLinear):
    """A Q4_0 / Q4_1 / Q8_0 weight: data = codes, scale = d, extras["m"] (Q4) in block_gemv's layout, and
    extras["dense"] f32 [M, K] for steps of more than GEMV_MAX_TOKENS tokens (cuBLAS)."""

    __slots__ = ()

    def run(self, x: torch.Tensor, acts: object) -> torch.Tensor:
        return self.run_fused(x)

    def run_fused(
        self,
        x: torch.Tensor,
        norm_weight: torch.Tensor | None = None,
        eps: float = 0.0,
        *,
        activation: str | None = None,
        residual: torch.Tensor | None = None,
    ) -> torch.Tensor:
        """residual + W @ norm(act(x)): x f32 [T, K] ([T, 2K], gate then up, under `activation`),
        norm_weight f32 [K], residual f32 [T, M] -> f32 [T, M]. Short steps: one block_gemv launch;
        longer: the separate kernels and cuBLAS (which accumulates into `residual` in place)."""
        from bitserve.kernels.cuda.block_gemv import block_gemv
        from bitserve.kernels.cuda.elementwise import act_and_mul, rms_norm

        if x.shape[0] <= GEMV_MAX_TOKENS and block_tile(self.out_features, self.in_features) is not None:
            parts = {"codes": self.data, "d": self.scale}
            if "m" in self.extras:
                parts["m"] = self.extras["m"]
            return block_gemv(
                x, parts, self.out_features, norm_weight=norm_weight, eps=eps, activation=activation,
                residual=residual,
            )  # fmt: skip
        if activation is not None:
            x = act_and_mul(x, activation)
        if norm_weight is not None:
            x = rms_norm(x, norm_weight, eps)
        dense = self.extras["dense"]
        if residual is None:
            return torch.nn.functional.linear(x, dense)
        return residual.addmm_(x, dense.t())


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
        """q int8 [T, K], s_act f32 [T] (+ residual f32 [T, M]) -> f32 [T, M], in the original row order
        also for a weight whose rows `permute_rows` reordered for a pair epilogue."""
        from bitserve.kernels.cuda.ternary_matmul import ternary_linear

        assert self.scale is not None  # invariant: ternary weights carry their row scales
        order = self.extras.get("row_order")
        if order is None:
            return ternary_linear(q, s_act, self.data, self.scale, residual=residual)
        permuted = ternary_linear(q, s_act, self.data, self.scale)
        out = torch.empty_like(permuted)
        out[:, order] = permuted
        return out if residual is None else residual + out

    def run_paired(self, q: torch.Tensor, s_act: torch.Tensor, pair: int) -> torch.Tensor:
        """q int8 [T, K], s_act f32 [T] -> act(gate) * up f32 [T, M / 2]: a [gate | up] weight whose rows
        permute_rows interleaved (pair_epilogue.gated_row_order), through the gated pair epilogue."""
        from bitserve.kernels.cuda.ternary_matmul import ternary_linear

        assert self.scale is not None and "row_order" in self.extras  # invariant: permute_rows ran
        return ternary_linear(q, s_act, self.data, self.scale, pair=pair)

    def permute_rows(self, order: torch.Tensor) -> None:
        """Reorder the rows (row i becomes original row order[i], int64 [M]) in place, for the gated pair
        epilogue; `run_quantized` still answers in the original order."""
        if "row_order" in self.extras or order.shape != (self.out_features,):
            raise ValueError(f"a row order of {self.out_features} rows, once, got {tuple(order.shape)}")
        assert self.scale is not None  # invariant: ternary weights carry their row scales
        order = order.to(self.data.device)
        self.data = self.data[order].contiguous()
        self.scale = self.scale[order].contiguous()
        self.extras = {**self.extras, "row_order": order}


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
        """Q4_0 / Q4_1 / Q8_0 -> CudaBlockLinear (packed for the GEMV, f32 for cuBLAS); None otherwise."""
        if weight.layout not in BLOCK_LAYOUTS:
            return None
        m, k = weight.shape
        row_bytes = row_bytes_of(weight)  # raises for a K that is not a whole number of blocks
        if weight.data.dtype != torch.uint8 or weight.data.numel() != m * row_bytes:
            raise InvalidModelFile(
                f"{weight.layout.name} tensor of shape {weight.shape} holds {weight.data.numel()} bytes",
                expected=f"{m * row_bytes} bytes",
            )
        parts = repack_blocks(weight.data.reshape(m, row_bytes), weight.layout, k)
        extras = {"dense": dequantize(weight).to(self.device).contiguous()}
        if "m" in parts:
            extras["m"] = parts["m"].to(self.device)
        layout = Layout.Q8_0 if weight.layout is Layout.Q8_0 else Layout.Q4_1
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


def _row_offsets(weights: Sequence[PreparedLinear]) -> list[int]:
    """Where each weight's rows start in the stacked weight."""
    offsets = [0]
    for weight in weights[:-1]:
        offsets.append(offsets[-1] + weight.out_features)
    return offsets
