"""The cpu backend's prepared weights: one class per strategy, chosen once by CpuBackend.prepare_*.

Each holds the numpy views and constants its kernel reads (made once, at load), so a call only
switches on the batch size: GEMV-style numba kernels below a threshold, sgemm-based paths above.
Weights of a group with equal `activation_key` share one `quantize(x)` (see kernels/backend.py).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import numba
import numpy as np
import torch
import torch.nn.functional as F

from bitserve.kernels.backend import NO_EXTRAS, LinearMode, PreparedLinear, check_linear_input
from bitserve.kernels.cpu import (
    blockdot,
    blockquant,
    five_bit_records,
    ggml_activations,
    int8dot,
    interleaved,
    k_quant_records,
    low_bit_records,
)
from bitserve.kernels.cpu import ternary as kernels
from bitserve.kernels.cpu.isa import Isa
from bitserve.kernels.packed import Layout
from bitserve.kernels.reference import ternary as reference

MAX_EXACT_F32_K = 65536  # 128 * K stays below 2^24: the exact-f32 sgemm path is valid
CHUNK_BYTES = 1 << 22  # f32 bytes of decoded weights per sgemm chunk (fewer, larger calls measured faster)
NEVER = 1 << 62  # a batch-size threshold no batch reaches


@dataclass(frozen=True, slots=True)
class CpuTuning:
    """The CpuBackend settings its weights run with (see CpuBackend.__init__)."""

    gemm_min_tokens: int
    block_gemm_min_tokens: int
    num_threads: int | None  # numba's setting is per calling thread: applied on every call
    isa: Isa = Isa.GENERIC  # the ternary kernel variant (kernels/cpu/isa.py); GENERIC: the int16 kernels
    ggml_activations: bool = False  # block weights meet llama.cpp's own activation rounding (ggml mode)


class CpuLinear(PreparedLinear):
    """Base of the cpu strategies: the shared input preparation (CPU, contiguous, numba threads).
    Subclasses cache what their kernels read (numpy views, constants) in `_bind`, once."""

    __slots__ = ("num_threads", "tuning")

    def __init__(
        self,
        out_features: int,
        in_features: int,
        layout: Layout,
        mode: LinearMode | None,
        data: torch.Tensor,
        scale: torch.Tensor | None,
        backend: str,
        extras: Mapping[str, torch.Tensor] = NO_EXTRAS,
        *,
        tuning: CpuTuning,
    ) -> None:
        super().__init__(out_features, in_features, layout, mode, data, scale, backend, extras)
        self.tuning = tuning
        self.num_threads = tuning.num_threads
        self._bind()

    def _bind(self) -> None:
        """Once, at construction: cache the kernel's inputs."""

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            raise ValueError(f"the cpu backend runs on CPU tensors, got {x.device}")
        x = x.detach().contiguous()
        if self.num_threads is not None:
            numba.set_num_threads(self.num_threads)
        check_linear_input(x, self)
        return x


class DenseLinear(CpuLinear):
    """f32 [M, K]: torch.nn.functional.linear (MKL / oneDNN sgemm)."""

    __slots__ = ()

    def run(self, x: torch.Tensor, acts: object) -> torch.Tensor:
        return F.linear(x, self.data)


# ------------------------------------------------------------------ ternary (Layout.TERNARY_2BIT)


