"""The CUDA backend's compiled forward (`CudaBackend.compile_decoder`): a model's DecoderPlan
(kernels/plan.py) run with the backend's fused Triton kernels.

`CudaDecoder` runs the layers with fewer, fused launches (what decides decode speed at batch 1, where
each layer's weights are 1.6-8.8 MB; kernels/cuda/decoder_layer.py chooses each projection's path):
- a ternary projection takes its RMSNorm (or the gated activation and sub-norm before Wdown) and the
  int8 activation quantization in one `norm_quantize` launch, then one `ternary_linear` launch that also
  adds the residual: 2 launches where the generic layers make ~12; a ternary gate/up (rows interleaved
  at load) writes act(gate) * up from its own epilogue, so Wdown's norm_quantize reads half as much;
- RoPE on q and k and the KV-cache write are one launch (`rotary_and_cache_`), attention one more
  (`paged_decode_attention` for a decode-only step, `paged_prefill_attention` otherwise).
Q4_0 / Q4_1 / Q8_0 projections (SmolLM2) take their RMSNorm, the gated activation before Wdown and the
residual into one `block_gemv` launch (CudaBlockLinear.run_fused) on steps of up to 4 tokens; dense float
projections run a Triton RMSNorm and cuBLAS; anything else the projection's own call.
Gemma 3's parts: embeddings times plan.embedding_scale wherever tokens are embedded (forward, and the
decode graphs' first kernel, decode_inputs.py), post-norms (decoder_layer.py), each layer's RoPE tables
and sliding window (the attention kernels' `window`: older KV blocks are not read) and the logit
soft-cap; MiniCPM's residual / logit scales are refused at load.
Numerics: ternary linears are bit-identical to the reference backend; norms, RoPE and attention are fp32
with the GPU's summation order (tokens equal the reference's on the golden tests).

The forward has no host sync and allocates only from its inputs' shapes, so the runner can capture a
decode step in a CUDA graph (runner/cuda_graphs.py).
"""

from __future__ import annotations

import logging

import torch

from bitserve.errors import UnsupportedModel
from bitserve.kernels.attention_metadata import AttentionMetadata
from bitserve.kernels.backend import PreparedLinear
from bitserve.kernels.cuda.argmax import StepFeed, cast_argmax_rows
from bitserve.kernels.cuda.decoder_layer import CudaLayer
from bitserve.kernels.cuda.elementwise import rms_norm
from bitserve.kernels.cuda.greedy_head import MAX_ROWS as GREEDY_HEAD_MAX_ROWS
from bitserve.kernels.cuda.greedy_head import OUTPUT_STEP as GREEDY_HEAD_DTYPES
from bitserve.kernels.cuda.greedy_head import GreedyHead, supports_hidden
from bitserve.kernels.cuda.paged_attention import paged_decode_attention
from bitserve.kernels.cuda.paged_prefill import paged_prefill_attention
from bitserve.kernels.cuda.rotary_cache import rotary_and_cache_
from bitserve.kernels.packed import Layout, PackedWeight
from bitserve.kernels.plan import DecoderPlan
from bitserve.kernels.reference.dequant import dense_rows
from bitserve.kernels.tuning import DEFAULT_TUNING, KernelTuning

logger = logging.getLogger(__name__)

_FLOAT_LAYOUTS = {Layout.F16: torch.float16, Layout.BF16: torch.bfloat16, Layout.F32: torch.float32}


