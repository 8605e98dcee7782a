"""KernelBackend protocol and FusedOps: the one seam between layers / models and device compute.

Layers reach kernels only through weights prepared once, at load, by the backend chosen then
(`bitserve.kernels.select.select_backend`); see kernels/prepared_linear.py for the prepared weight and
the group binding (re-exported here). A model reaches a backend's fast forward only through
`compile_decoder`, handed the model lowered to data (kernels/plan.py). Imports no nn.Module, nothing
from layers/ or models/, and no backend module (the backends import this one).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

import torch

from bitserve.kernels.packed import PackedWeight, TernaryCodes
from bitserve.kernels.plan import CompiledDecoder, DecoderPlan
from bitserve.kernels.prepared_linear import (
    NO_EXTRAS,
    LinearKernelGroup,
    LinearMode,
    PreparedLinear,
    check_linear_input,
)

__all__ = [
    "NO_EXTRAS",
    "FusedOps",
    "KernelBackend",
    "LinearKernelGroup",
    "LinearMode",
    "PreparedLinear",
    "check_linear_input",
]


class FusedOps(Protocol):
    """A backend's single-call versions of the small per-layer ops (`KernelBackend.fused_ops`). Layers
    given none run their own eager torch code (the reference)."""

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
        """x f32 [T, N], weight f32 [N] -> f32 [T, N]; bit-identical to layers.norm.RMSNorm."""
        ...

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
        """RoPE in place on contiguous f32 q [T, heads, D] and k [T, kv_heads, D]; bit-identical to the
        layer."""
        ...

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
        """One query per sequence over f32 KV pages [num_blocks, block_size, kv_heads, D]
        -> f32 [n, heads, D]; window > 0: each over its last `window` keys only (a sliding layer)."""
        ...


class KernelBackend(Protocol):
    """Linear-layer compute. Every method is part of the contract (no optional features probed by name);
    backends subclass this Protocol and inherit `linear` / `linear_group` / `bind_group`. Methods are
    called from the engine thread; compiled kernels drop the GIL."""

    name: str
    # how Q4_* / Q8_0 weights meet activations: "f32" (exact), "q8" (int8 per 32-value block, the cpu
    # backend's kernels/cpu/blockdot.py) or "ggml" (the same tile on llama.cpp's own activation rounding,
    # kernels/cpu/ggml_activations.py); a q8 / ggml model's module forward follows it
    block_activations: str = "f32"

    def describe(self) -> dict[str, str]:
        """The kernel choices made at construction, for logs, /health, /v1/models and benchmark rows."""
        return {"backend": self.name, "block_activations": self.block_activations}

    def prepare_ternary(self, codes: TernaryCodes, *, mode: LinearMode) -> PreparedLinear:
        """Once, at load: repack ternary codes (int8 [M, K] in {-1,0,1} + scale) into the runtime
        layout for `mode`. Raises UnsupportedModel if this backend cannot run that shape in that mode."""
        ...

    def prepare_ternary_file(self, weight: PackedWeight, *, mode: LinearMode) -> PreparedLinear | None:
        """Once, at load: a ternary file weight whose bytes the backend reads as they are (the cpu
        backend's I2_S, read in place from the file mapping), or None: the loader then unpacks it and
        calls `prepare_ternary`. The weight's bytes must then stay mapped while the model lives."""
        return None

    def prepare_dense(self, weight: torch.Tensor) -> PreparedLinear:
        """Once, at load: a float32 [M, K] weight (block formats are dequantized before this)."""
        ...

    def prepare_block(self, weight: PackedWeight) -> PreparedLinear | None:
        """Once, at load: keep a non-ternary block-quantized file weight (Q4_1, Q8_0, ...) in a packed
        runtime form. None when this backend keeps no packed form for that layout: the loader then
        dequantizes it and calls `prepare_dense`. Results match the dense path within fp32
        summation-order tolerance, not bit for bit."""
        ...

    def fuse_group(self, weights: Sequence[PreparedLinear]) -> tuple[PreparedLinear, list[int]] | None:
        """Once, at load: the weights of one group stacked into one (stacked weight, row offset of each
        weight in its output), or None: no fusion for these weights. Splitting the stacked output must
        be bit-identical to running the weights one by one."""
        ...

    def fused_ops(self) -> FusedOps | None:
        """The backend's one-call small ops (looked up once per model), or None: layers run eager torch."""
        ...

    def half_head_gemv(self, weight: torch.Tensor) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """Once, at load: this backend's single-token kernel for an F16 / BF16 LM head weight [vocab,
        hidden], f32 [1, hidden] -> f32 [1, vocab] logits bit-identical to layers.embedding's torch path
        (activations rounded to the weight's dtype, F.linear, widened), or None: torch runs every call."""
        return None

    def gated_activation(
        self, name: str, *, int8_projections: bool
    ) -> Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None:
        """Once, at load: this backend's act(gate) * up for the module forward (f32 [T, I] each -> f32
        [T, I]) where its compiled forward computes the activation its own way and both must agree to
        the bit; None: the layers' torch function. int8_projections: the model's projections run on int8
        activations (ternary in bitnet mode, or block weights in the q8 mode)."""
        return None

    def compile_decoder(self, plan: DecoderPlan) -> CompiledDecoder | None:
        """Once, at load: this backend's fast forward of the model's layers (kernels/plan.py), or None:
        the module forward (the oracle, models/decoder.py) runs every step. A compiled forward computes
        what the module forward computes (bit for bit on integer paths) and says per step whether it
        applies."""
        return None

    def bind_group(self, weights: Sequence[PreparedLinear]) -> LinearKernelGroup:
        """Once, at load: the group of weights run on one input (stacked where `fuse_group` can)."""
        for weight in weights:
            self.check_owner(weight)
        out_features = [weight.out_features for weight in weights]
        fused = self.fuse_group(weights)
        if fused is None:
            return LinearKernelGroup(weights, out_features)
        stacked, row_offsets = fused
        return LinearKernelGroup([stacked], out_features, row_offsets)

    def check_owner(self, weight: PreparedLinear) -> None:
        if weight.backend != self.name:
            raise ValueError(f"weight prepared by {weight.backend!r} given to the {self.name!r} backend")

    def linear(self, x: torch.Tensor, weight: PreparedLinear) -> torch.Tensor:
        """x f32 [num_tokens, K] -> f32 [num_tokens, M]: `weight(x)` after checking who prepared it.
        Row i of the output depends only on row i of x (bit-exact batch invariance in BITNET mode)."""
        self.check_owner(weight)
        return weight(x)

    def linear_group(self, x: torch.Tensor, weights: Sequence[PreparedLinear]) -> list[torch.Tensor]:
        """Several weights on the same input, activations quantized once (unstacked; layers bind their
        groups once with `bind_group` instead). One f32 [T, M_i] per weight, equal to `linear(x, w_i)`."""
        for weight in weights:
            self.check_owner(weight)
        return LinearKernelGroup(weights, [weight.out_features for weight in weights])(x)