class _BitnetActivations(CpuLinear):
    """bitnet-mode activations: per-token int8 values (held as int16), zero-padded to Kp columns."""

    __slots__ = ()
    activation_key = "bitnet"

    def quantize(self, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(q int16 [T, Kp], s_act f32 [T], q_sum int32 [T])."""
        return kernels.quantize_int16(x.numpy(), kernels.padded_in_features(self.in_features))


class BitnetLinear(_BitnetActivations):
    """bitnet mode, one scale per tensor. T < gemm_min_tokens: the numba GEMV kernel (int32 dots).
    T >= gemm_min_tokens: exact chunked sgemm of int8 activations and decoded t (never for K above
    MAX_EXACT_F32_K, where f32 sums could round), then the reference epilogue. Bit-identical paths."""

    __slots__ = ("_gemm_min_tokens", "_scale32", "_w")

    def _bind(self) -> None:
        assert self.scale is not None and self.scale.dim() == 0  # invariant: chosen for per-tensor scales
        self._w = self.data.numpy()  # uint8 [M, Kp / 4]
        self._scale32 = np.float32(self.scale.item())
        exact = self.in_features <= MAX_EXACT_F32_K
        self._gemm_min_tokens = self.tuning.gemm_min_tokens if exact else NEVER

    def run(self, x: torch.Tensor, acts: object) -> torch.Tensor:
        qp, s_act, q_sum = acts  # type: ignore[misc]
        num_tokens = x.shape[0]
        if num_tokens >= self._gemm_min_tokens:
            ones = np.ones((1, 1), dtype=np.float32)
            qp_f32 = torch.from_numpy(qp.astype(np.float32))  # [T, Kp]
            d = chunked_matmul(qp_f32, self._w, ones, self.out_features)  # exact integer D, f32 [T, M]
            return reference.bitnet_epilogue(d, torch.from_numpy(s_act), self.scale)  # type: ignore[arg-type]
        out = np.empty((num_tokens, self.out_features), dtype=np.float32)
        kernels.bitnet_linear_kernel(self._w, qp, q_sum, s_act, self._scale32, out)
        return torch.from_numpy(out)


class BitnetBlockLinear(_BitnetActivations):
    """bitnet mode with per-block scales f32 [M, nb] (blocks a multiple of 128 columns): block kernel."""

    __slots__ = ("_num_blocks", "_scale_np", "_w")

    def _bind(self) -> None:
        assert self.scale is not None and self.scale.dim() == 2  # invariant: chosen for per-block scales
        self._w = self.data.numpy()
        self._scale_np = self.scale.numpy()
        self._num_blocks = self.scale.shape[1]

    def run(self, x: torch.Tensor, acts: object) -> torch.Tensor:
        qp, s_act, _ = acts  # type: ignore[misc]
        num_tokens = x.shape[0]
        block_q_sum = qp.reshape(num_tokens, self._num_blocks, -1).sum(axis=2, dtype=np.int32)  # [T, nb]
        out = np.empty((num_tokens, self.out_features), dtype=np.float32)
        kernels.bitnet_block_linear_kernel(self._w, qp, block_q_sum, s_act, self._scale_np, out)
        return torch.from_numpy(out)


class _Int8Activations(CpuLinear):
    """bitnet-mode activations for the int8 kernels (kernels/cpu/int8dot.py): per-token int8, columns
    zero-padded to Kp, rows padded to the GEMM token tile when T > 1."""

    __slots__ = ("_kernels",)
    activation_key = "bitnet-int8"

    def _bind(self) -> None:
        self._kernels = int8dot.KERNELS[self.tuning.isa]

    def quantize(self, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(q int8 [Tp, Kp], s_act f32 [T], q_sum int32 [T]); Tp = T, or T padded to the tile."""
        num_tokens = x.shape[0]
        padded = int8dot.padded_tokens(num_tokens)
        return int8dot.quantize_int8(x.numpy(), kernels.padded_in_features(self.in_features), padded)


class Int8BitnetLinear(_Int8Activations):
    """bitnet mode, one scale per tensor, on the int8 kernels of the backend's ISA for every batch size:
    the GEMV tile for T = 1, the GEMM tile (weights read once per step for all tokens) above.

    `data` is uint8 [M, Kp / 4] (repacked, or I2_S rows viewed in the mapped file). A stacked group
    (CpuBackend.fuse_group: q/k/v, gate/up) is one of these with `scale` f32 [M], each row's own weight's
    scale: one kernel call and one quantization per step. Its rows are either copied one after another
    (uint8 [M, Kp / 4]) or, for weights read in place, `data` is a uint8 [n] view of the file spanning
    them and extras["row_offsets"] int64 [M] locates each row (kernels/cpu/mapped.shared_span)."""

    __slots__ = ("_row_scale", "_weight")

    def _bind(self) -> None:
        assert self.scale is not None and self.scale.dim() in (0, 1)  # invariant: per-tensor or per-row
        super()._bind()
        self._weight = kernel_rows(self.data, self.extras)  # (w, row_off)
        self._row_scale = row_scales(self.scale, self.out_features).numpy()  # f32 [M]: the kernels read

    @property
    def kernel_weight(self) -> tuple[np.ndarray, np.ndarray]:
        """(w uint8 [n], row_off int64 [M]): the weight as its kernels read it (kernel_rows)."""
        return self._weight

    def move_data(self, data: torch.Tensor) -> None:
        """Hold the packed rows in `data` (uint8, same shape, already holding the same bytes) instead: the
        old array is released. Only for rows the weight owns, not rows read in place from the file."""
        if "row_offsets" in self.extras or data.shape != self.data.shape or data.dtype != self.data.dtype:
            raise ValueError(f"move_data: a {tuple(self.data.shape)} {self.data.dtype} array it owns")
        self.data = data
        self._bind()

    @property
    def kernel_row_scale(self) -> np.ndarray:
        """f32 [M]: each row's scale, as its kernels read it."""
        return self._row_scale

    def run(self, x: torch.Tensor, acts: object) -> torch.Tensor:
        return torch.from_numpy(self.run_quantized(acts, x.shape[0]))  # type: ignore[arg-type]

    def run_quantized(self, acts: tuple[np.ndarray, np.ndarray, np.ndarray], num_tokens: int) -> np.ndarray:
        """acts from quantize() (or the decode glue) -> f32 [num_tokens, M]."""
        q, s_act, q_sum = acts
        out = np.empty((num_tokens, self.out_features), dtype=np.float32)
        kernel = self._kernels.gemv if num_tokens == 1 else self._kernels.gemm
        kernel(self._weight, q, q_sum, s_act, self._row_scale, out)
        return out


def kernel_rows(data: torch.Tensor, extras: Mapping[str, torch.Tensor]) -> tuple[np.ndarray, np.ndarray]:
    """The int8 kernels' (w uint8 [n], row_off int64 [M]) of a weight's `data`, without a copy."""
    if "row_offsets" in extras:
        return data.numpy(), extras["row_offsets"].numpy()
    return int8dot.row_table(data.numpy())


def row_scales(scale: torch.Tensor, num_rows: int) -> torch.Tensor:
    """A per-tensor scale (0-dim) repeated, or a per-row one as is: f32 [num_rows], C order."""
    return scale.expand(num_rows).contiguous() if scale.dim() == 0 else scale.contiguous()


class Int8BitnetBlockLinear(_Int8Activations):
    """bitnet mode with per-block scales f32 [M, nb] (blocks a multiple of 128 columns), int8 kernels."""

    __slots__ = ("_num_blocks", "_scale_np", "_weight")

    def _bind(self) -> None:
        assert self.scale is not None and self.scale.dim() == 2  # invariant: chosen for per-block scales
        super()._bind()
        self._weight = kernel_rows(self.data, self.extras)  # (w, row_off)
        self._scale_np = self.scale.numpy()
        self._num_blocks = self.scale.shape[1]

    def run(self, x: torch.Tensor, acts: object) -> torch.Tensor:
        q, s_act, _ = acts  # type: ignore[misc]
        num_tokens = x.shape[0]
        blocks = q[:num_tokens].reshape(num_tokens, self._num_blocks, -1)  # [T, nb, Kp / nb]
        block_q_sum = blocks.sum(axis=2, dtype=np.int32)  # [T, nb]
        out = np.empty((num_tokens, self.out_features), dtype=np.float32)
        self._kernels.block(self._weight, q, block_q_sum, s_act, self._scale_np, out)
        return torch.from_numpy(out)


class FloatTernaryLinear(CpuLinear):
    """float mode: x (zero-padded to Kp columns) @ (decoded t * scale)^T by chunked sgemm, any batch size."""

    __slots__ = ("_decode_scale", "_w")
    activation_key = "padded"

    def _bind(self) -> None:
        self._w = self.data.numpy()
        self._decode_scale = self.extras["decode_scale"].numpy()  # [1, 1] or [M, nb]

    def quantize(self, x: torch.Tensor) -> torch.Tensor:
        """x zero-padded to the kernels' width: f32 [T, Kp]."""
        return kernels.pad_columns(x, kernels.padded_in_features(self.in_features))

    def run(self, x: torch.Tensor, acts: object) -> torch.Tensor:
        return chunked_matmul(acts, self._w, self._decode_scale, self.out_features)  # type: ignore[arg-type]


class TqLinear(CpuLinear):
    """llamacpp-tq mode: numba emulation of ggml's AVX2 TQ2_0 dot product (Q8_K activations, FMA)."""

    __slots__ = ("_d_w", "_w")
    activation_key = "q8k"

    def _bind(self) -> None:
        self._w = self.data.numpy()
        self._d_w = self.extras["d_w"].numpy()  # f32 [M, K // 256], f16-rounded

    def quantize(self, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(q8l int16 [T, K] lane-major, bsum_lanes int32 [T, nb, 8], d_x f32 [T, nb])."""
        q8, d_x = reference.quantize_q8k(x)
        num_tokens, k = q8.shape
        lanes = q8.view(num_tokens, k // kernels.QK_K, kernels.NUM_TQ_LANES, 32).sum(dim=3)
        q8l = q8.to(torch.int16)[:, kernels.tq_lane_order(k)]  # [T, K] lane-major
        return q8l.numpy(), lanes.to(torch.int32).numpy(), d_x.contiguous().numpy()

    def run(self, x: torch.Tensor, acts: object) -> torch.Tensor:
        q8l, bsum_lanes, d_x = acts  # type: ignore[misc]
        out = np.empty((x.shape[0], self.out_features), dtype=np.float32)
        kernels.tq_linear_kernel(self._w, q8l, bsum_lanes, d_x, self._d_w, out)
        return torch.from_numpy(out)


def chunked_matmul(a: torch.Tensor, w: np.ndarray, scale: np.ndarray, m: int) -> torch.Tensor:
    """a f32 [T, Kp] @ (decoded t * scale)^T -> f32 [T, M], decoding CHUNK_BYTES at a time."""
    kp = a.shape[1]
    rows = max(16, CHUNK_BYTES // (4 * kp))
    buf = torch.empty(min(rows, m), kp, dtype=torch.float32)
    out_t = torch.empty(m, a.shape[0], dtype=torch.float32)  # [M, T]: row chunks are contiguous
    for r0 in range(0, m, rows):
        chunk = buf[: min(rows, m - r0)]
        kernels.decode_values_f32(w, r0, scale, chunk.numpy())
        torch.mm(chunk, a.t(), out=out_t[r0 : r0 + chunk.shape[0]])
    return out_t.t().contiguous()


# ------------------------------------------------------------------ block-quantized (Q4_1 / Q8_0 runtime)


class BlockLinear(CpuLinear):
    """Packed Q4 / Q8_0 weight (layouts in kernels/cpu/blockquant.py). T < block_gemm_min_tokens: numba
    dot products on the packed blocks. Above: one sgemm on the resident f32 copy (extras["dense"], made
    at load within the backend's budget) or, without one, chunked dequantize + sgemm."""

    __slots__ = ("_block_gemm_min_tokens", "_codes", "_d", "_gemm")

    def _bind(self) -> None:
        assert self.scale is not None  # invariant: block weights carry their d
        self._codes, self._d = self.data.numpy(), self.scale.numpy()
        self._block_gemm_min_tokens = self.tuning.block_gemm_min_tokens
        dense = self.extras.get("dense")  # f32 [M, K] copy, when the backend's budget allowed one
        self._gemm: Callable[[torch.Tensor], torch.Tensor] = (
            self._chunked_gemm if dense is None else lambda x: F.linear(x, dense)
        )

    def decode_rows(self, r0: int, out: np.ndarray) -> None:
        """Rows r0 .. r0 + len(out) as f32 into `out` [rows, K]."""
        raise NotImplementedError

    def gemv(self, x: torch.Tensor, acts: object) -> torch.Tensor:
        raise NotImplementedError

    def run(self, x: torch.Tensor, acts: object) -> torch.Tensor:
        if x.shape[0] < self._block_gemm_min_tokens:
            return self.gemv(x, acts)
        return self._gemm(x)

    def _chunked_gemm(self, x: torch.Tensor) -> torch.Tensor:
        m, k = self.out_features, self.in_features
        rows = max(16, CHUNK_BYTES // (4 * k))
        buf = torch.empty(min(rows, m), k, dtype=torch.float32)
        out_t = torch.empty(m, x.shape[0], dtype=torch.float32)  # [M, T]: row chunks are contiguous
        for r0 in range(0, m, rows):
            chunk = buf[: min(rows, m - r0)]
            self.decode_rows(r0, chunk.numpy())
            torch.mm(chunk, x.t(), out=out_t[r0 : r0 + chunk.shape[0]])
        return out_t.t().contiguous()


class Q4Linear(BlockLinear):
    """Runtime Layout.Q4_1 (Q4_0 files too): codes uint8 [G, K/2, 64], d and m f32 [G, nb, 64]."""

    __slots__ = ("_m",)
    activation_key = "q4-block-sums"  # a group's weights share one backend, hence one threshold

    def _bind(self) -> None:
        super()._bind()
        self._m = self.extras["m"].numpy()

    def quantize(self, x: torch.Tensor) -> np.ndarray | None:
        """[T, K / 32] block sums of x for the GEMV kernel; None for batches that take the sgemm."""
        return blockquant.block_sums(x.numpy()) if x.shape[0] < self._block_gemm_min_tokens else None

    def decode_rows(self, r0: int, out: np.ndarray) -> None:
        blockquant.decode_q4_rows(self._codes, self._d, self._m, r0, out)

    def gemv(self, x: torch.Tensor, acts: object) -> torch.Tensor:
        out = np.empty((x.shape[0], self.out_features), dtype=np.float32)
        blockquant.q4_linear_kernel(self._codes, self._d, self._m, x.numpy(), acts, out)
        return torch.from_numpy(out)


class Q8Linear(BlockLinear):
    """Runtime Layout.Q8_0: codes int8 [G, K, 64], d f32 [G, nb, 64]."""

    __slots__ = ()

    def decode_rows(self, r0: int, out: np.ndarray) -> None:
        blockquant.decode_q8_0_rows(self._codes, self._d, r0, out)

    def gemv(self, x: torch.Tensor, acts: object) -> torch.Tensor:
        out = np.empty((x.shape[0], self.out_features), dtype=np.float32)
        blockquant.q8_0_linear_kernel(self._codes, self._d, x.numpy(), out)
        return torch.from_numpy(out)


class Int8BlockLinear(BlockLinear):
    """Q4_0 / Q4_1 / Q8_0 / Q2_0 / Q1_0 / Q5_0 / Q5_1 blocks in 4-row interleaved records
    (uint8 [ceil(M / 4), nb, record], kernels/cpu/interleaved.py) on int8 activations
    (kernels/cpu/blockdot.py: llama.cpp's Q8_1-style numerics) for T < block_gemm_min_tokens: the GEMV
    tile for T = 1, the GEMM tile (weights read once per step) above. Larger batches: chunked dequantize
    + sgemm (or the resident f32 copy, as BlockLinear) on the same int8-rounded activations, so results
    differ between batch sizes only by f32 summation order. `scale` (d) and, for
    Q4_*, extras "m": f32 [M, nb] (nb: file blocks), decoded once for decode_rows; the kernels read the
    rows' f16 fields. In ggml mode (tuning.ggml_activations) the activations are llama.cpp's own for the
    weight's type (kernels/cpu/ggml_activations.py), at every batch size."""

    __slots__ = ("_kernels", "_m_np", "_ggml_family")

    def _bind(self) -> None:
        super()._bind()
        self._kernels = blockdot.KERNELS[(self.tuning.isa, self.kernel_format)]
        self._m_np = self.extras["m"].numpy() if "m" in self.extras else self._d  # Q8_0: unused
        kind = interleaved.KINDS[self.kernel_format]
        self._ggml_family = ggml_activations.activation_family(kind) if self.tuning.ggml_activations else None

    @property
    def activation_key(self) -> str:  # type: ignore[override]
        """One quantization per group, or in ggml mode one per ggml activation type (Q8_0 / Q8_1 / Q8_K)."""
        return "q8-blocks" if self._ggml_family is None else f"ggml-{self._ggml_family}"

    def quantize(self, x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray] | None:
        """(q int8 [Tp, K], dx f32 [Tp, nb], sx f32 [Tp, nb]); None for batches that take the sgemm."""
        num_tokens = x.shape[0]
        if num_tokens >= self._block_gemm_min_tokens:
            return None
        padded = blockdot.padded_tokens(num_tokens)
        if self._ggml_family is not None:
            return ggml_activations.quantize_ggml(x.numpy(), padded, self._ggml_family)
        return blockdot.quantize_block_q8(x.numpy(), padded)

    def run(self, x: torch.Tensor, acts: object) -> torch.Tensor:
        if x.shape[0] < self._block_gemm_min_tokens:
            return self.gemv(x, acts)
        return self._gemm(torch.from_numpy(blockdot.q8_roundtrip(x.numpy())))

    def decode_rows(self, r0: int, out: np.ndarray) -> None:
        kind = interleaved.KINDS[self.kernel_format]
        if kind in low_bit_records.BLOCK_VALUES:
            low_bit_records.decode_low_bit_rows(self._codes, self._d, kind, r0, out)
            return
        if kind in (interleaved.KIND_Q4_K, interleaved.KIND_Q5_K):
            k_quant_records.decode_q4_k_rows(self._codes, self._d, self._m_np, kind, r0, out)
            return
        if kind == interleaved.KIND_Q6_K:
            k_quant_records.decode_q6_k_rows(self._codes, self._d, r0, out)
            return
        if kind == interleaved.KIND_Q2_K:
            k_quant_records.decode_q2_k_rows(self._codes, self._d, self._m_np, r0, out)
            return
        if kind in five_bit_records.FIVE_BIT_KINDS:
            five_bit_records.decode_five_bit_rows(self._codes, self._d, self._m_np, kind, r0, out)
            return
        blockdot.decode_rows(self._codes, self._d, self._m_np, self.layout is Layout.Q8_0, r0, out)

    def gemv(self, x: torch.Tensor, acts: object) -> torch.Tensor:
        return torch.from_numpy(self.run_quantized(acts, x.shape[0]))  # type: ignore[arg-type]

    @property
    def kernel_records(self) -> np.ndarray:
        """uint8 [ceil(M / 4), nb, record]: the 4-row interleaved records its kernels read."""
        return self._codes

    @property
    def kernel_format(self) -> str:
        """Which blockdot kernels read the records: q4_1, q4_0, q8_0, q2_0, q1_0, q5_*, q2_k, q4_k .. q6_k."""
        return self.layout.name.lower()

    def run_quantized(self, acts: tuple[np.ndarray, np.ndarray, np.ndarray], num_tokens: int) -> np.ndarray:
        """acts from quantize() (or the decode glue) -> f32 [num_tokens, M]."""
        q, dx, sx = acts
        out = np.empty((num_tokens, self.out_features), dtype=np.float32)
        self._kernels.for_tokens(num_tokens)(self._codes, q, dx, sx, out)
        return out
