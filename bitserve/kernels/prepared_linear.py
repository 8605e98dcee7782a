"""PreparedLinear (a weight bound to its kernel), the group binding, and LinearMode: shared by every backend.

A prepared weight *is* its kernel: a backend's `prepare_*` picks the strategy (layout, linear mode,
scale shape) once and returns an object whose `__call__(x)` runs it, so a step only switches on the
batch size (GEMV vs GEMM). Weights run on the same input (q/k/v, gate/up) are bound once into a
`LinearKernelGroup`, which quantizes the activations once per kind. Imports only torch and packed.py.
"""

from __future__ import annotations

import enum
from collections.abc import Hashable, Mapping, Sequence
from types import MappingProxyType

import torch

from bitserve.kernels.packed import Layout


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


NO_EXTRAS: Mapping[str, torch.Tensor] = MappingProxyType({})


class PreparedLinear:
    """One weight matrix in a backend's runtime layout, bound to the kernel that runs it.

    out_features, in_features: (M, K), the PyTorch (out, in) convention.
    layout: the runtime layout of `data` (Layout.DENSE, TERNARY_I8 or TERNARY_2BIT; block-quantized
        weights kept packed name their block layout, e.g. Layout.Q4_1).
    mode: the LinearMode of a ternary weight; None for a dense or block-quantized weight.
    data: the runtime weight tensor (its shape and dtype are the strategy's business).
    scale: ternary scale (f32 scalar or f32 [M, K // 256]; f32 [M] per row for a group a backend
        stacked) or a block weight's d; None for dense.
    backend: name of the backend that prepared it.
    extras: further read-only runtime tensors (e.g. f16-rounded block scales), strategy-specific.

    Subclasses (one per strategy, made by a backend's `prepare_*`) implement `run`, and, when they
    consume a quantized form of the activations, `activation_key` / `quantize`: weights of one group
    with equal keys share one `quantize(x)`. `__call__(x)`: x f32 [T, K] -> f32 [T, M].
    """

    __slots__ = ("backend", "data", "extras", "in_features", "layout", "mode", "out_features", "scale")

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
    ) -> None:
        self.out_features = out_features
        self.in_features = in_features
        self.layout = layout
        self.mode = mode
        self.data = data
        self.scale = scale
        self.backend = backend
        self.extras = extras

    # ------------------------------------------------------------ the strategy (subclasses)

    activation_key: Hashable | None = None  # None: runs on x itself, quantize() is not called

    def quantize(self, x: torch.Tensor) -> object:
        """The activation form `run` consumes, from the group's prepared input x [T, K] (T > 0)."""
        return None

    def prepare_input(self, x: torch.Tensor) -> torch.Tensor:
        """Once per call of a weight or group: check x and bring it into the form the kernels read."""
        check_linear_input(x, self)
        return x

    def run(self, x: torch.Tensor, acts: object) -> torch.Tensor:
        """x f32 [T, K] (T > 0, from prepare_input), acts = quantize(x) -> f32 [T, M]."""
        raise NotImplementedError(f"{type(self).__name__} does not implement run")

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        x = self.prepare_input(x)
        if x.shape[0] == 0:
            return x.new_zeros(0, self.out_features)
        return self.run(x, self.quantize(x) if self.activation_key is not None else None)

    # ------------------------------------------------------------ introspection

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

    def __repr__(self) -> str:
        mode = self.mode.value if self.mode is not None else None
        return (
            f"{type(self).__name__}({self.out_features}x{self.in_features}, {self.layout.value}, "
            f"mode={mode}, backend={self.backend!r})"
        )


class LinearKernelGroup:
    """Weights run on one input, bound once: one prepare_input and one quantize per activation kind.

    `weights` are the weights that run (a backend's `fuse_group` may have stacked the group into one);
    `row_offsets`, when stacked, is where each original weight's rows start in the stacked output.
    """

    def __init__(
        self,
        weights: Sequence[PreparedLinear],
        out_features: Sequence[int],
        row_offsets: Sequence[int] | None = None,
    ) -> None:
        if not weights:
            raise ValueError("a linear group needs at least one weight")
        if len({weight.in_features for weight in weights}) != 1:
            raise ValueError(
                f"a linear group's weights share one input, got in_features "
                f"{[weight.in_features for weight in weights]}"
            )
        self.weights = list(weights)
        self.out_features = list(out_features)
        self.row_offsets = list(row_offsets) if row_offsets is not None else None
        quantizers: dict[Hashable, int] = {}  # activation key -> index of the weight that quantizes
        for index, weight in enumerate(self.weights):
            if weight.activation_key is not None:
                quantizers.setdefault(weight.activation_key, index)
        self._quantizers = [self.weights[index] for index in quantizers.values()]
        slot_of_key = {key: slot for slot, key in enumerate(quantizers)}
        # per weight: which quantize() result it runs on (-1: x itself)
        self._slots = [
            slot_of_key.get(w.activation_key, -1) if w.activation_key is not None else -1
            for w in self.weights
        ]

    def __call__(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x f32 [T, K] -> one f32 [T, M_i] per original weight, each equal to that weight's own call."""
        x = self.weights[0].prepare_input(x)
        for weight in self.weights[1:]:
            check_linear_input(x, weight)
        if x.shape[0] == 0:
            return [x.new_zeros(0, m) for m in self.out_features]
        acts = [weight.quantize(x) for weight in self._quantizers]
        outputs = [
            weight.run(x, acts[slot] if slot >= 0 else None)
            for weight, slot in zip(self.weights, self._slots, strict=True)
        ]
        if self.row_offsets is None:
            return outputs
        stacked = outputs[0]  # [T, stacked rows]
        spans = zip(self.row_offsets, self.out_features, strict=True)
        return [stacked[:, start : start + size] for start, size in spans]


def check_linear_input(x: torch.Tensor, weight: PreparedLinear) -> None:
    """Shared argument check: f32 [T, K] with K == weight.in_features."""
    if x.dtype != torch.float32 or x.dim() != 2:
        raise ValueError(f"linear expects a float32 [num_tokens, K] input, got {x.dtype} {tuple(x.shape)}")
    if x.shape[1] != weight.in_features:
        raise ValueError(
            f"linear input has {x.shape[1]} features but the weight expects {weight.in_features}"
        )
