"""CpuBackend: ternary linears on packed 2-bit weights with numba kernels; dense linears via torch.

Runtime layout of every ternary weight: Layout.TERNARY_2BIT (uint8 [M, pad128(K) / 4], ~2 bits per
weight), which is I2_S variant A's byte layout: such weights are read in place from the file mapping
(`prepare_ternary_file`, kernels/cpu/mapped.py), other formats are repacked at load. bitnet mode is
bit-exact with the reference backend for every batch size. Its kernels depend on the ISA variant chosen
once per backend (`CpuBackend.isa`, kernels/cpu/isa.py):
- vnni / avx2 (x86 with AVX2): int8 activations and `vpdpbusd` / `vpmaddubsw` integer dots emitted
  through numba intrinsics (kernels/cpu/int8dot.py), one GEMV tile for T = 1 and one GEMM tile (weights
  read once per step) above, for every batch size: ~3-5x the generic kernels, 2-3x the sgemm path.
generic (no AVX2, or forced):
- T < gemm_min_tokens (decode): numba kernel; per output row, unpack to int16 codes once, then an int32
  dot (vpmaddwd) per token. ~2.3-3.3x faster than torch fp32 F.linear at T = 1 (2 threads);
- T >= gemm_min_tokens (prefill): rows are unpacked in chunks to f32 t values and multiplied with the
  int8 activations (as f32) by torch's sgemm: about fp32 F.linear speed, without an fp32 weight copy.
  Exact: every product and partial sum is an integer of magnitude <= 128 * K <= 2^23, so fp32 adds and
  FMAs never round (hence K <= MAX_EXACT_F32_K; larger K stays on the numba kernel).
float mode always uses the chunked sgemm (decoded t * scale); llamacpp-tq mode a numba emulation of
ggml's AVX2 TQ2_0 dot product (FMA included). Dense weights use torch.nn.functional.linear (MKL sgemm).
Q4_0 / Q4_1 / Q8_0 weights stay block-quantized (`prepare_block`, kernels/cpu/blockquant.py): numba
dot products for T < block_gemm_min_tokens, chunked dequantize + sgemm above; fp32-tolerance parity.
With `max_dense_weight_bytes`, block weights also keep an f32 copy (decoded once, at load) while the
budget lasts, and batches of block_gemm_min_tokens or more run one sgemm on it: batched decode and
prefill then skip the per-step dequantization that dominated them (see benchmarks/RESULTS.md), at the
cost of 4 bytes per weight. GEMV (decode, T < block_gemm_min_tokens) always reads the packed blocks.

Each `prepare_*` picks the strategy once and returns its prepared weight (kernels/cpu/prepared.py),
which runs it: a step only switches on the batch size.

Threads: numba's OpenMP layer shares libgomp with torch. bitserve/__init__.py bounds how long a waiting
thread spins (GOMP_SPINCOUNT); OMP_WAIT_POLICY=PASSIVE (set before torch is imported) suits a machine whose
cores other heavy processes share: spin-waiting workers there cost ~8 ms per call.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable, Sequence
from types import MappingProxyType

import numba
import numpy as np
import torch
from numba.core.errors import NumbaError

from bitserve.errors import UnsupportedModel
from bitserve.kernels.backend import FusedOps, KernelBackend, LinearMode, PreparedLinear
from bitserve.kernels.cpu import (
    blockquant,
    decode_glue,
    f16head,
    five_bit_records,
    fused,
    interleaved,
    k_quant_records,
    low_bit_records,
    mapped,
)
from bitserve.kernels.cpu import ternary as kernels
from bitserve.kernels.cpu.fast_decode import FastCpuDecode
from bitserve.kernels.cpu.group_stacking import stack_groups, stack_rows, stackable_records
from bitserve.kernels.cpu.isa import (
    INT8_BLOCK_ACTIVATIONS,
    Isa,
    resolve_block_activations,
    resolve_isa,
    supported_isas,
)
from bitserve.kernels.cpu.prepared import (
    NEVER,
    BitnetBlockLinear,
    BitnetLinear,
    BlockLinear,
    CpuTuning,
    DenseLinear,
    FloatTernaryLinear,
    Int8BitnetBlockLinear,
    Int8BitnetLinear,
    Int8BlockLinear,
    Q4Linear,
    Q8Linear,
    TqLinear,
)
from bitserve.kernels.packed import LOW_BIT_LAYOUTS, Layout, PackedWeight, TernaryCodes
from bitserve.kernels.plan import CompiledDecoder, DecoderPlan
from bitserve.kernels.reference import ternary as reference
from bitserve.kernels.reference.dense import check_dense_weight
from bitserve.kernels.reference.dequant import block_rows

logger = logging.getLogger(__name__)

DEFAULT_GEMM_MIN_TOKENS = 24  # measured crossover of the numba kernel and the chunked sgemm
# crossover of the Q4_* / Q8_0 kernels and dequantize + sgemm (2 cores, benchmarks/RESULTS.md): the f32
# kernels lose from 8 tokens, the int8 ones (q8 activations) win up to 64 and lose from 128
BLOCK_GEMM_MIN_TOKENS = {"f32": 8, "q8": 96, "ggml": NEVER}  # ggml: llama.cpp rounds every batch
# bytes per 32-value block; Q5_0 / Q5_1 run only on the int8 tile (no f32 kernel: FIVE_BIT_LAYOUTS)
BLOCK_TYPE_SIZES = {Layout.Q4_0: 18, Layout.Q4_1: 20, Layout.Q8_0: 34, Layout.Q5_0: 22, Layout.Q5_1: 24}
FIVE_BIT_LAYOUTS = frozenset({Layout.Q5_0, Layout.Q5_1})
K_QUANT_LAYOUTS = frozenset(
    {Layout.Q2_K, Layout.Q3_K, Layout.Q4_K, Layout.Q5_K, Layout.Q6_K}
)  # the K-quants with an int8-tile kernel
# GATED_ACTIVATIONS names (layers/activation.py) of relu(gate)^2 * up
RELU2_NAMES = frozenset({"relu2", "relu_sqr"})


@functools.cache
def is_available() -> bool:
    """True if numba compiles and runs a trivial function here (the real kernels compile on first use
    and are cached on disk by numba, cache=True). Computed once per process."""
    try:
        return int(kernels.smoke_test(np.arange(4, dtype=np.int16))) == 6
    except (NumbaError, OSError, RuntimeError) as exc:  # numba / LLVM cannot build code here
        logger.warning("numba is importable but cannot compile kernels (%s); cpu backend disabled", exc)
        return False


class CpuBackend(KernelBackend):
    """numba CPU kernels over packed ternary weights (see module docstring)."""

    name = "cpu"

    def __init__(
        self,
        *,
        gemm_min_tokens: int = DEFAULT_GEMM_MIN_TOKENS,
        num_threads: int | None = None,
        block_kernels: bool = True,
        block_gemm_min_tokens: int | None = None,
        max_dense_weight_bytes: int = 0,
        isa: Isa | str | None = None,
        block_activations: str | None = None,
    ) -> None:
        """gemm_min_tokens: batch size from which bitnet mode uses the chunked exact sgemm (generic ISA).
        num_threads: numba threads for this backend's kernels (numba's setting is per calling thread,
        so it is applied on every call); None keeps numba's default (all cores).
        block_kernels: keep Q4_0 / Q4_1 / Q8_0 weights packed (False: the loader dequantizes them to f32).
        block_gemm_min_tokens: batch size from which packed block weights use chunked dequantize + sgemm
        (None: BLOCK_GEMM_MIN_TOKENS of the block activations).
        max_dense_weight_bytes: budget of f32 copies of block weights for those batches (0: none).
        isa: the bitnet-mode ternary kernel variant (an Isa or its name; kernels/cpu/isa.py; the engine
        passes KernelTuning.cpu_isa): None or "auto", the best this CPU supports. ValueError if it cannot
        run here.
        block_activations: how Q4_0 / Q4_1 / Q8_0 weights meet activations below block_gemm_min_tokens:
        "q8" (int8 per 32-value block, llama.cpp's numerics, kernels/cpu/blockdot.py; needs the avx2 or
        vnni variant), "ggml" (the same kernels on llama.cpp's own rounding per weight type, at every batch
        size: kernels/cpu/ggml_activations.py) or "f32" (exact f32 activations, kernels/cpu/blockquant.py).
        None: "q8" where the ISA allows it, else "f32"."""
        if num_threads is not None and not 1 <= num_threads <= numba.config.NUMBA_NUM_THREADS:
            raise ValueError(f"num_threads must be in 1..{numba.config.NUMBA_NUM_THREADS}, got {num_threads}")
        self.gemm_min_tokens = gemm_min_tokens
        self.num_threads = num_threads
        self.block_kernels = block_kernels
        if max_dense_weight_bytes < 0:
            raise ValueError(f"max_dense_weight_bytes must be >= 0, got {max_dense_weight_bytes}")
        self.dense_bytes_left = max_dense_weight_bytes  # spent at load, weight by weight, in load order
        self._isa = resolve_isa(isa)
        self.block_activations = resolve_block_activations(block_activations, self._isa)
        if block_gemm_min_tokens is None:
            block_gemm_min_tokens = BLOCK_GEMM_MIN_TOKENS[self.block_activations]
        self.block_gemm_min_tokens = block_gemm_min_tokens
        logger.info(
            "cpu backend: ternary kernels %s (supported here: %s), block-weight activations %s",
            self._isa.value,
            ", ".join(s.value for s in supported_isas()),
            self.block_activations,
        )
        ggml = self.block_activations == "ggml"
        self.tuning = CpuTuning(gemm_min_tokens, block_gemm_min_tokens, num_threads, self._isa, ggml)

    def describe(self) -> dict[str, str]:
        return {**super().describe(), "isa": self._isa.value}

    @property
    def isa(self) -> Isa:
        """The bitnet-mode ternary kernel variant chosen at construction (for logs, /health, benchmarks)."""
        return self._isa

    # ------------------------------------------------------------ load time: strategy chosen here

    def prepare_ternary(self, codes: TernaryCodes, *, mode: LinearMode) -> PreparedLinear:
        """Pack to Layout.TERNARY_2BIT. Raises UnsupportedModel for a shape the mode cannot run:
        llamacpp-tq needs K % 256 == 0; per-block scales need blocks of a multiple of 128 columns."""
        m, k = reference.check_ternary_codes(codes)
        mode = mode.kernel_mode  # bitnetcpp's linears are bitnet's
        if mode is LinearMode.BITNET:
            codes = reference.collapse_block_scales(codes)
        if not codes.is_per_tensor:
            block = k // codes.scale.shape[1]
            if block % kernels.GROUP_COLS != 0:
                raise UnsupportedModel(
                    f"cpu backend needs per-block scales over a multiple of {kernels.GROUP_COLS} columns, "
                    f"got blocks of {block}",
                    hint="use the reference backend for this model",
                )
        extras: dict[str, torch.Tensor] = {}
        if mode is LinearMode.LLAMACPP_TQ:
            if k % kernels.QK_K != 0:
                raise UnsupportedModel(
                    f"llamacpp-tq mode needs in_features to be a multiple of {kernels.QK_K}, got {k}",
                    hint="use the bitnet or float linear mode for this model",
                )
            extras["d_w"] = reference.f16_block_scales(codes)  # [M, K // 256]
            # packed in ggml's lane-major column order: the kernel decodes each row straight into it
            codes = TernaryCodes(values=codes.values[:, kernels.tq_lane_order(k)], scale=codes.scale)
        packed = kernels.pack_ternary(codes.values)  # [M, Kp / 4]
        scale_copy = codes.scale.clone(memory_format=torch.contiguous_format)  # kernels need C order
        return self._ternary(m, k, mode, packed, scale_copy, extras)

    def prepare_ternary_file(self, weight: PackedWeight, *, mode: LinearMode) -> PreparedLinear | None:
        """I2_S variant A in bitnet / bitnetcpp / float mode: its rows, a view of the file's bytes, are
        the runtime layout, so the weight is read in place (checked once, never copied: the mapping's
        pages stay file-backed); a one-d TQ2_0 weight is transcoded to it at the speed of a copy. None for
        any other (kernels/cpu/mapped.py): the loader then unpacks it for prepare_ternary."""
        mode = mode.kernel_mode
        found = None if mode is LinearMode.LLAMACPP_TQ else mapped.kernel_rows(weight)
        return None if found is None else self._ternary(*weight.shape, mode, *found, {})

    def _ternary(
        self, m: int, k: int, mode: LinearMode, packed: torch.Tensor, scale: torch.Tensor, extras: dict
    ) -> PreparedLinear:
        """The strategy for (kernel) `mode` and scale shape, over packed rows uint8 [M, Kp / 4]."""
        per_tensor = scale.dim() == 0
        if mode is LinearMode.LLAMACPP_TQ:
            strategy: type[PreparedLinear] = TqLinear
        elif mode is LinearMode.FLOAT:
            extras["decode_scale"] = scale.reshape(1, 1) if per_tensor else scale  # [1, 1] or [M, nb]
            strategy = FloatTernaryLinear
        elif mode is LinearMode.BITNET and self._isa is Isa.GENERIC:
            strategy = BitnetLinear if per_tensor else BitnetBlockLinear
        elif mode is LinearMode.BITNET:
            strategy = Int8BitnetLinear if per_tensor else Int8BitnetBlockLinear
        else:
            raise ValueError(f"unknown linear mode {mode!r}")
        frozen_extras = MappingProxyType(extras)
        return strategy(
            m, k, Layout.TERNARY_2BIT, mode, packed, scale, self.name, frozen_extras, tuning=self.tuning
        )

    def prepare_dense(self, weight: torch.Tensor) -> PreparedLinear:
        """Dense f32 [M, K] weights run through torch.nn.functional.linear (MKL / oneDNN)."""
        m, k = check_dense_weight(weight)
        return DenseLinear(m, k, Layout.DENSE, None, weight.contiguous(), None, self.name, tuning=self.tuning)

    def prepare_block(self, weight: PackedWeight) -> PreparedLinear | None:
        """Q4_0 / Q4_1 -> runtime Layout.Q4_1 (codes uint8 [G, K/2, 64], scale = d f32 [G, nb, 64], extras
        m); Q8_0 -> Layout.Q8_0 (codes int8 [G, K, 64], scale = d); G = ceil(M / 64), see blockquant.
        None for other layouts (or if disabled). Within max_dense_weight_bytes, also an f32 copy."""
        if weight.layout in LOW_BIT_LAYOUTS:
            return self._prepare_low_bit(weight)
        if weight.layout in K_QUANT_LAYOUTS:
            return self._prepare_k_quant(weight)
        type_size = BLOCK_TYPE_SIZES.get(weight.layout)
        if not self.block_kernels or type_size is None:
            return None
        if weight.layout in FIVE_BIT_LAYOUTS and self.block_activations not in INT8_BLOCK_ACTIVATIONS:
            return None  # the loader's f32 copy
        m, k = weight.shape
        rows = block_rows(weight)  # [M, row_bytes]
        extras: dict[str, torch.Tensor] = {}
        if self.block_activations in INT8_BLOCK_ACTIVATIONS:
            # 4-row interleaved records [ceil(M / 4), nb, record] built from the mapped file's blocks: the
            # same bytes per row-block as the file (kernels/cpu/interleaved.py), in place of a plain copy
            kind = interleaved.KINDS[weight.layout.name.lower()]
            five_bit = weight.layout in FIVE_BIT_LAYOUTS
            repack = five_bit_records.repack_five_bit if five_bit else interleaved.repack
            data = torch.from_numpy(repack(rows.numpy(), kind))
            d = blockquant.block_field_f32(rows, type_size, 0)  # [M, nb]
            if weight.layout in (Layout.Q4_1, Layout.Q5_1):
                extras["m"] = blockquant.block_field_f32(rows, type_size, 2)
            elif weight.layout in (Layout.Q4_0, Layout.Q5_0):
                extras["m"] = d * (-8.0 if weight.layout is Layout.Q4_0 else -16.0)  # exact: (code - c) d
            return self._with_dense(Int8BlockLinear, m, k, weight.layout, data, d, extras)
        if weight.layout is Layout.Q8_0:
            data, d = blockquant.repack_q8_0(rows, k)
            strategy: type[BlockLinear] = Q8Linear
        else:
            data, d, extras["m"] = blockquant.repack_q4(rows, k, has_min=weight.layout is Layout.Q4_1)
            strategy = Q4Linear
        layout = Layout.Q8_0 if strategy is Q8Linear else Layout.Q4_1
        return self._with_dense(strategy, m, k, layout, data, d, extras)

    def _prepare_low_bit(self, weight: PackedWeight) -> PreparedLinear | None:
        """Q2_0 / Q1_0 -> 4-row interleaved records (kernels/cpu/low_bit_records.py) on the int8 tile, with
        llama.cpp's Q8_0-style activations; None (the loader's f32 copy) where block activations are f32:
        these types have no f32 kernel."""
        if not self.block_kernels or self.block_activations not in INT8_BLOCK_ACTIVATIONS:
            return None
        m, k = weight.shape
        kind = interleaved.KINDS[weight.layout.name.lower()]
        rows = block_rows(weight)  # [M, nb * 18]
        d = blockquant.block_field_f32(rows, low_bit_records.FILE_BLOCK_BYTES, 0)  # [M, nb]
        records = torch.from_numpy(low_bit_records.repack_low_bit(rows.numpy(), kind))
        return self._with_dense(Int8BlockLinear, m, k, weight.layout, records, d, {})

    def _prepare_k_quant(self, weight: PackedWeight) -> PreparedLinear | None:
        """Q2_K / Q3_K / Q4_K / Q5_K / Q6_K -> super-block records (kernels/cpu/k_quant_records.py) on the
        int8 tile, with Q8_0-style activations per 32 values; scale: the sub-blocks' d sc, f32 [M, K / 32]
        (Q4_K, Q5_K, and extras "m" -(dmin m)) or [M, K / 16] (Q6_K; Q2_K with its "m"). None (the loader's
        f32 copy) where block activations are f32."""
        if not self.block_kernels or self.block_activations not in INT8_BLOCK_ACTIVATIONS:
            return None
        m, k = weight.shape
        rows, layout = block_rows(weight), weight.layout  # [M, nb * type_size]
        if layout is Layout.Q3_K:  # its values exactly as Q6_K blocks: the Q6_K records and tile
            rows, layout = k_quant_records.q3_k_as_q6_k(rows), Layout.Q6_K
        kind = interleaved.KINDS[layout.name.lower()]
        if kind == interleaved.KIND_Q2_K:
            records = torch.from_numpy(k_quant_records.repack_q2_k(rows.numpy()))
            scale, minimum = k_quant_records.q2_k_sub_block_scales(rows, k)
            return self._with_dense(Int8BlockLinear, m, k, layout, records, scale, {"m": minimum})
        if kind == interleaved.KIND_Q6_K:
            records = torch.from_numpy(k_quant_records.repack_q6_k(rows.numpy()))
            scale = k_quant_records.q6_k_sub_block_scales(rows, k)
            return self._with_dense(Int8BlockLinear, m, k, layout, records, scale, {})
        scale, minimum = k_quant_records.sub_block_scales(rows, k, kind)
        records = torch.from_numpy(k_quant_records.repack_q4_k(rows.numpy(), kind))
        return self._with_dense(Int8BlockLinear, m, k, weight.layout, records, scale, {"m": minimum})

    def _with_dense(
        self,
        strategy: type[BlockLinear],
        m: int,
        k: int,
        layout: Layout,
        data: torch.Tensor,
        d: torch.Tensor,
        extras: dict[str, torch.Tensor],
    ) -> PreparedLinear:
        """The prepared block weight, with an f32 copy ("dense") while max_dense_weight_bytes lasts."""
        tuning = self.tuning
        packed = strategy(m, k, layout, None, data, d, self.name, MappingProxyType(extras), tuning=tuning)
        if self.dense_bytes_left < 4 * m * k:
            return packed
        self.dense_bytes_left -= 4 * m * k
        dense = torch.empty(m, k, dtype=torch.float32)  # [M, K], decoded once from the packed blocks
        packed.decode_rows(0, dense.numpy())
        with_dense = MappingProxyType({**extras, "dense": dense})
        return strategy(m, k, layout, None, data, d, self.name, with_dense, tuning=tuning)

    def fuse_group(self, weights: Sequence[PreparedLinear]) -> tuple[PreparedLinear, list[int]] | None:
        """Once, at load: the weights of one group (same strategy and K; q/k/v, gate/up) stacked into one
        (kernels/cpu/group_stacking.py), so a step makes one kernel call (and one activation quantization)
        over the rows of all of them: small K/V projections alone leave a core idle, and each call has a
        fixed cost. Block weights and the int8 bitnet kernels' weights stack. Returns (stacked weight,
        row offset of each weight in its output), or None. Each output row is computed exactly as before,
        with its own weight's scale: splitting the stacked output is bit-identical to running the weights
        one by one."""
        if len(weights) < 2:
            return None
        strategy = type(weights[0])
        if any(type(weight) is not strategy for weight in weights):
            return None
        if len({weight.in_features for weight in weights}) != 1:
            return None
        if strategy is Int8BlockLinear and stackable_records(weights):
            return stack_rows(strategy, weights, self.name, self.tuning, row_scale=False)
        if issubclass(strategy, BlockLinear) and strategy is not Int8BlockLinear:
            return stack_groups(strategy, weights, self.name, self.tuning)
        if strategy is Int8BitnetLinear:
            return stack_rows(strategy, weights, self.name, self.tuning, row_scale=True)
        block_counts = {weight.scale.shape[1:] for weight in weights if weight.scale is not None}
        if strategy is Int8BitnetBlockLinear and len(block_counts) == 1:
            return stack_rows(strategy, weights, self.name, self.tuning, row_scale=False)
        return None

    # ------------------------------------------------------------ fused small ops (FusedOps)

    def fused_ops(self) -> FusedOps | None:
        """This backend itself: rms_norm, rotary_ and paged_decode_attention below."""
        return self

    def half_head_gemv(self, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """An F16 head whose width is whole f16head blocks: its logits for any number of rows by
        f16head.f16_head_rows (torch's sums in torch's order, each weight row read once for all rows;
        benchmarks/RESULTS.md); else None. Only on the avx2 / vnni variants: their CPUs convert F16 in
        hardware (F16C), which the kernel's IR relies on. And only where torch itself runs its AVX2 or
        AVX-512 kernels (f16head.TORCH_CAPABILITIES): the kernel repeats that code's summation order, so
        the logits stay torch's bits."""
        capability = torch.backends.cpu.get_cpu_capability()
        if self._isa is Isa.GENERIC or capability not in f16head.TORCH_CAPABILITIES:
            return None
        if weight.dtype != torch.float16 or weight.dim() != 2 or not weight.is_contiguous():
            return None
        if not f16head.supports(weight.shape[1]):
            return None
        return f16head.F16HeadGemv(weight, self.num_threads)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x f32 [T, N], weight f32 [N] -> f32 [T, N]; bit-identical to layers.norm.RMSNorm."""
        x = x.contiguous()
        out = torch.empty_like(x)
        fused.rms_norm_kernel(x.numpy(), weight.detach().numpy(), eps, out.numpy())
        return out

    def gated_activation(
        self, name: str, *, int8_projections: bool
    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """The compiled decode step's numba activations (decode_glue), so that both forwards agree to the
        bit: relu2 always (rounded as torch's, so the reference backend agrees too); SiLU and GELU-tanh
        where the step may run, i.e. on int8 projections (rounded unlike torch's, so such a model's
        activation differs from the reference backend's in last bits); None otherwise (torch's)."""
        if name in RELU2_NAMES:
            return self.relu2_and_mul
        if name == "silu" and int8_projections:
            return self.silu_and_mul
        if name == "gelu" and int8_projections:
            return self.gelu_and_mul
        return None

    def compile_decoder(self, plan: DecoderPlan) -> CompiledDecoder | None:
        """The one-call numba decode step (kernels/cpu/fast_decode.py) where the model qualifies: its
        activation one of the glue's (gated_activation gave it), int8 projections, no ggml numerics."""
        glue = {
            self.silu_and_mul: decode_glue.SILU,
            self.relu2_and_mul: decode_glue.RELU2,
            self.gelu_and_mul: decode_glue.GELU,
        }
        activation = glue.get(plan.act_and_mul)
        if activation is None:
            return None  # the module forward's activation is torch's: the step's glue would differ
        return FastCpuDecode.build(plan, activation)

    def silu_and_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """f32 [T, I] each -> silu(gate) * up, with the fast decode step's arithmetic (decode_glue.silu_mul):
        the q8 mode's module forward uses it so that both forwards agree to the bit."""
        return _gated(decode_glue.SILU, gate, up)

    def relu2_and_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """f32 [T, I] each -> relu(gate)^2 * up by decode_glue.relu2_mul: the fast decode step's relu2,
        rounded as layers.activation.relu2_and_mul (torch) is, so the reference backend agrees too."""
        return _gated(decode_glue.RELU2, gate, up)

    def gelu_and_mul(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        """f32 [T, I] each -> gelu_tanh(gate) * up by decode_glue.gelu_mul, the fast decode step's GELU
        (Gemma), for the q8 mode's module forward: both forwards agree to the bit."""
        return _gated(decode_glue.GELU, gate, up)

    def rotary_(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        positions: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        rope_dim: int,
        is_neox: bool,
    ) -> None:
        """RoPE in place on contiguous q [T, heads, D] / k [T, kv_heads, D]; bit-identical to
        RotaryEmbedding."""
        fused.rotary_kernel(
            q.numpy(), k.numpy(), positions.numpy(), cos.numpy(), sin.numpy(), rope_dim, is_neox
        )

    def paged_decode_attention(
        self,
        q: torch.Tensor,
        key_pages: torch.Tensor,
        value_pages: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        window: int = 0,
    ) -> torch.Tensor:
        """q f32 [n, heads, D], f32 pages [num_blocks, block_size, kv_heads, D] -> f32 [n, heads, D];
        window > 0: each query over its sequence's last `window` keys (a sliding layer)."""
        if self.num_threads is not None:
            numba.set_num_threads(self.num_threads)
        out = torch.empty_like(q)
        fused.paged_decode_attention_kernel(
            q.contiguous().numpy(),
            key_pages.numpy(),
            value_pages.numpy(),
            block_table.numpy(),
            seq_lens.numpy(),
            scale,
            window,
            out.numpy(),
        )
        return out


# each activation code's serial and parallel decode_glue kernel (gate, up, out: f32 [T, I])
_GATED_KERNELS = {
    decode_glue.SILU: ("silu_mul", "silu_mul_parallel"),
    decode_glue.RELU2: ("relu2_mul", "relu2_mul_parallel"),
    decode_glue.GELU: ("gelu_mul", "gelu_mul_parallel"),
}


def _gated(activation: int, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """A decode_glue gated activation on torch tensors f32 [T, I]: parallel over tokens by the step's own
    rule (decode_glue.is_parallel_gate), so the two forwards run the same kernel."""
    serial, parallel = _GATED_KERNELS[activation]
    kernel = getattr(decode_glue, parallel if decode_glue.is_parallel_gate(gate.shape[0]) else serial)
    out = torch.empty(gate.shape, dtype=torch.float32)
    kernel(gate.contiguous().numpy(), up.contiguous().numpy(), out.numpy())
    return out
