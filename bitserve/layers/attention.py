"""Causal self-attention over a paged KV cache (and a plain full-sequence path for golden tests).

The KV cache of one layer is a tensor [2, num_blocks, block_size, num_kv_heads, head_dim]; a
sequence's tokens live in the blocks its block table lists, token p at slot
`block_table[p // block_size] * block_size + p % block_size`.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import nn

from bitserve.kernels.attention_metadata import AttentionMetadata, DecodeBatch
from bitserve.kernels.backend import FusedOps
from bitserve.layers import ggml_ops
from bitserve.layers.causal_attention import causal_attention


class PagedAttention(nn.Module):
    """Multi-head attention with grouped KV heads; q/k/v arrive already projected and rotated."""

    def __init__(
        self,
        num_heads: int,
        num_kv_heads: int,
        head_dim: int,
        fused: FusedOps | None = None,
        ggml_numerics: bool = False,
        *,
        scale: float = 0.0,
        sliding_window: int = 0,
    ) -> None:
        """scale: the softmax scale (0: 1 / sqrt(head_dim)); sliding_window: each token attends to the last
        that many positions, its own included (0: to its whole context)."""
        super().__init__()
        if sliding_window and ggml_numerics:
            raise ValueError("ggml numerics (bitnet.cpp's rounding) have no sliding-window attention")
        self.fused = fused  # the backend's paged decode kernel, used for f32 KV caches
        # bitnet.cpp on x86 (ggml without flash attention, llamafile sgemm on): an F16 KV cache, Q
        # rounded to F16, ggml's f32 summation orders, its polynomial exp and, in a one-token batch,
        # F16 softmax weights; layers/ggml_ops.py reproduces it bit for bit, per sequence
        self.ggml_numerics = ggml_numerics
        if num_heads % num_kv_heads:
            raise ValueError(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
        self.num_heads = num_heads
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.scale = scale or 1.0 / math.sqrt(head_dim)
        self.sliding_window = sliding_window

    def forward(
        self,
        q: torch.Tensor,
        k: torch.Tensor,
        v: torch.Tensor,
        kv_cache: torch.Tensor | None,
        metadata: AttentionMetadata | None,
    ) -> torch.Tensor:
        """q [num_tokens, num_heads, head_dim], k/v [num_tokens, num_kv_heads, head_dim]
        -> [num_tokens, num_heads * head_dim].

        With metadata None the batch is one sequence starting at position 0 and nothing is cached
        (the plain full-sequence forward used as the golden reference).
        """
        num_tokens = q.shape[0]
        one_token_step = num_tokens == 1  # ggml numerics: a one-token batch rounds its softmax weights
        if self.ggml_numerics:
            q, k, v = round_to_f16(q), round_to_f16(k), round_to_f16(v)
        if metadata is None or kv_cache is None:
            out = self._attend(q, k, v, num_context=num_tokens, one_token_step=one_token_step)
            return out.reshape(num_tokens, -1)
        schedule = metadata.host
        if schedule is None:
            raise ValueError("the module forward attends over a step laid out on the host (metadata.host)")
        self._write_kv(k, v, kv_cache, metadata.slot_mapping)
        out = torch.empty_like(q)  # [num_tokens, num_heads, head_dim]
        key_pages, value_pages = kv_cache[0], kv_cache[1]  # [num_blocks, block_size, kv_heads, head_dim]
        seq_ids: Sequence[int] = schedule.other_seq_ids
        if self.ggml_numerics:
            seq_ids = range(metadata.num_seqs)  # every sequence on its own, decodes included
        elif schedule.decode is not None:
            decode = schedule.decode
            if self.fused is not None and kv_cache.dtype == torch.float32:
                # the window in the kernel: the cpu backend's compiled step calls the same one (bit-equal)
                out[decode.token_rows] = self.fused.paged_decode_attention(
                    q[decode.token_rows],
                    key_pages,
                    value_pages,
                    decode.block_table,
                    decode.seq_lens,
                    self.scale,
                    self.sliding_window,
                )
            else:
                out[decode.token_rows] = self._attend_decodes(q, key_pages, value_pages, decode)
        for seq_idx in seq_ids:
            seq_len = schedule.seq_lens[seq_idx]
            start, end = schedule.query_start_loc[seq_idx], schedule.query_start_loc[seq_idx + 1]
            if seq_len == end - start:
                # NOTE: a fresh prompt's whole context is this step's k / v: attend over them as the
                # cache holds them (cast to its dtype) instead of gathering the pages just written
                keys, values = k[start:end].to(kv_cache.dtype), v[start:end].to(kv_cache.dtype)
            else:
                keys, values = self._gather_context(key_pages, value_pages, metadata, seq_idx)
            out[start:end] = self._attend(
                q[start:end], keys, values, num_context=seq_len, one_token_step=one_token_step
            )
        return out.reshape(num_tokens, -1)

    @staticmethod
    def _gather_context(
        key_pages: torch.Tensor, value_pages: torch.Tensor, metadata: AttentionMetadata, seq_idx: int
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The cached keys and values of sequence seq_idx: [seq_len, kv_heads, head_dim] each (a copy)."""
        seq_len = metadata.host.seq_lens[seq_idx]  # type: ignore[union-attr]  # forward() checked host
        num_blocks = -(-seq_len // metadata.block_size)
        block_ids = metadata.block_table[seq_idx, :num_blocks]
        keys = key_pages[block_ids].flatten(0, 1)[:seq_len]  # [seq_len, kv_heads, head_dim]
        values = value_pages[block_ids].flatten(0, 1)[:seq_len]
        return keys, values

    def _attend_decodes(
        self, q: torch.Tensor, key_pages: torch.Tensor, value_pages: torch.Tensor, batch: DecodeBatch
    ) -> torch.Tensor:
        """One query per sequence, all decodes at once -> [num_decodes, num_heads, head_dim]."""
        num_decodes = batch.token_rows.shape[0]
        group = self.num_heads // self.num_kv_heads
        # [num_decodes, max_keys, kv_heads, head_dim], padded past each sequence's length
        keys = key_pages[batch.block_table].flatten(1, 2).to(torch.float32)
        values = value_pages[batch.block_table].flatten(1, 2).to(torch.float32)
        queries = q[batch.token_rows].view(num_decodes, self.num_kv_heads, group, self.head_dim)
        scores = torch.einsum("nkgd,nlkd->nkgl", queries, keys) * self.scale  # [n, kv_heads, group, max_keys]
        key_mask = batch.key_mask  # [num_decodes, max_keys]
        if self.sliding_window:  # only the last sliding_window keys of each sequence
            key_ids = torch.arange(key_mask.shape[1], device=key_mask.device)
            key_mask = key_mask & (key_ids[None, :] >= batch.seq_lens[:, None] - self.sliding_window)
        scores = scores.masked_fill(~key_mask[:, None, None, :], float("-inf"))
        out = torch.einsum("nkgl,nlkd->nkgd", torch.softmax(scores, dim=-1), values)
        return out.reshape(num_decodes, self.num_heads, self.head_dim)

    @staticmethod
    def _write_kv(
        k: torch.Tensor, v: torch.Tensor, kv_cache: torch.Tensor, slot_mapping: torch.Tensor
    ) -> None:
        # view the pages as a flat slot array: [num_blocks * block_size, kv_heads, head_dim]
        kv_cache[0].flatten(0, 1).index_copy_(0, slot_mapping, k.to(kv_cache.dtype))
        kv_cache[1].flatten(0, 1).index_copy_(0, slot_mapping, v.to(kv_cache.dtype))

    def _attend(
        self,
        q: torch.Tensor,
        keys: torch.Tensor,
        values: torch.Tensor,
        num_context: int,
        one_token_step: bool = False,
    ) -> torch.Tensor:
        """Queries are the last q.shape[0] positions of a context of num_context tokens (causal).

        one_token_step: the whole step holds one token (ggml numerics then round the softmax weights)."""
        keys = keys.to(torch.float32)
        values = values.to(torch.float32)
        if not self.ggml_numerics:
            # [num_queries, num_heads, head_dim]
            return causal_attention(q, keys, values, self.scale, self.sliding_window)
        group = self.num_heads // self.num_kv_heads
        if group > 1:
            keys = keys.repeat_interleave(group, dim=1)  # [num_context, num_heads, head_dim]
            values = values.repeat_interleave(group, dim=1)
        q_t, k_t, v_t = q.transpose(0, 1), keys.transpose(0, 1), values.transpose(0, 1)  # [heads, len, dim]
        scale = ggml_ops.kq_scale(self.head_dim)
        out = ggml_ops.attention(q_t, k_t, v_t, num_context, scale, one_token_step)
        return out.transpose(0, 1)  # [num_queries, num_heads, head_dim]


def round_to_f16(x: torch.Tensor) -> torch.Tensor:
    """x rounded to the nearest F16 (ties to even), returned in its own dtype: what ggml keeps."""
    return x.to(torch.float16).to(x.dtype)
