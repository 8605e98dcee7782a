"""SchedulerOutput -> BatchInputs: the flat token batch, positions and paged-attention metadata."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from bitserve.core.scheduler_output import ScheduledRequest
from bitserve.kernels.attention_metadata import AttentionMetadata


@dataclass(frozen=True, slots=True)
class BatchInputs:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn: AttentionMetadata
    sample_indices: torch.Tensor  # [num_sampled] int64: rows of the batch whose logits are sampled
    sampled_request_ids: list[str]  # [num_sampled], same order (a speculative decode's id once per row)


def build_batch_inputs(requests: Sequence[ScheduledRequest], block_size: int) -> BatchInputs:
    """Lay out each scheduled request's tokens back to back (prefill chunks and decodes mixed).

    A speculative decode's 1 + k tokens (its last token and k drafts) become 1 + k one-token sequences
    over its one block table, sequence i at position start + i with seq_len start + i + 1, each sampled.
    That is what one sequence of 1 + k tokens computes, because every attention path writes the KV of all
    of a layer's tokens before any of them attends (PagedAttention in the module forward, the cpu
    backend's compiled step), and a step of one-token sequences stays on the decode kernels (the cpu
    backend's one-call step, kernels/cpu/fast_decode.py) instead of the module forward.
    """
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    seq_lens: list[int] = []
    query_start_loc = [0]
    sample_indices: list[int] = []
    sampled_request_ids: list[str] = []
    max_num_blocks = max((len(r.block_ids) for r in requests), default=0)
    num_seqs = sum(len(r.token_ids) if r.draft_token_ids else 1 for r in requests)
    block_table = torch.zeros((num_seqs, max(max_num_blocks, 1)), dtype=torch.int64)
    seq = 0
    for request in requests:
        num_new = len(request.token_ids)
        start = request.start_position
        input_ids.extend(request.token_ids)
        for position in range(start, start + num_new):
            positions.append(position)
            slots.append(request.block_ids[position // block_size] * block_size + position % block_size)
        table = torch.tensor(request.block_ids, dtype=torch.int64) if request.block_ids else None
        # (first position, tokens) of each sequence: the request, or its 1 + k speculative rows
        pieces = [(start + i, 1) for i in range(num_new)] if request.draft_token_ids else [(start, num_new)]
        for first, count in pieces:
            seq_lens.append(first + count)
            query_start_loc.append(query_start_loc[-1] + count)
            if table is not None:
                block_table[seq, : table.shape[0]] = table
            seq += 1
            if request.sample:
                sample_indices.append(query_start_loc[-1] - 1)
                sampled_request_ids.append(request.request_id)
    attn = AttentionMetadata.from_host(
        torch.tensor(slots, dtype=torch.int64), block_table, seq_lens, query_start_loc, block_size
    )
    return BatchInputs(
        input_ids=torch.tensor(input_ids, dtype=torch.int64),
        positions=torch.tensor(positions, dtype=torch.int64),
        attn=attn,
        sample_indices=torch.tensor(sample_indices, dtype=torch.int64),
        sampled_request_ids=sampled_request_ids,
    )
