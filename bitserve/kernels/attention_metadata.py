"""The attention metadata of a step: where its tokens go in the paged KV cache and what each sequence
attends to. One module for both forms: `AttentionMetadata` (host tensors and lists: the module forward
and the cpu backend's compiled decode step) and `DeviceAttentionMetadata` (the same facts as device
tensors, built once per step for the CUDA backend's compiled forward and its CUDA graphs).

Plain frozen records: imported by layers/, kernels/ and runner/; imports only torch.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """Where this step's tokens go in the cache, and which cached tokens each sequence attends to.

    Tokens of sequence s are rows query_start_loc[s]:query_start_loc[s+1] of the flat batch and sit
    at the last positions of its context, which is seq_lens[s] tokens long after this step.
    Host-side lists mirror the small tensors so the attention loop needs no device sync.
    """

    slot_mapping: torch.Tensor  # [num_tokens] int64
    block_table: torch.Tensor  # [num_seqs, max_num_blocks] int64
    seq_lens: list[int]  # [num_seqs]
    query_start_loc: list[int]  # [num_seqs + 1]
    block_size: int
    # Sequences with one query token (decodes) attend together in one padded batch:
    decode: DecodeBatch | None = None
    other_seq_ids: tuple[int, ...] | None = None  # the remaining sequences (prefill chunks); None = all

    @property
    def num_seqs(self) -> int:
        return len(self.seq_lens)


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """Decode rows gathered once per step, reused by every layer."""

    token_rows: torch.Tensor  # [num_decodes] int64: rows of the flat batch
    block_table: torch.Tensor  # [num_decodes, max_num_blocks] int64
    key_mask: torch.Tensor  # [num_decodes, max_num_blocks * block_size] bool: True where a key exists
    seq_lens: torch.Tensor  # [num_decodes] int64: keys of each sequence (this step's included)


def make_decode_batch(
    seq_ids: list[int],
    metadata_block_table: torch.Tensor,
    seq_lens: list[int],
    query_start_loc: list[int],
    block_size: int,
) -> DecodeBatch:
    """Precompute the padded gather indices and key mask of the decode sequences `seq_ids`."""
    max_len = max(seq_lens[i] for i in seq_ids)
    num_blocks = -(-max_len // block_size)
    positions = torch.arange(num_blocks * block_size).unsqueeze(0)  # [1, max_keys]
    lengths = torch.tensor([seq_lens[i] for i in seq_ids]).unsqueeze(1)  # [num_decodes, 1]
    return DecodeBatch(
        token_rows=torch.tensor([query_start_loc[i] for i in seq_ids], dtype=torch.int64),
        block_table=metadata_block_table[seq_ids, :num_blocks],
        key_mask=positions < lengths,
        seq_lens=lengths.reshape(-1).to(torch.int64),
    )


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

    @classmethod
    def one_sequence(
        cls, slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_len: int
    ) -> DeviceAttentionMetadata:
        """One sequence of seq_len tokens whose last slot_mapping.shape[0] tokens are this step's (all on
        its device): block_table [1, blocks] int32, slot_mapping [T] int64 (-1: write no KV)."""
        num_new, device = slot_mapping.shape[0], slot_mapping.device
        return cls(
            slot_mapping=slot_mapping,
            block_table=block_table,
            seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=device),
            query_start_loc=torch.tensor([0, num_new], dtype=torch.int32, device=device),
            max_query_len=num_new,
            decode_only=num_new == 1,
        )
