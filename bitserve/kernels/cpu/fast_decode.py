"""The cpu backend's compiled decode step (`CpuBackend.compile_decoder`), from a model's DecoderPlan
(kernels/plan.py): a lean decode step for models whose projections run on int8 activations: Llama-family
models with Q4_0 / Q4_1 / Q8_0 weights (block_activations="q8") and ternary models (bitnet-b1.58 and
upstream bitnet; bitnet linear mode, the avx2 / vnni kernels).

Why a compiled forward: at decode shapes the module forward of models/decoder.py spends more time in
Python and torch dispatch (~40 calls a layer: norms, splits, reshapes, RoPE, cache writes, attention,
residual adds) than in its matmuls: ~20 ms a step on SmolLM2's 30 layers. This path runs the whole layer
loop in one numba call (kernels/cpu/decode_step.py), 8 calls a layer inside it: four int8 GEMVs on the
stacked weights (kernels/cpu/blockdot.py or int8dot.py) and four glue calls between them
(kernels/cpu/decode_glue.py), each handing the next GEMV its int8 activations (sub-norms included); the
tables it reads are stacked once at load (ternary_step.py for ternary weights, block_step.py for block
weights). From Python, those 240 calls cost ~14 ms of a 2B step and ~1-2 ms of SmolLM2's. It computes
what the module forward computes (the same kernels, quantization, norm, RoPE and attention arithmetic, the
same numba SiLU / relu2 / GELU via CpuBackend, the `bitnet` arch's `.scale` products; Gemma 3's post-norms,
sliding windows and the sliding layers' own RoPE tables) and is used only where that holds: every token of
the step is a decode (one per sequence), an f32 KV cache, and a model whose projections are int8 weights
of one kind (Int8BlockLinear, or Int8BitnetLinear stacked into one a projection), without ggml numerics
(bitnetcpp mode), and output scales only on ternary weights. Block formats mixed in one model (the K-quant
mixes) take block_step.MixedBlockStep. Anything else (prefill, mixed steps, other weights,
block_activations "ggml", caches that are not one pool, plan parts the step lacks: MiniCPM's residual
scale) runs the module forward.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass

import numba
import numpy as np
import torch

from bitserve.kernels.attention_metadata import AttentionMetadata
from bitserve.kernels.cpu import blockdot, decode_glue, int8dot
from bitserve.kernels.cpu.block_step import BlockStep
from bitserve.kernels.cpu.prepared import NEVER, CpuTuning, Int8BitnetLinear, Int8BlockLinear
from bitserve.kernels.cpu.step_layers import StepLayer, pooled_layers, step_layer
from bitserve.kernels.cpu.ternary import padded_in_features
from bitserve.kernels.cpu.ternary_step import TernaryStep
from bitserve.kernels.plan import DecoderPlan, LayerPlan, RopeTables


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


def _beyond_the_step(layer: LayerPlan) -> bool:
    """Parts of the layer the step does not run: beyond_llama less Gemma's post-norms and window (the
    step's own), so that whatever else a plan grows (MiniCPM's residual scale) declines until it does."""
    return dataclasses.replace(layer, attn_post_norm=None, ffn_post_norm=None, sliding_window=0).beyond_llama


def _rope_tables(plan: DecoderPlan) -> tuple | None:
    """The step's rope argument (decode_step._decode_layers): (cos, sin: tuples of R f32 [max_positions,
    rope_dim / 2] tables, rope_dim, is_neox, int64 [L] each layer's table): R = 1 unless the sliding layers
    have their own (Gemma 3). The module forward's arrays, not copies (a 128k-position model's are 64 MB
    each); None where the tables differ in shape or rotation (the step rotates every layer alike)."""
    tables: list[RopeTables] = [plan.rope]
    if plan.sliding_rope is not None and any(layer.sliding_window for layer in plan.layers):
        tables.append(plan.sliding_rope)
    first, last = tables[0], tables[-1]
    if (first.cos.shape, first.rope_dim, first.is_neox) != (last.cos.shape, last.rope_dim, last.is_neox):
        return None
    # by identity: RopeTables' == would compare its tensors
    of_layer = np.array([int(plan.layer_rope(layer) is not first) for layer in plan.layers], dtype=np.int64)
    # one array type for the tuple (numba indexes a tuple of one type by a runtime int)
    cos = tuple(np.ascontiguousarray(t.cos.numpy(), dtype=np.float32) for t in tables)
    sin = tuple(np.ascontiguousarray(t.sin.numpy(), dtype=np.float32) for t in tables)
    return cos, sin, first.rope_dim, first.is_neox, of_layer


class FastCpuDecode:
    """The decode step of one model (see the module docstring); build() says whether it applies."""

    def __init__(self, plan: DecoderPlan, layers: list[StepLayer], activation: int, rope: tuple) -> None:
        first = layers[0]
        kind = _KINDS[type(first.qkv[0])]
        self.activation = activation  # decode_glue.SILU, RELU2 or GELU
        self.max_tokens = kind.max_tokens(first.qkv[0].tuning)
        self.padded_tokens = kind.padded
        # decode_glue's quantizer argument for the inputs of qkv / gate_up, o_proj and down
        self.kp_hidden = kind.glue_kp(first.qkv[0].in_features)
        self.kp_attn = kind.glue_kp(first.o_proj[0].in_features)
        self.kp_inter = kind.glue_kp(first.down[0].in_features)
        self.num_heads, self.num_kv_heads = plan.num_heads, plan.num_kv_heads
        self.intermediate = first.down[0].in_features
        self.eps = plan.rms_norm_eps
        self.rope = rope  # _rope_tables
        self.scale = plan.attn_scale
        self.num_threads = first.qkv[0].num_threads
        # the whole layer loop in one numba call (kernels/cpu/decode_step.py): ternary_step.py's tables
        # for ternary weights, block_step.py's for block weights; None (the module forward runs) for
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
    def build(cls, plan: DecoderPlan, activation: int) -> FastCpuDecode | None:
        """Once, at load: the fast step when every layer qualifies, else None. activation: the module
        forward's is the glue's (decode_glue.SILU, RELU2 or GELU)."""
        if plan.ggml_numerics or any(_beyond_the_step(layer) for layer in plan.layers):
            return None  # parts the step does not run: the module forward runs them
        post_norms = {layer.attn_post_norm is None for layer in plan.layers}
        post_norms |= {layer.ffn_post_norm is None for layer in plan.layers}
        rope = _rope_tables(plan)
        if len(post_norms) != 1 or rope is None:
            return None  # the step stacks post-norms [L, hidden]: in every layer or none
        layers = [step_layer(layer) for layer in plan.layers]
        if None in layers or len({type(layer.qkv[0]) for layer in layers}) != 1:  # type: ignore[union-attr]
            return None
        first = layers[0].qkv[0]  # type: ignore[union-attr]
        if type(first) is Int8BlockLinear and first.tuning.ggml_activations:
            return None  # the glue quantizes as the "q8" mode; ggml mode is for crossval, not speed
        fast = cls(plan, layers, activation, rope)  # type: ignore[arg-type]
        return fast if fast.step is not None else None

    def applies(
        self, num_tokens: int, kv_caches: list[torch.Tensor] | None, metadata: AttentionMetadata | None
    ) -> bool:
        """True for a step of decodes only (one token per sequence), small enough, on an f32 cache."""
        if (
            kv_caches is None
            or metadata is None
            or metadata.host is None
            or metadata.host.decode is None
            or not 0 < num_tokens < self.max_tokens
        ):
            return False
        every_decode = metadata.host.other_seq_ids == () and metadata.num_seqs == num_tokens
        if not every_decode or kv_caches[0].dtype != torch.float32:
            return False
        return self._kv_pool(kv_caches) is not None

    def _kv_pool(self, kv_caches: list[torch.Tensor]) -> np.ndarray | None:
        """The caches as one array for the step (step_layers.pooled_layers), looked up once per list
        of caches; None where they are not one pool (then the module forward runs)."""
        key = (id(kv_caches), kv_caches[0].data_ptr(), len(kv_caches))
        if key != self._pool_of:
            pool = pooled_layers(kv_caches)
            self._pool_of, self._pool = key, None if pool is None else pool.numpy()
        return self._pool

    def run_layers(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """hidden f32 [T, hidden] (the embeddings; token t is sequence t's), positions [T] -> the last
        layer's output f32 [T, hidden], before the final norm, exactly as the module forward's layers
        give it. Where `applies` held."""
        if self.num_threads is not None:
            numba.set_num_threads(self.num_threads)
        num_tokens = hidden.shape[0]
        padded = self.padded_tokens(num_tokens)
        parallel_gate = decode_glue.is_parallel_gate(num_tokens)
        x = hidden.contiguous()  # the residual stream, updated in place by the step
        slots = metadata.slot_mapping.numpy()
        decode = metadata.host.decode  # type: ignore[union-attr]  # applies() held: a host decode batch
        block_table = decode.block_table.numpy()  # type: ignore[union-attr]
        seq_lens = decode.seq_lens.numpy()  # type: ignore[union-attr]
        shape = (self.num_heads, self.num_kv_heads, self.intermediate, self.scale)
        shape += (self.kp_hidden, self.kp_attn, self.kp_inter, padded)
        kv_pool = self._kv_pool(kv_caches)
        step = (positions.numpy(), self.rope, kv_pool, slots, block_table, seq_lens, shape, self.eps)
        self.step.run(x.numpy(), (*step, self.activation, parallel_gate))  # type: ignore[union-attr]
        return x
