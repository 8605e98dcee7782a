"""A lean decode step for Llama-family models with Q4_0 / Q4_1 / Q8_0 weights on the cpu backend.

Why a second forward (README, Layout: deviations): at decode shapes the module forward of
models/decoder.py spends more time in Python and torch dispatch (~40 calls a layer: norms, splits,
reshapes, RoPE, cache writes, attention, residual adds) than in its matmuls: ~20 ms a step on SmolLM2's
30 layers. This path makes 8 calls a layer: four int8 GEMVs on the stacked weights
(kernels/cpu/blockdot.py) and four numba glue calls between them (kernels/cpu/decode_glue.py), each
handing the next GEMV its int8 activations. It computes what the module forward computes with
`block_activations="q8"` (the same kernels, quantization, norm, RoPE and attention arithmetic; SiLU as
x / (1 + e^-x) in f32) and is used only where that holds: every token of the step is a decode (one per
sequence), fewer than block_gemm_min_tokens of them, an f32 KV cache, and a model whose q/k/v and
gate/up stacked into one int8 block weight each, without sub-norms, output scales or ggml numerics.
Anything else (prefill, mixed steps, other weights) runs the module forward.
"""

from __future__ import annotations

from dataclasses import dataclass

import numba
import numpy as np
import torch

from bitserve.kernels.cpu import blockdot, decode_glue
from bitserve.kernels.cpu.prepared import Int8BlockLinear
from bitserve.layers.attention import AttentionMetadata
from bitserve.layers.rotary import RopeStyle


@dataclass(frozen=True, slots=True)
class _FastLayer:
    attn_norm: np.ndarray  # f32 [hidden]
    qkv: Int8BlockLinear  # stacked q, k, v rows
    o_proj: Int8BlockLinear
    ffn_norm: np.ndarray  # f32 [hidden]
    gate_up: Int8BlockLinear  # stacked gate, up rows
    down: Int8BlockLinear


def _single_int8_block(weights: list) -> Int8BlockLinear | None:
    return weights[0] if len(weights) == 1 and type(weights[0]) is Int8BlockLinear else None


class FastCpuDecode:
    """The decode step of one DecoderModel (see the module docstring); build() says whether it applies."""

    def __init__(self, model: torch.nn.Module, layers: list[_FastLayer], max_tokens: int) -> None:
        spec = model.spec
        self.model = model
        self.layers = layers
        self.max_tokens = max_tokens  # block_gemm_min_tokens: larger batches take the sgemm path
        self.num_heads, self.num_kv_heads = spec.num_heads, spec.num_kv_heads
        self.intermediate = layers[0].down.in_features
        self.eps = spec.rms_norm_eps
        rotary = model.rotary
        self.cos, self.sin = rotary.cos.numpy(), rotary.sin.numpy()  # f32 [max_positions, rope_dim / 2]
        self.rope_dim, self.is_neox = rotary.rope_dim, rotary.style is RopeStyle.NEOX
        self.scale = model.layers[0].attn.scale
        self.num_threads = layers[0].qkv.num_threads

    @classmethod
    def build(cls, model: torch.nn.Module) -> FastCpuDecode | None:
        """Once, at load: the fast step when every layer qualifies, else None."""
        spec = model.spec
        if spec.has_sub_norms or spec.activation != "silu" or model.rotary.fused is None:
            return None
        layers = []
        for layer in model.layers:
            qkv, gate_up = _single_int8_block(layer.qkv.weights), _single_int8_block(layer.gate_up.weights)
            o_proj, down = (
                _single_int8_block(layer.o_proj.weights),
                _single_int8_block(layer.down_proj.weights),
            )
            scales = [*layer.qkv.output_scales, *layer.gate_up.output_scales]
            scales += [layer.o_proj.output_scale, layer.down_proj.output_scale]
            if None in (qkv, gate_up, o_proj, down) or any(s is not None for s in scales):
                return None
            if layer.attn.ggml_numerics or layer.gate_up.row_offsets != [0, gate_up.out_features // 2]:
                return None
            layers.append(
                _FastLayer(
                    layer.attn_norm.weight.detach().numpy(),
                    qkv,
                    o_proj,
                    layer.ffn_norm.weight.detach().numpy(),
                    gate_up,
                    down,
                )
            )
        return cls(model, layers, qkv.tuning.block_gemm_min_tokens)

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
        return every_decode and kv_caches[0].dtype == torch.float32

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
        padded = 1 if num_tokens == 1 else blockdot.padded_token_count(num_tokens, blockdot.GEMM_TOKENS)
        x = self.model.embed_tokens(input_ids).contiguous().numpy()  # f32 [T, hidden], the residual stream
        positions_np = positions.numpy()
        slots = metadata.slot_mapping.numpy()
        block_table = metadata.decode.block_table.numpy()
        seq_lens = metadata.decode.seq_lens.numpy()
        delta = None  # the last projection's output, added to x by the next glue call
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            acts = (
                decode_glue.norm_quantize(x, layer.attn_norm, self.eps, padded)
                if delta is None
                else decode_glue.residual_norm_quantize(x, delta, layer.attn_norm, self.eps, padded)
            )
            qkv = layer.qkv.gemv_q8(acts, num_tokens)
            acts = decode_glue.rope_attend_quantize(
                qkv,
                self.num_heads,
                self.num_kv_heads,
                positions_np,
                self.cos,
                self.sin,
                self.rope_dim,
                self.is_neox,
                kv_cache[0].numpy(),
                kv_cache[1].numpy(),
                slots,
                block_table,
                seq_lens,
                self.scale,
                padded,
            )
            attn_out = layer.o_proj.gemv_q8(acts, num_tokens)
            acts = decode_glue.residual_norm_quantize(x, attn_out, layer.ffn_norm, self.eps, padded)
            gate_up = layer.gate_up.gemv_q8(acts, num_tokens)
            acts = decode_glue.silu_mul_quantize(gate_up, self.intermediate, padded)
            delta = layer.down.gemv_q8(acts, num_tokens)
        x += delta
        return self.model.norm(torch.from_numpy(x))
