"""The decoder forward on a CUDA device: the same model, with the CUDA backend's fused Triton kernels.

`CudaDecoder` wraps a `DecoderModel` built on the CUDA backend and runs its layers with fewer, fused
launches (what decides decode speed at batch 1, where each layer's weights are 1.6-8.8 MB):
- a ternary projection takes its RMSNorm (or the gated activation and sub-norm before Wdown) and the
  int8 activation quantization in one `norm_quantize` launch, then one `ternary_linear` launch that also
  adds the residual: 2 launches where the generic layers make ~12; a ternary gate/up (rows interleaved
  at load) writes act(gate) * up from its own epilogue, so Wdown's norm_quantize reads half as much;
- RoPE on q and k and the KV-cache write are one launch (`rotary_and_cache_`), attention one more
  (`paged_decode_attention` for a decode-only step, `paged_prefill_attention` otherwise).
Q4_0 / Q4_1 / Q8_0 projections (SmolLM2) take their RMSNorm, the gated activation before Wdown and the
residual into one `block_gemv` launch (CudaBlockLinear.run_fused) on steps of up to 4 tokens; dense float
projections run a Triton RMSNorm and cuBLAS; anything else the layer's own modules.
Numerics: ternary linears are bit-identical to the reference backend; norms, RoPE and attention are fp32
with the GPU's summation order (tokens equal the reference's on the golden tests).

The forward has no host sync and allocates only from its inputs' shapes, so the runner can capture a
decode step in a CUDA graph (runner/cuda_graphs.py).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass

import torch

from bitserve.errors import UnsupportedModel
from bitserve.kernels.backend import PreparedLinear
from bitserve.kernels.cuda.argmax import StepFeed, cast_argmax_rows
from bitserve.kernels.cuda.backend import CudaBlockLinear, CudaDenseLinear, CudaTernaryLinear
from bitserve.kernels.cuda.elementwise import ACTIVATIONS, act_and_mul, rms_norm
from bitserve.kernels.cuda.greedy_head import MAX_ROWS as GREEDY_HEAD_MAX_ROWS
from bitserve.kernels.cuda.greedy_head import OUTPUT_STEP as GREEDY_HEAD_DTYPES
from bitserve.kernels.cuda.greedy_head import GreedyHead, supports_hidden
from bitserve.kernels.cuda.paged_attention import paged_decode_attention, paged_prefill_attention
from bitserve.kernels.cuda.pair_epilogue import GATED_PAIRS, gated_row_order
from bitserve.kernels.cuda.quantize import norm_quantize
from bitserve.kernels.cuda.rotary_cache import rotary_and_cache_
from bitserve.kernels.packed import Layout
from bitserve.kernels.reference.dequant import dense_rows
from bitserve.layers.linear import Linear, LinearGroup
from bitserve.layers.rotary import RopeStyle
from bitserve.models.decoder import DecoderLayer, DecoderModel

logger = logging.getLogger(__name__)

GREEDY_HEAD_ENV = "BITSERVE_CUDA_GREEDY_HEAD"  # "0": greedy decode steps run the full head
# GATED_ACTIVATIONS names that norm_quantize computes in its prologue
_FUSED_ACTIVATIONS = {"relu2": "relu2", "relu_sqr": "relu2", "silu": "silu"}
_FLOAT_LAYOUTS = {Layout.F16: torch.float16, Layout.BF16: torch.bfloat16, Layout.F32: torch.float32}


@dataclass(frozen=True, slots=True)
class DeviceAttentionMetadata:
    """One step's paged-attention inputs, all on the device (S sequences, T tokens).

    Sequence s owns rows query_start_loc[s]:query_start_loc[s+1] of the batch, which are the last
    positions of its context of seq_lens[s] tokens. decode_only: every sequence has one query (the
    decode kernel runs; padded rows of a CUDA-graph bucket point at a scratch block).
    """

    slot_mapping: torch.Tensor  # [T] int64
    block_table: torch.Tensor  # [S, max_blocks] int32
    seq_lens: torch.Tensor  # [S] int32
    query_start_loc: torch.Tensor  # [S + 1] int32
    max_query_len: int
    decode_only: bool
    # flash-decoding splits of the decode kernel (None: its rule, from the table width); a CUDA-graph
    # bucket of short contexts asks for 1, since the table is as wide as the longest context it serves
    decode_splits: int | None = None


def _single_weight(linear: Linear | LinearGroup, kind: type[PreparedLinear]) -> PreparedLinear | None:
    """The one (stacked) weight a linear or group runs, when it is a `kind` and no per-output scalar
    multiplies its output; else None (the layer's own module runs it)."""
    scales = linear.output_scales if isinstance(linear, LinearGroup) else [linear.output_scale]
    weights = linear.weights
    if len(weights) == 1 and isinstance(weights[0], kind) and all(s is None for s in scales):
        return weights[0]
    return None


class _CudaLayer:
    """One DecoderLayer's weights, with each projection's path chosen once: ternary (norm + quantize,
    then the W2A8 kernel with the residual), block-quantized (norm, activation and residual in the block
    GEMV), plain dense (Triton norm, cuBLAS, residual via addmm), or the layer's own modules (output
    scales, reference fallbacks)."""

    def __init__(self, layer: DecoderLayer, activation: str, eps: float) -> None:
        self.layer = layer
        self.eps = eps
        if activation not in ACTIVATIONS:  # at load, not at the first step
            raise UnsupportedModel(f"FFN activation {activation!r} has no CUDA kernel")
        self.activation = activation
        fused_act = _FUSED_ACTIVATIONS.get(activation)
        self.modules: dict[str, Linear | LinearGroup] = {
            "qkv": layer.qkv,
            "o": layer.o_proj,
            "gate_up": layer.gate_up,
            "down": layer.down_proj,
        }
        self.ternary = {name: _single_weight(m, CudaTernaryLinear) for name, m in self.modules.items()}
        self.block = {name: _single_weight(m, CudaBlockLinear) for name, m in self.modules.items()}
        dense = {name: _single_weight(m, CudaDenseLinear) for name, m in self.modules.items()}
        self.dense = {name: None if w is None else w.data for name, w in dense.items()}  # f32 [M, K]
        if fused_act is None:
            self.ternary["down"] = None  # the gated activation runs before Wdown, not in its prologue
        self.fused_act = fused_act
        self.q_width = layer.num_heads * layer.head_dim
        self.kv_width = layer.num_kv_heads * layer.head_dim
        self.gate_pair = self._pair_gate_up()

    def _pair_gate_up(self) -> int | None:
        """Ternary gate/up feeding a ternary Wdown: rows interleaved so the kernel's epilogue writes
        act(gate) * up (pair_epilogue.py), and Wdown's norm_quantize reads I values, not 2I."""
        weight, module = self.ternary["gate_up"], self.modules["gate_up"]
        widths = module.out_features if isinstance(module, LinearGroup) else []
        if weight is None or self.ternary["down"] is None or len(widths) != 2 or widths[0] != widths[1]:
            return None
        weight.permute_rows(gated_row_order(widths[0]))
        return GATED_PAIRS[self.activation]

    def _norm(self, x: torch.Tensor, norm: torch.nn.Module | None) -> torch.Tensor:
        return x if norm is None else rms_norm(x, norm.weight, self.eps)

    def _project(
        self, name: str, x: torch.Tensor, norm: torch.nn.Module | None, residual: torch.Tensor | None = None
    ) -> torch.Tensor:
        """norm(x) through projection `name` (+ residual): f32 [T, M] (a group's outputs side by side)."""
        ternary, dense, block = self.ternary[name], self.dense[name], self.block[name]
        norm_weight = None if norm is None else norm.weight
        if ternary is not None:
            return _norm_linear(ternary, x, norm_weight, self.eps, residual=residual)
        if block is not None:
            return block.run_fused(x, norm_weight, self.eps, residual=residual)
        x = self._norm(x, norm)
        if dense is not None:
            if residual is None:
                return torch.nn.functional.linear(x, dense)
            # in place: the residual stream tensor is this layer's own (nothing else reads it after),
            # and cuBLAS then accumulates into it instead of first copying it to a fresh output
            return residual.addmm_(x, dense.t())
        out = _run(self.modules[name], x)
        return out if residual is None else residual + out

    def qkv_out(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden f32 [T, hidden] -> q|k|v f32 [T, (H + 2 KVH) * D] (columns in that order)."""
        return self._project("qkv", hidden, self.layer.attn_norm)

    def attn_out(self, attn: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        """attn f32 [T, H * D] -> residual + Wo(sub_norm(attn))."""
        return self._project("o", attn, self.layer.attn_sub_norm, residual)

    def ffn(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden f32 [T, hidden] -> hidden + Wdown(sub_norm(act(gate) * up))."""
        layer = self.layer
        norm = None if layer.ffn_sub_norm is None else layer.ffn_sub_norm.weight
        down = self.ternary["down"]
        if self.gate_pair is not None:
            gate_up = self.ternary["gate_up"]
            assert gate_up is not None and down is not None  # invariant: _pair_gate_up's condition
            ffn_norm = None if layer.ffn_norm is None else layer.ffn_norm.weight
            ffn_act = _norm_linear(gate_up, hidden, ffn_norm, self.eps, pair=self.gate_pair)  # act(gate) * up
            return _norm_linear(down, ffn_act, norm, self.eps, residual=hidden)
        gate_up = self._project("gate_up", hidden, layer.ffn_norm)  # [T, 2 * I]
        if down is not None:
            return _norm_linear(down, gate_up, norm, self.eps, residual=hidden, activation=self.fused_act)
        block_down = self.block["down"]
        if block_down is not None:  # act(gate) * up, sub-norm and residual in the GEMV (or its fallback)
            return block_down.run_fused(gate_up, norm, self.eps, activation=self.activation, residual=hidden)
        ffn_out = act_and_mul(gate_up, self.activation)  # [T, I]
        return self._project("down", ffn_out, layer.ffn_sub_norm, hidden)


def _norm_linear(
    weight: CudaTernaryLinear,
    x: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
    *,
    residual: torch.Tensor | None = None,
    activation: str | None = None,
    pair: int | None = None,
) -> torch.Tensor:
    """Two launches: act/norm + int8 quantization of x, then the W2A8 kernel (+ residual), or with a
    gated `pair` the kernel's pair epilogue (a permuted gate/up weight -> act(gate) * up)."""
    q, s_act = norm_quantize(x, norm_weight, eps, activation=activation)
    if pair is not None:
        return weight.run_paired(q, s_act, pair)
    return weight.run_quantized(q, s_act, residual)


def _run(linear: Linear | LinearGroup, x: torch.Tensor) -> torch.Tensor:
    out = linear(x)
    return torch.cat(out, dim=1) if isinstance(out, list) else out


class CudaDecoder:
    """`DecoderModel`'s forward contract on the device, with DeviceAttentionMetadata."""

    def __init__(self, model: DecoderModel, device: torch.device, *, greedy_head: bool = True) -> None:
        spec = model.spec
        if model.layers[0].attn.ggml_numerics:
            raise UnsupportedModel(
                "the bitnetcpp linear mode (bitnet.cpp's CPU rounding) is not implemented on CUDA",
                hint="use --linear-mode bitnet on a GPU (the same ternary linears, bit for bit)",
            )
        self.model = model.to(device)  # norms, RoPE tables; prepared weights are already there
        self.device = device
        self.spec = spec
        self.layers = [_CudaLayer(layer, spec.activation, spec.rms_norm_eps) for layer in model.layers]
        self.embedding = _device_embedding(model, device)  # [vocab, hidden], f32 / f16 / bf16
        # logits in the head's dtype; a float matrix's input is rounded to its dtype (head_input_dtype)
        head_matrix = _head_matrix(model, device, self.embedding)
        self.head, self.head_input_dtype = _device_head(head_matrix)
        # greedy rows of small decode steps: the argmax from an int8 copy of a float head
        self.greedy_head = _greedy_head(head_matrix) if greedy_head else None
        rotary = model.rotary
        self.cos, self.sin = rotary.cos.to(device), rotary.sin.to(device)  # [max_pos, rope_dim / 2]
        self.rope_dim, self.is_neox = rotary.rope_dim, rotary.style is RopeStyle.NEOX
        self.scale = model.layers[0].attn.scale

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: DeviceAttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions int64 [T] -> hidden_states f32 [T, hidden] (final norm applied)."""
        hidden = self.embedding[input_ids].to(torch.float32)  # [T, hidden]
        return self.final_norm(self.run_layers(hidden, positions, kv_caches, metadata))

    __call__ = forward

    def run_layers(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: DeviceAttentionMetadata,
    ) -> torch.Tensor:
        """hidden f32 [T, hidden] (the tokens' embeddings), positions int64 [T] -> the last layer's output
        f32 [T, hidden], before the final norm."""
        num_tokens = hidden.shape[0]
        for cuda_layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            layer = cuda_layer.layer
            qkv = cuda_layer.qkv_out(hidden)  # [T, (H + 2 KVH) * D]
            q_end, k_end = cuda_layer.q_width, cuda_layer.q_width + cuda_layer.kv_width
            q = qkv[:, :q_end].view(num_tokens, layer.num_heads, layer.head_dim)
            k = qkv[:, q_end:k_end].view(num_tokens, layer.num_kv_heads, layer.head_dim)
            v = qkv[:, k_end:].view(num_tokens, layer.num_kv_heads, layer.head_dim)
            rotary_and_cache_(
                q, k, v, positions, self.cos, self.sin, self.rope_dim, self.is_neox, kv_cache,
                metadata.slot_mapping,
            )  # fmt: skip
            attn = self._attend(q, kv_cache, metadata).view(num_tokens, -1)  # [T, H * D]
            hidden = cuda_layer.attn_out(attn, hidden)
            hidden = cuda_layer.ffn(hidden)
        return hidden

    def final_norm(self, hidden: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The model's last RMSNorm: f32 [T, hidden] -> [T, hidden] in out_dtype."""
        return rms_norm(hidden, self.model.norm.weight, self.spec.rms_norm_eps, out_dtype)

    def _attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: DeviceAttentionMetadata
    ) -> torch.Tensor:
        if metadata.decode_only:
            return paged_decode_attention(
                q,
                kv_cache,
                metadata.block_table,
                metadata.seq_lens,
                self.scale,
                num_splits=metadata.decode_splits,
            )
        return paged_prefill_attention(
            q,
            kv_cache,
            metadata.block_table,
            metadata.seq_lens,
            metadata.query_start_loc,
            self.scale,
            metadata.max_query_len,
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states f32 [n, hidden] -> logits f32 [n, vocab]."""
        return self.head(hidden_states).to(torch.float32)

    def greedy_head_fits(self, num_rows: int) -> bool:
        """Whether norm_logits_and_argmax(..., greedy=True) takes the greedy head at this many rows."""
        return self.greedy_head is not None and num_rows <= GREEDY_HEAD_MAX_ROWS

    def norm_logits_and_argmax(
        self, hidden: torch.Tensor, feed: StepFeed | None = None, *, greedy: bool = False
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The last layer's output f32 [n, hidden] -> (logits f32 [n, vocab], their argmax int64 [n]): what
        the decode graphs end with. The final norm writes the head's input dtype (an F16 head's cast in
        its launch), and the widening of an F16 / BF16 head's output, greedy sampling's argmax and the
        next step's feed are one kernel (kernels/cuda/argmax.py).

        greedy=True (rows that only take the argmax) runs the greedy head where it fits
        (greedy_head_fits): the argmax from an int8 copy of the head plus the exact logits of the rows
        that could reach it, every other logit -inf, so these logits are not for sampling
        (kernels/cuda/greedy_head.py)."""
        normed = self.final_norm(hidden, self.head_input_dtype)
        if greedy and self.greedy_head_fits(normed.shape[0]):
            return cast_argmax_rows(self.greedy_head(normed), feed)  # type: ignore[misc]
        return cast_argmax_rows(self.head(normed), feed)


def _device_embedding(model: DecoderModel, device: torch.device) -> torch.Tensor:
    """The token table on the device: float files as stored (F16 rows widen exactly), block-quantized
    ones decoded once to f32 (the same values `dense_rows` gives the CPU path)."""
    table = model.embed_tokens.table
    dtype = _FLOAT_LAYOUTS.get(table.layout)
    if dtype is not None:
        return table.data.view(dtype).reshape(table.shape).to(device)
    all_rows = torch.arange(table.shape[0], dtype=torch.int64)
    return dense_rows(table, all_rows).to(device)


def _head_matrix(
    model: DecoderModel, device: torch.device, embedding: torch.Tensor
) -> PreparedLinear | torch.Tensor:
    """The LM head on the device: a prepared weight, or a float matrix [vocab, hidden]; a tied F16 head
    shares the embedding's device copy."""
    weight = model.lm_head.weight
    if isinstance(weight, PreparedLinear):
        return weight
    if model.spec.tie_word_embeddings and weight.dtype == embedding.dtype and weight.shape == embedding.shape:
        return embedding
    return weight.to(device)


def _greedy_head(matrix: PreparedLinear | torch.Tensor) -> GreedyHead | None:
    """The greedy head of a float matrix head (an int8 copy: vocab x hidden bytes more device memory),
    unless BITSERVE_CUDA_GREEDY_HEAD=0; None for a prepared (block-quantized) head, for a hidden size its
    kernels do not take (greedy_head.supports_hidden), and where the device has no memory left for the
    copy: it only speeds greedy steps up, so a model that fits without it still loads (with a warning)."""
    if isinstance(matrix, PreparedLinear) or matrix.dtype not in GREEDY_HEAD_DTYPES:
        return None
    if os.environ.get(GREEDY_HEAD_ENV, "1") == "0" or not supports_hidden(matrix.shape[1]):
        return None
    try:
        head = GreedyHead(matrix.contiguous())
    except torch.OutOfMemoryError:
        copy_mb = matrix.numel() / 1e6
        logger.warning(
            "no device memory for the greedy head's int8 copy of the LM head (%.0f MB): greedy steps run "
            "the full head (set %s=0 to skip the attempt)",
            copy_mb,
            GREEDY_HEAD_ENV,
        )
        return None
    logger.info("greedy decode steps take their argmax from an int8 copy of the %s head", matrix.dtype)
    return head


def _device_head(matrix: PreparedLinear | torch.Tensor):  # noqa: ANN202
    """(The LM head's callable on the device, the dtype its input is rounded to). The callable: hidden
    [n, hidden] (f32, or already that dtype) -> logits [n, vocab] in the head's dtype (f32 for a prepared
    dense weight)."""
    if isinstance(matrix, PreparedLinear):
        return matrix, torch.float32
    if matrix.dtype == torch.float32:
        return (lambda hidden: torch.nn.functional.linear(hidden, matrix)), torch.float32
    # F16 / BF16: activations rounded to the weight's dtype, fp32 accumulation, logits rounded to the
    # weight's dtype (as the CPU head); the caller widens them
    return (lambda hidden: torch.nn.functional.linear(hidden.to(matrix.dtype), matrix)), matrix.dtype
