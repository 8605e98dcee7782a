"""CpuBackend: ternary linears on packed 2-bit weights with numba kernels; dense linears via torch.

Runtime layout of every ternary weight: Layout.TERNARY_2BIT (uint8 [M, pad128(K) / 4], ~2 bits per
weight). bitnet mode is bit-exact with the reference backend for every batch size:
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

Threads: numba's OpenMP layer shares libgomp with torch. Run with OMP_WAIT_POLICY=PASSIVE (set before
torch is imported) wherever the cores are shared: spin-waiting workers then cost ~8 ms per call.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
from collections.abc import Sequence
from types import MappingProxyType

import numba
import numpy as np
import torch
import torch.nn.functional as F
from numba.core.errors import NumbaError

from bitserve.errors import InvalidModelFile, UnsupportedModel
from bitserve.kernels.backend import LinearMode, PreparedLinear, check_linear_input
from bitserve.kernels.cpu import blockquant, fused
from bitserve.kernels.cpu import ternary as kernels
from bitserve.kernels.packed import Layout, PackedWeight, TernaryCodes
from bitserve.kernels.reference import ternary as reference
from bitserve.kernels.reference.dense import check_dense_weight

logger = logging.getLogger(__name__)

DEFAULT_GEMM_MIN_TOKENS = 24  # measured crossover of the numba kernel and the chunked sgemm
DEFAULT_BLOCK_GEMM_MIN_TOKENS = 8  # crossover of the Q4_* / Q8_0 kernels and dequantize + sgemm (2 cores)
BLOCK_TYPE_SIZES = {Layout.Q4_0: 18, Layout.Q4_1: 20, Layout.Q8_0: 34}  # bytes per 32-value block
MAX_EXACT_F32_K = 65536  # 128 * K stays below 2^24: the exact-f32 sgemm path is valid
CHUNK_BYTES = 1 << 22  # f32 bytes of decoded weights per sgemm chunk (fewer, larger calls measured faster)


@functools.cache
def is_available() -> bool:
    """True if numba compiles and runs a trivial function here (the real kernels compile on first use
    and are cached on disk by numba, cache=True). Computed once per process."""
    try:
        return int(kernels.smoke_test(np.arange(4, dtype=np.int16))) == 6
    except (NumbaError, OSError, RuntimeError) as exc:  # numba / LLVM cannot build code here
        logger.warning("numba is importable but cannot compile kernels (%s); cpu backend disabled", exc)
        return False


class _Activations:
    """Per-call activation forms, computed at most once per linear_group (quantize once)."""

    def __init__(self, x: torch.Tensor, kp: int) -> None:
        self.x = x  # f32 [T, K], contiguous, CPU
        self.kp = kp
        self._bitnet: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._q8k: tuple[np.ndarray, np.ndarray, np.ndarray] | None = None
        self._permuted_x: torch.Tensor | None = None

    def bitnet(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(qp int16 [T, Kp] permuted, s_act f32 [T], q_sum int32 [T])."""
        if self._bitnet is None:
            self._bitnet = kernels.quantize_permute(self.x.numpy(), self.kp)
        return self._bitnet

    def q8k(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(q8l int16 [T, K] lane-major, bsum_lanes int32 [T, nb, 8], d_x f32 [T, nb])."""
        if self._q8k is None:
            q8, d_x = reference.quantize_q8k(self.x)
            num_tokens, k = q8.shape
            lanes = q8.view(num_tokens, k // kernels.QK_K, kernels.NUM_TQ_LANES, 32).sum(dim=3)
            q8l = q8.to(torch.int16)[:, kernels.tq_lane_order(k)]  # [T, K] lane-major
            self._q8k = (q8l.numpy(), lanes.to(torch.int32).numpy(), d_x.contiguous().numpy())
        return self._q8k

    def permuted_x(self) -> torch.Tensor:
        """x in the kernels' permuted column order, zero-padded: f32 [T, Kp]."""
        if self._permuted_x is None:
            self._permuted_x = kernels.permute_columns(self.x, self.kp)
        return self._permuted_x


class CpuBackend:
    """numba CPU kernels over packed ternary weights (see module docstring)."""

    name = "cpu"

    def __init__(
        self,
        *,
        gemm_min_tokens: int = DEFAULT_GEMM_MIN_TOKENS,
        num_threads: int | None = None,
        block_kernels: bool = True,
        block_gemm_min_tokens: int = DEFAULT_BLOCK_GEMM_MIN_TOKENS,
        max_dense_weight_bytes: int = 0,
    ) -> None:
        """gemm_min_tokens: batch size from which bitnet mode uses the chunked exact sgemm.
        num_threads: numba threads for this backend's kernels (numba's setting is per calling thread,
        so it is applied on every call); None keeps numba's default (all cores).
        block_kernels: keep Q4_0 / Q4_1 / Q8_0 weights packed (False: the loader dequantizes them to f32).
        block_gemm_min_tokens: batch size from which packed block weights use chunked dequantize + sgemm.
        max_dense_weight_bytes: budget of f32 copies of block weights for those batches (0: none)."""
        if num_threads is not None and not 1 <= num_threads <= numba.config.NUMBA_NUM_THREADS:
            raise ValueError(f"num_threads must be in 1..{numba.config.NUMBA_NUM_THREADS}, got {num_threads}")
        self.gemm_min_tokens = gemm_min_tokens
        self.num_threads = num_threads
        self.block_kernels = block_kernels
        self.block_gemm_min_tokens = block_gemm_min_tokens
        if max_dense_weight_bytes < 0:
            raise ValueError(f"max_dense_weight_bytes must be >= 0, got {max_dense_weight_bytes}")
        self.dense_bytes_left = max_dense_weight_bytes  # spent at load, weight by weight, in load order

    # ------------------------------------------------------------ load time

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
            codes = TernaryCodes(values=codes.values[:, kernels.tq_weight_columns(k)], scale=codes.scale)
        elif mode is LinearMode.FLOAT:
            scale = codes.scale.reshape(1, 1) if codes.is_per_tensor else codes.scale
            extras["decode_scale"] = scale.contiguous().clone()  # [1, 1] or [M, nb]
        elif mode is not LinearMode.BITNET:
            raise ValueError(f"unknown linear mode {mode!r}")
        packed = kernels.pack_ternary(codes.values)  # [M, Kp / 4]
        scale_copy = codes.scale.clone(memory_format=torch.contiguous_format)  # kernels need C order
        return PreparedLinear(
            m, k, Layout.TERNARY_2BIT, mode, packed, scale_copy, self.name, MappingProxyType(extras)
        )

    def prepare_dense(self, weight: torch.Tensor) -> PreparedLinear:
        """Dense f32 [M, K] weights run through torch.nn.functional.linear (MKL / oneDNN)."""
        m, k = check_dense_weight(weight)
        return PreparedLinear(m, k, Layout.DENSE, None, weight.contiguous(), None, self.name)

    def prepare_block(self, weight: PackedWeight) -> PreparedLinear | None:
        """Q4_0 / Q4_1 -> runtime Layout.Q4_1 (codes uint8 [G, K/2, 64], scale = d f32 [G, nb, 64], extras
        m); Q8_0 -> Layout.Q8_0 (codes int8 [G, K, 64], scale = d); G = ceil(M / 64), see blockquant. None for other layouts (or if disabled)."""
        type_size = BLOCK_TYPE_SIZES.get(weight.layout)
        if not self.block_kernels or type_size is None:
            return None
        m, k = weight.shape
        if k % blockquant.QK:
            raise InvalidModelFile(f"{weight.layout.name} needs K to be a multiple of {blockquant.QK}, got K={k}")
        row_bytes = k // blockquant.QK * type_size
        if weight.data.dtype != torch.uint8 or weight.data.numel() != m * row_bytes:
            raise InvalidModelFile(
                f"{weight.layout.name} tensor of shape {weight.shape} holds {weight.data.numel()} bytes",
                expected=f"{m * row_bytes} bytes",
            )
        rows = weight.data.reshape(m, row_bytes)
        if weight.layout is Layout.Q8_0:
            q, d = blockquant.repack_q8_0(rows, k)
            prepared = PreparedLinear(m, k, Layout.Q8_0, None, q, d, self.name)
        else:
            qs, d, mins = blockquant.repack_q4(rows, k, has_min=weight.layout is Layout.Q4_1)
            prepared = PreparedLinear(m, k, Layout.Q4_1, None, qs, d, self.name, MappingProxyType({"m": mins}))
        if self.dense_bytes_left >= 4 * m * k:
            self.dense_bytes_left -= 4 * m * k
            dense = torch.empty(m, k, dtype=torch.float32)  # [M, K], decoded once from the packed blocks
            self._decode_block_rows(prepared, 0, dense.numpy())
            prepared = dataclasses.replace(prepared, extras=MappingProxyType({**prepared.extras, "dense": dense}))
        return prepared

    def fuse_group(self, weights: Sequence[PreparedLinear]) -> tuple[PreparedLinear, list[int]] | None:
        """Once, at load: block weights of one group (same layout and K; q/k/v, gate/up) stacked into one,
        so a step makes one kernel call with 64-row tasks from all of them (small K/V projections alone
        leave a core idle). Returns (stacked weight, row offset of each weight in its output), or None.
        Each output row is computed exactly as before: splitting the stacked output is bit-identical."""
        layouts = {weight.layout for weight in weights}
        if len(weights) < 2 or len(layouts) != 1 or not layouts <= {Layout.Q4_1, Layout.Q8_0}:
            return None
        if len({weight.in_features for weight in weights}) != 1:
            return None
        offsets, num_padded = [], 0
        for weight in weights:
            offsets.append(num_padded)
            num_padded += weight.data.shape[0] * blockquant.GROUP_ROWS  # each weight's groups, padding included
        data = torch.cat([weight.data for weight in weights])  # [sum G, ...]: the groups one after another
        scale = torch.cat([weight.scale for weight in weights if weight.scale is not None])
        extras: dict[str, torch.Tensor] = {}
        if "m" in weights[0].extras:
            extras["m"] = torch.cat([weight.extras["m"] for weight in weights])
        if all("dense" in weight.extras for weight in weights):
            extras["dense"] = torch.cat([self._pad_rows(weight.extras["dense"], weight.data.shape[0] * blockquant.GROUP_ROWS)
                                         for weight in weights])  # fmt: skip
        stacked = PreparedLinear(num_padded, weights[0].in_features, weights[0].layout, None, data, scale, self.name,
                                 MappingProxyType(extras))  # fmt: skip
        return stacked, offsets

    @staticmethod
    def _pad_rows(dense: torch.Tensor, num_rows: int) -> torch.Tensor:
        if dense.shape[0] == num_rows:
            return dense
        return torch.cat([dense, dense.new_zeros(num_rows - dense.shape[0], dense.shape[1])])

    @staticmethod
    def _decode_block_rows(weight: PreparedLinear, r0: int, out: np.ndarray) -> None:
        """Rows r0 .. r0 + len(out) of a packed block weight as f32 into `out` [rows, K]."""
        assert weight.scale is not None  # invariant: block weights carry their d
        codes, d = weight.data.numpy(), weight.scale.numpy()
        if weight.layout is Layout.Q4_1:
            blockquant.decode_q4_rows(codes, d, weight.extras["m"].numpy(), r0, out)
        else:
            blockquant.decode_q8_0_rows(codes, d, r0, out)

    # ------------------------------------------------------------ per step

    def linear(self, x: torch.Tensor, weight: PreparedLinear) -> torch.Tensor:
        """x f32 [T, K] -> f32 [T, M]."""
        return self.linear_group(x, [weight])[0]

    def linear_group(self, x: torch.Tensor, weights: Sequence[PreparedLinear]) -> list[torch.Tensor]:
        """One f32 [T, M_i] per weight; activations are quantized once per group."""
        if x.device.type != "cpu":
            raise ValueError(f"the cpu backend runs on CPU tensors, got {x.device}")
        x = x.detach().contiguous()
        if self.num_threads is not None:
            numba.set_num_threads(self.num_threads)
        acts: _Activations | None = None
        xsum: np.ndarray | None = None  # [T, K / 32] block sums, shared by the Q4 weights of the group
        outputs = []
        for weight in weights:
            check_linear_input(x, weight)
            if weight.backend != self.name:
                raise ValueError(f"weight prepared by {weight.backend!r} given to the {self.name!r} backend")
            if weight.layout in (Layout.Q4_1, Layout.Q8_0):
                if xsum is None and weight.layout is Layout.Q4_1 and x.shape[0] < self.block_gemm_min_tokens:
                    xsum = blockquant.block_sums(x.numpy())
                outputs.append(self._block(x, weight, xsum))
                continue
            if weight.mode is None:
                outputs.append(F.linear(x, weight.data))
                continue
            if x.shape[0] == 0:
                outputs.append(x.new_zeros(0, weight.out_features))
                continue
            if acts is None:
                acts = _Activations(x, kernels.padded_in_features(weight.in_features))
            outputs.append(self._ternary(acts, weight))
        return outputs

    def _ternary(self, acts: _Activations, weight: PreparedLinear) -> torch.Tensor:
        assert weight.scale is not None  # invariant: ternary weights carry a scale
        num_tokens, m = acts.x.shape[0], weight.out_features
        w = weight.data.numpy()
        if weight.mode is LinearMode.FLOAT:
            scale = weight.extras["decode_scale"].numpy()
            return self._chunked_matmul(acts.permuted_x(), w, scale, m)
        if weight.mode is LinearMode.LLAMACPP_TQ:
            q8l, bsum_lanes, d_x = acts.q8k()
            out = np.empty((num_tokens, m), dtype=np.float32)
            kernels.tq_linear_kernel(w, q8l, bsum_lanes, d_x, weight.extras["d_w"].numpy(), out)
            return torch.from_numpy(out)
        qp, s_act, q_sum = acts.bitnet()
        if weight.scale.dim() == 2:
            num_blocks = weight.scale.shape[1]
            block_q_sum = qp.reshape(num_tokens, num_blocks, -1).sum(axis=2, dtype=np.int32)  # [T, nb]
            out = np.empty((num_tokens, m), dtype=np.float32)
            kernels.bitnet_block_linear_kernel(w, qp, block_q_sum, s_act, weight.scale.numpy(), out)
            return torch.from_numpy(out)
        if num_tokens >= self.gemm_min_tokens and weight.in_features <= MAX_EXACT_F32_K:
            ones = np.ones((1, 1), dtype=np.float32)
            d = self._chunked_matmul(torch.from_numpy(qp.astype(np.float32)), w, ones, m)  # exact D
            return reference.bitnet_epilogue(d, torch.from_numpy(s_act), weight.scale)
        out = np.empty((num_tokens, m), dtype=np.float32)
        kernels.bitnet_linear_kernel(w, qp, q_sum, s_act, np.float32(weight.scale.item()), out)
        return torch.from_numpy(out)

    def _block(self, x: torch.Tensor, weight: PreparedLinear, xsum: np.ndarray | None) -> torch.Tensor:
        """Packed Q4 / Q8_0 weight: numba dot products for small T, else chunked dequantize + sgemm."""
        assert weight.scale is not None  # invariant: block weights carry their d
        num_tokens, m = x.shape[0], weight.out_features
        codes, d = weight.data.numpy(), weight.scale.numpy()
        is_q4 = weight.layout is Layout.Q4_1
        if num_tokens == 0:
            return x.new_zeros(0, m)
        if num_tokens < self.block_gemm_min_tokens:
            out = np.empty((num_tokens, m), dtype=np.float32)
            if is_q4:
                blockquant.q4_linear_kernel(codes, d, weight.extras["m"].numpy(), x.numpy(), xsum, out)
            else:
                blockquant.q8_0_linear_kernel(codes, d, x.numpy(), out)
            return torch.from_numpy(out)
        dense = weight.extras.get("dense")
        if dense is not None:
            return F.linear(x, dense)
        k = weight.in_features
        rows = max(16, CHUNK_BYTES // (4 * k))
        buf = torch.empty(min(rows, m), k, dtype=torch.float32)
        out_t = torch.empty(m, num_tokens, dtype=torch.float32)  # [M, T]: row chunks are contiguous
        for r0 in range(0, m, rows):
            chunk = buf[: min(rows, m - r0)]
            self._decode_block_rows(weight, r0, chunk.numpy())
            torch.mm(chunk, x.t(), out=out_t[r0 : r0 + chunk.shape[0]])
        return out_t.t().contiguous()

    # ------------------------------------------------------------ fused small ops (FusedOps)

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x f32 [T, N], weight f32 [N] -> f32 [T, N]; bit-identical to layers.norm.RMSNorm."""
        x = x.contiguous()
        out = torch.empty_like(x)
        fused.rms_norm_kernel(x.numpy(), weight.detach().numpy(), eps, out.numpy())
        return out

    def rotary_(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rope_dim: int, is_neox: bool) -> None:  # fmt: skip
        """RoPE in place on contiguous q [T, heads, D] / k [T, kv_heads, D]; bit-identical to RotaryEmbedding."""
        fused.rotary_kernel(q.numpy(), k.numpy(), positions.numpy(), cos.numpy(), sin.numpy(), rope_dim, is_neox)

    def paged_decode_attention(self, q: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
                               block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
        """q f32 [n, heads, D], f32 pages [num_blocks, block_size, kv_heads, D] -> f32 [n, heads, D]."""
        if self.num_threads is not None:
            numba.set_num_threads(self.num_threads)
        out = torch.empty_like(q)
        fused.paged_decode_attention_kernel(q.contiguous().numpy(), key_pages.numpy(), value_pages.numpy(),
                                            block_table.numpy(), seq_lens.numpy(), scale, out.numpy())  # fmt: skip
        return out

    @staticmethod
    def _chunked_matmul(a: torch.Tensor, w: np.ndarray, scale: np.ndarray, m: int) -> torch.Tensor:
        """a f32 [T, Kp] (permuted) @ (decoded t * scale)^T -> f32 [T, M], decoding CHUNK_BYTES at a time."""
        kp = a.shape[1]
        rows = max(16, CHUNK_BYTES // (4 * kp))
        buf = torch.empty(min(rows, m), kp, dtype=torch.float32)
        out_t = torch.empty(m, a.shape[0], dtype=torch.float32)  # [M, T]: row chunks are contiguous
        for r0 in range(0, m, rows):
            chunk = buf[: min(rows, m - r0)]
            kernels.decode_values_f32(w, r0, scale, chunk.numpy())
            torch.mm(chunk, a.t(), out=out_t[r0 : r0 + chunk.shape[0]])
        return out_t.t().contiguous()