class CudaDecoder:
    """The model's forward contract on the device, with AttentionMetadata."""

    def __init__(
        self, plan: DecoderPlan, device: torch.device, tuning: KernelTuning = DEFAULT_TUNING
    ) -> None:
        _refuse_unimplemented(plan)
        self.device = device
        self.num_heads, self.num_kv_heads, self.head_dim = plan.num_heads, plan.num_kv_heads, plan.head_dim
        self.eps = plan.rms_norm_eps
        heads = (plan.num_heads, plan.num_kv_heads, plan.head_dim)
        options = (self.eps, tuning)
        self.layers = [CudaLayer(layer, heads, plan.activation, device, options) for layer in plan.layers]
        self.decode_tile = tuning.cuda_decode_tile  # sweeps' decode-attention tile (None in use)
        self.final_norm_weight = plan.final_norm.to(device)
        self.embedding = _device_embedding(plan.embedding, device)  # [vocab, hidden], f32 / f16 / bf16
        # logits in the head's dtype; a float matrix's input is rounded to its dtype (head_input_dtype)
        self.head_matrix = _head_matrix(plan, device, self.embedding)
        self.head, self.head_input_dtype = _device_head(self.head_matrix)
        # greedy rows of small decode steps: the argmax from an int8 copy of a float head; built by the
        # runner (enable_greedy_head) where its launch-ahead graphs use it
        self.greedy_head: GreedyHead | None = None
        rope = plan.rope
        self.cos, self.sin = rope.cos.to(device), rope.sin.to(device)  # [max_pos, rope_dim / 2]
        self.rope_dim, self.is_neox = rope.rope_dim, rope.is_neox
        # each layer's (cos, sin, rope_dim, is_neox): Gemma's sliding layers have tables of their own
        self.layer_ropes = _layer_ropes(plan, device, (self.cos, self.sin))
        self.scale = plan.attn_scale
        self.embedding_scale = plan.embedding_scale  # Gemma: sqrt(hidden); 1.0: no multiply
        self.softcap = plan.final_logit_softcap  # > 0: logits = cap * tanh(logits / cap)
        self.logit_scale = plan.logit_scale  # MiniCPM: logits / logit_scale, before the cap

    def enable_greedy_head(self) -> None:
        """Build the greedy head (an int8 copy of a float head) where it applies (_greedy_head)."""
        if self.greedy_head is None:
            self.greedy_head = _greedy_head(self.head_matrix)

    def applies(
        self, num_tokens: int, kv_caches: list[torch.Tensor] | None, metadata: AttentionMetadata | None
    ) -> bool:
        """Every step laid out for the device (the CUDA runner's: metadata without a host schedule)."""
        return kv_caches is not None and metadata is not None and metadata.host is None

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """input_ids, positions int64 [T] -> hidden_states f32 [T, hidden] (final norm applied)."""
        hidden = self.embedding[input_ids].to(torch.float32)  # [T, hidden]
        if self.embedding_scale != 1.0:  # the module forward's f32 row * f32(scale)
            hidden = hidden * self.embedding_scale
        return self.final_norm(self.run_layers(hidden, positions, kv_caches, metadata))

    __call__ = forward

    def forward_sequence(
        self, input_ids: torch.Tensor, kv_dtype: torch.dtype, block_size: int
    ) -> torch.Tensor:
        """One sequence from position 0 (embeddings): input_ids int64 [T] on the device -> hidden_states
        f32 [T, hidden] (final norm applied), through a temporary paged cache of ceil(T / block_size)
        blocks per layer, freed on return."""
        num_tokens, device = input_ids.shape[0], input_ids.device
        num_blocks = -(-num_tokens // block_size)
        shape = (2, num_blocks, block_size, self.num_kv_heads, self.head_dim)
        caches = [torch.zeros(shape, dtype=kv_dtype, device=device) for _ in self.layers]
        metadata = AttentionMetadata.one_sequence(
            torch.arange(num_tokens, dtype=torch.int64, device=device),
            torch.arange(num_blocks, dtype=torch.int32, device=device).unsqueeze(0),
            num_tokens,
            block_size,
        )
        positions = torch.arange(num_tokens, dtype=torch.int64, device=device)
        return self.forward(input_ids, positions, caches, metadata)

    def run_layers(
        self,
        hidden: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        metadata: AttentionMetadata,
    ) -> torch.Tensor:
        """hidden f32 [T, hidden] (the tokens' embeddings), positions int64 [T] -> the last layer's output
        f32 [T, hidden], before the final norm."""
        num_tokens = hidden.shape[0]
        layers = zip(self.layers, self.layer_ropes, kv_caches, strict=True)
        for cuda_layer, (cos, sin, rope_dim, is_neox), kv_cache in layers:
            qkv = cuda_layer.qkv_out(hidden)  # [T, (H + 2 KVH) * D]
            q_end, k_end = cuda_layer.q_width, cuda_layer.q_width + cuda_layer.kv_width
            q = qkv[:, :q_end].view(num_tokens, self.num_heads, self.head_dim)
            k = qkv[:, q_end:k_end].view(num_tokens, self.num_kv_heads, self.head_dim)
            v = qkv[:, k_end:].view(num_tokens, self.num_kv_heads, self.head_dim)
            q, k = cuda_layer.normed_heads(q, k)
            rotary_and_cache_(
                q, k, v, positions, cos, sin, rope_dim, is_neox, kv_cache, metadata.slot_mapping
            )  # fmt: skip
            attn = self._attend(q, kv_cache, metadata, cuda_layer.window).view(num_tokens, -1)  # [T, H * D]
            hidden = cuda_layer.attn_out(attn, hidden)
            hidden = cuda_layer.ffn(hidden)
        return hidden

    def final_norm(self, hidden: torch.Tensor, out_dtype: torch.dtype = torch.float32) -> torch.Tensor:
        """The model's last RMSNorm: f32 [T, hidden] -> [T, hidden] in out_dtype."""
        return rms_norm(hidden, self.final_norm_weight, self.eps, out_dtype)

    def _attend(
        self, q: torch.Tensor, kv_cache: torch.Tensor, metadata: AttentionMetadata, window: int
    ) -> torch.Tensor:
        """q f32 [T, H, D] over the layer's cache -> f32 [T, H, D]; window > 0: a sliding layer's."""
        if metadata.decode_only:
            return paged_decode_attention(
                q,
                kv_cache,
                metadata.block_table,
                metadata.seq_lens,
                self.scale,
                tile=self.decode_tile,
                window=window,
            )
        return paged_prefill_attention(
            q,
            kv_cache,
            metadata.block_table,
            metadata.seq_lens,
            metadata.query_start_loc,
            self.scale,
            metadata.max_query_len,
            window=window,
        )

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states f32 [n, hidden] -> logits f32 [n, vocab] (soft-capped where the model caps)."""
        return self._capped(self.head(hidden_states).to(torch.float32))

    def _capped(self, logits: torch.Tensor) -> torch.Tensor:
        """f32 logits [n, vocab] -> logits / logit_scale, then cap * tanh(logits / cap) (the module
        forward's expressions, in its order) where the model scales or soft-caps them; else the same
        tensor."""
        if self.logit_scale != 1.0:
            logits = logits / self.logit_scale
        return logits if not self.softcap else torch.tanh(logits / self.softcap) * self.softcap

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
        (kernels/cuda/greedy_head.py). Those rows stay uncapped (capping is monotonic: the same argmax,
        up to two logits that the cap rounds to one value); the full head's logits are soft-capped, in
        f32, before the argmax, which so takes the module forward's capped logits."""
        normed = self.final_norm(hidden, self.head_input_dtype)
        if greedy and self.greedy_head_fits(normed.shape[0]):
            return cast_argmax_rows(self.greedy_head(normed), feed)  # type: ignore[misc]
        logits = self.head(normed)  # [n, vocab] in the head's dtype
        if self.softcap or self.logit_scale != 1.0:
            logits = self._capped(logits.to(torch.float32))
        return cast_argmax_rows(logits, feed)


def _refuse_unimplemented(plan: DecoderPlan) -> None:
    """UnsupportedModel, at load, for what of a plan this forward does not compute: bitnet.cpp's CPU
    rounding."""
    if plan.ggml_numerics:
        raise UnsupportedModel(
            "the bitnetcpp linear mode (bitnet.cpp's CPU rounding) is not implemented on CUDA",
            hint="use --linear-mode bitnet on a GPU (the same ternary linears, bit for bit)",
        )


def _layer_ropes(
    plan: DecoderPlan, device: torch.device, main: tuple[torch.Tensor, torch.Tensor]
) -> list[tuple[torch.Tensor, torch.Tensor, int, bool]]:
    """Each layer's RoPE (cos, sin f32 [max_pos, rope_dim / 2] on the device, rope_dim, is_neox):
    plan.layer_rope's tables, the model's own (`main`, already on the device) or the sliding layers'
    (moved once, shared by those layers)."""
    sliding = plan.sliding_rope
    sliding_tables = None if sliding is None else (sliding.cos.to(device), sliding.sin.to(device))
    ropes = []
    for layer in plan.layers:
        rope = plan.layer_rope(layer)
        cos, sin = sliding_tables if sliding_tables is not None and rope is sliding else main
        ropes.append((cos, sin, rope.rope_dim, rope.is_neox))
    return ropes


def _device_embedding(table: PackedWeight, device: torch.device) -> torch.Tensor:
    """The token table on the device: float files as stored (F16 rows widen exactly), block-quantized
    ones decoded once to f32 (the same values `dense_rows` gives the CPU path)."""
    dtype = _FLOAT_LAYOUTS.get(table.layout)
    if dtype is not None:
        return table.data.view(dtype).reshape(table.shape).to(device)
    all_rows = torch.arange(table.shape[0], dtype=torch.int64)
    return dense_rows(table, all_rows).to(device)


def _head_matrix(
    plan: DecoderPlan, device: torch.device, embedding: torch.Tensor
) -> PreparedLinear | torch.Tensor:
    """The LM head on the device: a prepared weight, or a float matrix [vocab, hidden]; a tied F16 head
    shares the embedding's device copy."""
    weight = plan.head
    if isinstance(weight, PreparedLinear):
        return weight
    if plan.tie_word_embeddings and weight.dtype == embedding.dtype and weight.shape == embedding.shape:
        return embedding
    return weight.to(device)


def _greedy_head(matrix: PreparedLinear | torch.Tensor) -> GreedyHead | None:
    """The greedy head of a float matrix head (an int8 copy: vocab x hidden bytes more device memory),
    unless BITSERVE_CUDA_GREEDY_HEAD=0; None for a prepared (block-quantized) head, for a hidden size its
    kernels do not take (greedy_head.supports_hidden), and where the device has no memory left for the
    copy: it only speeds greedy steps up, so a model that fits without it still loads (with a warning)."""
    if isinstance(matrix, PreparedLinear) or matrix.dtype not in GREEDY_HEAD_DTYPES:
        return None
    if not supports_hidden(matrix.shape[1]):
        return None
    try:
        head = GreedyHead(matrix.contiguous())
    except torch.OutOfMemoryError:
        copy_mb = matrix.numel() / 1e6
        logger.warning(
            "no device memory for the greedy head's int8 copy of the LM head (%.0f MB): greedy steps run "
            "the full head (set cuda_greedy_head off, BITSERVE_CUDA_GREEDY_HEAD=0, to skip the attempt)",
            copy_mb,
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
