"""KernelBackend protocol for linear layers, the PreparedLinear record, and backend selection.

Layers reach kernels only through the backend chosen once at load (`select_backend`). A backend turns
TernaryCodes / dense f32 weights into its runtime layout once (`prepare_*`), then runs `linear` per step.
Imports no nn.Module and nothing from layers/ or models/.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Protocol, runtime_checkable

import torch

from bitserve.kernels.packed import Layout, PackedWeight, TernaryCodes

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("reference", "cpu")


class LinearMode(enum.Enum):
    """How a ternary linear computes (docs/formats.md §3.4). Explicit, never guessed from the file.

    BITNET: bitnet.cpp I2_S semantics for every ternary weight: per-token int8 activations, exact
        integer accumulation, `fl32(fl32(fl32(D) / s_act) * w_scale)`. Batch-invariant, bit-exact
        across backends.
    FLOAT: no activation quantization: `x @ (t * scale)^T` in fp32 (parity with llama.cpp F32 files);
        equal across backends only within fp32 summation-order tolerance.
    LLAMACPP_TQ: upstream llama.cpp's TQ dot product: Q8_K activations per 256 values, f16 block
        scales, and the lane-wise f32 accumulation (with FMA) of ggml's x86 AVX2 TQ2_0 kernel as GCC
        builds it: bit-exact against llama-cpp-python's libggml-cpu (kernels/reference/ternary.py).
        TQ1_0's kernel splits lanes differently, so TQ1_0 files may differ in the last bits.
    BITNETCPP: BITNET's ternary linears, plus bitnet.cpp's implementation precision in the other ops
        (docs/fidelity-bitnetcpp.md): RoPE tables from ggml's f32 theta recurrence and the C library's
        cosf/sinf, the rotation with ggml's contracted multiply-add; attention on F16-rounded q, k, v
        (ggml's F16 KV cache) and F16-rounded softmax weights; an F16-stored LM head multiplies
        F16-rounded activations. Layer code reads `ggml_numerics`; kernels see `kernel_mode` (BITNET).
    """

    BITNET = "bitnet"
    FLOAT = "float"
    LLAMACPP_TQ = "llamacpp-tq"
    BITNETCPP = "bitnetcpp"

    @property
    def kernel_mode(self) -> LinearMode:
        """The ternary kernel semantics: BITNETCPP changes non-linear ops only, its linears are BITNET's."""
        return LinearMode.BITNET if self is LinearMode.BITNETCPP else self

    @property
    def ggml_numerics(self) -> bool:
        """True where RoPE, attention and the F16 head reproduce bitnet.cpp's rounding."""
        return self is LinearMode.BITNETCPP


def _empty_extras() -> Mapping[str, torch.Tensor]:
    return MappingProxyType({})


@dataclass(frozen=True, slots=True)
class PreparedLinear:
    """One weight matrix in a backend's runtime layout. Only the backend that made it may run it.

    out_features, in_features: (M, K), the PyTorch (out, in) convention.
    layout: the runtime layout of `data` (Layout.DENSE, TERNARY_I8 or TERNARY_2BIT; a backend that keeps
        block-quantized weights (`prepare_block`) names their block layout, e.g. Layout.Q4_1).
    mode: the LinearMode of a ternary weight; None for a dense or block-quantized weight.
    data: the runtime weight tensor (its shape and dtype are the backend's business).
    scale: ternary scale, f32 scalar or f32 [M, K // 256] per-block; None for dense.
    backend: name of the backend that prepared it.
    extras: further read-only runtime tensors (e.g. f16-rounded block scales), backend-specific.
    """

    out_features: int
    in_features: int
    layout: Layout
    mode: LinearMode | None
    data: torch.Tensor
    scale: torch.Tensor | None
    backend: str
    extras: Mapping[str, torch.Tensor] = field(default_factory=_empty_extras)

    @property
    def nbytes(self) -> int:
        """Bytes held by this weight's runtime tensors (for memory accounting)."""
        total = self.data.nbytes
        if self.scale is not None:
            total += self.scale.nbytes
        return total + sum(t.nbytes for t in self.extras.values())

    @property
    def is_ternary(self) -> bool:
        return self.mode is not None


@runtime_checkable
class KernelBackend(Protocol):
    """Linear-layer compute. Methods are called from the engine thread; compiled kernels drop the GIL."""

    name: str

    def prepare_ternary(self, codes: TernaryCodes, *, mode: LinearMode) -> PreparedLinear:
        """Once, at load: repack ternary codes (int8 [M, K] in {-1,0,1} + scale) into the runtime
        layout for `mode`. Raises UnsupportedModel if this backend cannot run that shape in that mode."""
        ...

    def prepare_dense(self, weight: torch.Tensor) -> PreparedLinear:
        """Once, at load: a float32 [M, K] weight (block formats are dequantized before this)."""
        ...

    def prepare_block(self, weight: PackedWeight) -> PreparedLinear | None:
        """Optional, once, at load: keep a non-ternary block-quantized file weight (Q4_1, Q8_0, ...) in a
        packed runtime form. None when this backend keeps no packed form for that layout: the loader then
        dequantizes it and calls `prepare_dense`. Results match the dense path within fp32 summation-order
        tolerance, not bit for bit. Loaders call it via getattr, so backends may omit it."""
        ...

    def linear(self, x: torch.Tensor, weight: PreparedLinear) -> torch.Tensor:
        """x: f32 [num_tokens, K] -> f32 [num_tokens, M]. Row i of the output depends only on row i
        of x (bit-exact batch invariance in BITNET mode)."""
        ...

    def linear_group(self, x: torch.Tensor, weights: Sequence[PreparedLinear]) -> list[torch.Tensor]:
        """Several weights on the same input (q/k/v, gate/up); activations are quantized once.
        Returns one f32 [num_tokens, M_i] per weight, equal to `linear(x, w_i)` bit for bit."""
        ...


@runtime_checkable
class FusedOps(Protocol):
    """Optional: a backend's single-call versions of the small per-layer ops. Layers use them when the
    backend has them and fall back to their own eager torch code (the reference) otherwise."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x f32 [T, N], weight f32 [N] -> f32 [T, N]; bit-identical to layers.norm.RMSNorm."""
        ...

    def rotary_(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor,
                rope_dim: int, is_neox: bool) -> None:  # fmt: skip
        """RoPE in place on contiguous f32 q [T, heads, D] and k [T, kv_heads, D]; bit-identical to the layer."""
        ...

    def paged_decode_attention(self, q: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor,
                               block_table: torch.Tensor, seq_lens: torch.Tensor, scale: float) -> torch.Tensor:  # fmt: skip
        """One query per sequence over f32 KV pages [num_blocks, block_size, kv_heads, D] -> f32 [n, heads, D]."""
        ...


def fused_ops(backend: KernelBackend) -> FusedOps | None:
    return backend if isinstance(backend, FusedOps) else None


def check_linear_input(x: torch.Tensor, weight: PreparedLinear) -> None:
    """Shared argument check for `linear`: f32 [T, K] with K == weight.in_features."""
    if x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(f"linear expects a float32 [num_tokens, K] input, got {x.dtype} {tuple(x.shape)}")
    if x.shape[1] != weight.in_features:
        raise ValueError(
            f"linear input has {x.shape[1]} features but the weight expects {weight.in_features}"
        )


def _numba_works() -> bool:
    """True if the numba CPU backend imports and numba compiles and runs a trivial kernel here."""
    try:
        from bitserve.kernels.cpu import backend as cpu_backend
    except ImportError as exc:
        logger.info("cpu backend unavailable: %s", exc)
        return False
    return cpu_backend.is_available()


def available_backends() -> list[str]:
    """Names of the backends that work in this process, the reference first."""
    names = ["reference"]
    if _numba_works():
        names.append("cpu")
    return names


def select_backend(name: str = "auto", *, max_dense_weight_bytes: int = 0) -> KernelBackend:
    """Pick a backend once, at load. "auto" is "cpu" when numba works, else "reference".
    max_dense_weight_bytes: the cpu backend's budget of f32 copies of block weights (batched GEMMs)."""
    if name == "auto":
        name = "cpu" if _numba_works() else "reference"
    if name == "reference":
        from bitserve.kernels.reference.backend import ReferenceBackend

        return ReferenceBackend()
    if name == "cpu":
        if not _numba_works():
            raise ValueError("kernel backend 'cpu' needs numba, which is not importable or not working")
        from bitserve.kernels.cpu.backend import CpuBackend

        return CpuBackend(max_dense_weight_bytes=max_dense_weight_bytes)
    raise ValueError(f"unknown kernel backend {name!r}; choose one of: auto, {', '.join(BACKEND_NAMES)}")
