"""A lean decode step on the cpu backend for models whose projections run on int8 activations: Llama-family
models with Q4_0 / Q4_1 / Q8_0 weights (block_activations="q8") and ternary models (bitnet-b1.58 and
upstream bitnet; bitnet linear mode, the avx2 / vnni kernels).

Why a second forward (README, Layout: deviations): at decode shapes the module forward of
models/decoder.py spends more time in Python and torch dispatch (~40 calls a layer: norms, splits,
reshapes, RoPE, cache writes, attention, residual adds) than in its matmuls: ~20 ms a step on SmolLM2's
30 layers. This path runs the whole layer loop in one numba call (kernels/cpu/decode_step.py), 8 calls a
layer inside it: four int8 GEMVs on the stacked weights (kernels/cpu/blockdot.py or int8dot.py) and four
glue calls between them (kernels/cpu/decode_glue.py), each handing the next GEMV its int8 activations
(sub-norms included); the tables it reads are stacked once at load (cpu_ternary_step.py for ternary
weights, cpu_block_step.py for block weights). From Python, those 240 calls cost ~14 ms of a 2B step and
~1-2 ms of SmolLM2's. It
computes what the module forward computes (the same kernels, quantization, norm, RoPE and attention
arithmetic, the same numba SiLU / relu2 via CpuBackend, the `bitnet` arch's `.scale` products) and is
used only where that holds: every token of the step is a decode (one per sequence), an f32 KV cache, and
a model whose q/k/v and gate/up stacked into one int8 weight each (Int8BlockLinear or Int8BitnetLinear),
without ggml numerics (bitnetcpp mode), and output scales only on ternary weights. Anything else
(prefill, mixed steps, other weights, block formats mixed in one model, caches that are not one pool)
runs the module forward.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

import numba
import numpy as np
import torch

from bitserve.kernels.cpu import blockdot, decode_glue, int8dot
from bitserve.kernels.cpu.prepared import NEVER, CpuTuning, Int8BitnetLinear, Int8BlockLinear
from bitserve.kernels.cpu.ternary import padded_in_features
from bitserve.layers.attention import AttentionMetadata
from bitserve.layers.linear import LinearGroup
from bitserve.layers.rotary import RopeStyle
from bitserve.models.cpu_block_step import BlockStep
from bitserve.models.cpu_ternary_step import TernaryStep, pooled_layers

if TYPE_CHECKING:
    from bitserve.kernels.cpu.backend import CpuBackend

Int8Weight = Int8BlockLinear | Int8BitnetLinear


@dataclass(frozen=True, slots=True)
class _WeightKind:
    """What differs between the two kinds of int8 weights, for the glue and the step's bounds."""

    padded: Callable[[int], int]  # T -> the activation rows its kernel reads (zero rows pad the tile)
    glue_kp: Callable[[int], int | None]  # in_features -> decode_glue's `kp` (picks the quantizer)
    max_tokens: Callable[[CpuTuning], int]  # steps of this many tokens or more take the module forward


_KINDS = {
    # block weights: llama.cpp-style Q8 blocks; above block_gemm_min_tokens the module forward's sgemm
    Int8BlockLinear: _WeightKind(blockdot.padded_tokens, lambda k: None, lambda t: t.block_gemm_min_tokens),
    # ternary: per-token int8 activations, the int8 kernels for every batch size
    Int8BitnetLinear: _WeightKind(int8dot.padded_tokens, padded_in_features, lambda t: NEVER),
}


@dataclass(frozen=True, slots=True)
class _FastLayer:
    attn_norm: np.ndarray  # f32 [hidden]
    qkv: Int8Weight  # stacked q, k, v rows
    attn_sub_norm: np.ndarray | None  # f32 [heads * head_dim] (BitNet), before o_proj
    o_proj: Int8Weight
    ffn_norm: np.ndarray  # f32 [hidden]
    gate_up: Int8Weight  # stacked gate, up rows
    ffn_sub_norm: np.ndarray | None  # f32 [intermediate] (BitNet), before down
    down: Int8Weight
    # the `bitnet` arch's `.scale` multipliers as f32 [M] per output row of qkv, o_proj, gate_up, down
    # (1.0 for a weight without one, a product that changes nothing)
    output_scales: tuple[np.ndarray, ...]


def _single_int8(weights: list) -> Int8Weight | None:
    return weights[0] if len(weights) == 1 and type(weights[0]) in _KINDS else None


def _norm_weight(norm: torch.nn.Module | None) -> np.ndarray | None:
    return None if norm is None else norm.weight.detach().numpy()


def _row_output_scales(linear: torch.nn.Module) -> np.ndarray:
    """A Linear's or stacked LinearGroup's `.scale` multipliers (None: 1.0) per output row, f32 [M]."""
    scales = linear.output_scales if isinstance(linear, LinearGroup) else [linear.output_scale]
    sizes = linear.out_features if isinstance(linear, LinearGroup) else [linear.out_features]
    rows = [
        np.full(size, 1.0 if s is None else s, dtype=np.float32)
        for s, size in zip(scales, sizes, strict=True)
    ]
    return np.concatenate(rows)


def _fast_layer(layer: torch.nn.Module) -> _FastLayer | None:
    """One DecoderLayer's weights, or None where it does not qualify (see the module docstring)."""
    qkv, gate_up = _single_int8(layer.qkv.weights), _single_int8(layer.gate_up.weights)
    o_proj, down = _single_int8(layer.o_proj.weights), _single_int8(layer.down_proj.weights)
    if None in (qkv, gate_up, o_proj, down) or len({type(w) for w in (qkv, gate_up, o_proj, down)}) != 1:
        return None
    projections = (layer.qkv, layer.o_proj, layer.gate_up, layer.down_proj)
    output_scales = tuple(_row_output_scales(p) for p in projections)
    if type(qkv) is Int8BlockLinear and any((s != 1.0).any() for s in output_scales):
        return None  # only the ternary step (kernels/cpu/decode_step.py) applies output scales
    if layer.attn.ggml_numerics or layer.gate_up.row_offsets != [0, gate_up.out_features // 2]:
        return None
    return _FastLayer(
        _norm_weight(layer.attn_norm),
        qkv,
        _norm_weight(layer.attn_sub_norm),
        o_proj,
        _norm_weight(layer.ffn_norm),
        gate_up,
        _norm_weight(layer.ffn_sub_norm),
        down,
        output_scales,
    )


def _is_relu2(model: torch.nn.Module, backend: CpuBackend) -> bool | None:
    """The glue's activation flag: True for relu2, False for SiLU, None where the module forward's
    activation is not one of the glue's numba functions (then the two forwards would differ)."""
    act = model.layers[0].act_and_mul
    if act == backend.relu2_and_mul:
        return True
    return False if act == backend.silu_and_mul else None


class FastCpuDecode:
    """The decode step of one DecoderModel (see the module docstring); build() says whether it applies."""

    def __init__(self, model: torch.nn.Module, layers: list[_FastLayer], relu2: bool) -> None:
        spec = model.spec
        first = layers[0]
        kind = _KINDS[type(first.qkv)]
        self.model = model
        self.relu2 = relu2
        self.max_tokens = kind.max_tokens(first.qkv.tuning)
        self.padded_tokens = kind.padded
        # decode_glue's quantizer argument for the inputs of qkv / gate_up, o_proj and down
        self.kp_hidden = kind.glue_kp(first.qkv.in_features)
        self.kp_attn = kind.glue_kp(first.o_proj.in_features)
        self.kp_inter = kind.glue_kp(first.down.in_features)
        self.num_heads, self.num_kv_heads = spec.num_heads, spec.num_kv_heads
        self.intermediate = first.down.in_features
        self.eps = spec.rms_norm_eps
        rotary = model.rotary
        self.cos, self.sin = rotary.cos.numpy(), rotary.sin.numpy()  # f32 [max_positions, rope_dim / 2]
        self.rope_dim, self.is_neox = rotary.rope_dim, rotary.style is RopeStyle.NEOX
        self.scale = model.layers[0].attn.scale
        self.num_threads = first.qkv.num_threads
        # the whole layer loop in one numba call (kernels/cpu/decode_step.py): cpu_ternary_step.py's tables
        # for ternary weights, cpu_block_step.py's for block weights; None (the module forward runs) for
        # ternary weights scattered in memory or block formats mixed in one model
        self.is_ternary = kind is _KINDS[Int8BitnetLinear]
        self.step = TernaryStep.build(layers) if self.is_ternary else BlockStep.build(layers)
        # Start numba's threading layer now. The step's entry points are not parallel themselves, only the
        # kernels they call; numba starts the thread pool when a parallel function is compiled or loaded,
        # not when a non-parallel caller's cached code (with the kernels inside) is loaded, which then calls
        # a null launcher (a segfault) if no parallel function ran in this process yet.
        numba.get_num_threads()
        self._pool_of: tuple[int, int, int] | None = None  # (id, first data_ptr, length) of the caches
        self._pool: np.ndarray | None = None  # their pooled_layers view, f32 [L, 2, blocks, ...]

    @classmethod
    def build(cls, model: torch.nn.Module, backend: CpuBackend) -> FastCpuDecode | None:
        """Once, at load: the fast step when every layer qualifies, else None."""
        relu2 = _is_relu2(model, backend)
        if relu2 is None or model.rotary.fused is None:
            return None
        layers = [_fast_layer(layer) for layer in model.layers]
        if None in layers or len({type(layer.qkv) for layer in layers}) != 1:  # type: ignore[union-attr]
            return None
        return cls(model, layers, relu2)  # type: ignore[arg-type]

    def applies(
        self, num_tokens: int, kv_caches: list[torch.Tensor] | None, metadata: AttentionMetadata | None
    ) -> bool:
        """True for a step of decodes only (one token per sequence), small enough, on an f32 cache."""
        if (
            kv_caches is None
            or metadata is None
            or metadata.decode is None
            or not 0 < num_tokens < self.max_tokens
        ):
            return False
        every_decode = metadata.other_seq_ids == () and metadata.num_seqs == num_tokens
        if not every_decode or kv_caches[0].dtype != torch.float32:
            return False
        return self.step is not None and self._kv_pool(kv_caches) is not None

    def _kv_pool(self, kv_caches: list[torch.Tensor]) -> np.ndarray | None:
        """The caches as one array for the step (cpu_ternary_step.pooled_layers), looked up once per list
        of caches; None where they are not one pool (then the module forward runs)."""
        key = (id(kv_caches), kv_caches[0].data_ptr(), len(kv_caches))
        if key != self._pool_of:
            pool = pooled_layers(kv_caches)
            self._pool_of, self._pool = key, None if pool is None else pool.numpy()
        return self._pool

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions [T] (token t is sequence t's) -> hidden_states f32 [T, hidden] (final norm
        applied), exactly as DecoderModel.forward returns them."""
        if self.num_threads is not None:
            numba.set_num_threads(self.num_threads)
        num_tokens = input_ids.shape[0]
        padded = self.padded_tokens(num_tokens)
        parallel_gate = decode_glue.is_parallel_gate(num_tokens)
        eps = self.eps
        x = self.model.embed_tokens(input_ids).contiguous().numpy()  # f32 [T, hidden], the residual stream
        positions_np = positions.numpy()
        slots = metadata.slot_mapping.numpy()
        block_table = metadata.decode.block_table.numpy()
        seq_lens = metadata.decode.seq_lens.numpy()
        shape = (self.num_heads, self.num_kv_heads, self.intermediate, self.scale)
        shape += (self.kp_hidden, self.kp_attn, self.kp_inter, padded)
        rope = (self.cos, self.sin, self.rope_dim, self.is_neox)
        step = (positions_np, rope, self._kv_pool(kv_caches), slots, block_table, seq_lens, shape, eps)
        self.step.run(x, (*step, self.relu2, parallel_gate))  # type: ignore[union-attr]
        return self.model.norm(torch.from_numpy(x))
