"""The attention metadata of a step: where its tokens go in the paged KV cache and what each sequence
attends to. One type, `AttentionMetadata`, for every backend and forward: the tensors every attention
kernel reads (on the host for the module forward and the cpu backend's compiled step, on the device for
the cuda backend's compiled forward and its CUDA graphs), plus, where the step was laid out on the host,
a `HostSchedule`: the same lengths as Python ints and the decodes gathered once, so the host-side
attention loop needs no device sync. `to_device` moves one to the device, dropping the host schedule.

Plain frozen records: imported by layers/, kernels/ and runner/; imports only torch.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class DecodeBatch:
    """The step's decode rows (one query token each) gathered once, reused by every layer (host)."""

    token_rows: torch.Tensor  # [num_decodes] int64: rows of the flat batch
    block_table: torch.Tensor  # [num_decodes, max_num_blocks] int64
    key_mask: torch.Tensor  # [num_decodes, max_num_blocks * block_size] bool: True where a key exists
    seq_lens: torch.Tensor  # [num_decodes] int64: keys of each sequence (this step's included)


@dataclass(frozen=True, slots=True)
class HostSchedule:
    """The step's layout as host values: what a host-side attention loop reads without a sync."""

    seq_lens: tuple[int, ...]  # [S]
    query_start_loc: tuple[int, ...]  # [S + 1]
    decode: DecodeBatch | None  # the decodes batched together; None: every sequence attends alone
    other_seq_ids: tuple[int, ...]  # the sequences not in `decode` (prefill chunks)


@dataclass(frozen=True, slots=True)
class AttentionMetadata:
    """One step's paged-attention inputs (S sequences, T tokens).

    Tokens of sequence s are rows query_start_loc[s]:query_start_loc[s+1] of the flat batch and sit at
    the last positions of its context, which is seq_lens[s] tokens long after this step. The tensors
    live where the step runs; integer widths are the kernels' (int64 tables on the host, int32 on CUDA).
    """

    slot_mapping: torch.Tensor  # [T] int64: cache slot of each token (-1: write no KV)
    block_table: torch.Tensor  # [S, max_blocks]: the KV blocks of each sequence, in order
    seq_lens: torch.Tensor  # [S]
    query_start_loc: torch.Tensor  # [S + 1]
    block_size: int
    max_query_len: int
    host: HostSchedule | None = None  # None where the step was laid out on the device (CUDA graphs)

    @property
    def num_seqs(self) -> int:
        return self.seq_lens.shape[0]

    @property
    def decode_only(self) -> bool:
        """Every sequence has one query token (the decode kernels run)."""
        return self.max_query_len == 1

    @classmethod
    def from_host(
        cls,
        slot_mapping: torch.Tensor,
        block_table: torch.Tensor,
        seq_lens: Sequence[int],
        query_start_loc: Sequence[int],
        block_size: int,
        *,
        batch_decodes: bool = True,
    ) -> AttentionMetadata:
        """A step laid out on the host: block_table int64 [S, max_blocks], lengths as ints. With
        batch_decodes the one-token sequences are gathered into one DecodeBatch."""
        counts = [query_start_loc[i + 1] - query_start_loc[i] for i in range(len(seq_lens))]
        decode_ids = [i for i, count in enumerate(counts) if count == 1] if batch_decodes else []
        batched = set(decode_ids)
        decode = (
            _decode_batch(decode_ids, block_table, seq_lens, query_start_loc, block_size)
            if decode_ids
            else None
        )
        schedule = HostSchedule(
            seq_lens=tuple(seq_lens),
            query_start_loc=tuple(query_start_loc),
            decode=decode,
            other_seq_ids=tuple(i for i in range(len(seq_lens)) if i not in batched),
        )
        return cls(
            slot_mapping=slot_mapping,
            block_table=block_table,
            seq_lens=torch.tensor(list(seq_lens), dtype=torch.int64),
            query_start_loc=torch.tensor(list(query_start_loc), dtype=torch.int64),
            block_size=block_size,
            max_query_len=max(counts, default=0),
            host=schedule,
        )

    @classmethod
    def one_sequence(
        cls, slot_mapping: torch.Tensor, block_table: torch.Tensor, seq_len: int, block_size: int
    ) -> AttentionMetadata:
        """One sequence of seq_len tokens whose last slot_mapping.shape[0] tokens are this step's, on
        slot_mapping's device: block_table [1, blocks] int32, slot_mapping [T] int64."""
        num_new, device = slot_mapping.shape[0], slot_mapping.device
        return cls(
            slot_mapping=slot_mapping,
            block_table=block_table,
            seq_lens=torch.tensor([seq_len], dtype=torch.int32, device=device),
            query_start_loc=torch.tensor([0, num_new], dtype=torch.int32, device=device),
            block_size=block_size,
            max_query_len=num_new,
        )

    def to_device(self, send: Callable[[torch.Tensor], torch.Tensor]) -> AttentionMetadata:
        """The same step on the device, in the CUDA kernels' widths: `send` copies one host tensor
        there (the runner's pinned, non-blocking copy). The host schedule stays behind."""
        return AttentionMetadata(
            slot_mapping=send(self.slot_mapping),
            block_table=send(self.block_table.to(torch.int32)),
            seq_lens=send(self.seq_lens.to(torch.int32)),
            query_start_loc=send(self.query_start_loc.to(torch.int32)),
            block_size=self.block_size,
            max_query_len=self.max_query_len,
        )


def _decode_batch(
    seq_ids: list[int],
    block_table: torch.Tensor,
    seq_lens: Sequence[int],
    query_start_loc: Sequence[int],
    block_size: int,
) -> DecodeBatch:
    """Precompute the padded gather indices and key mask of the decode sequences `seq_ids`."""
    max_len = max(seq_lens[i] for i in seq_ids)
    num_blocks = -(-max_len // block_size)
    positions = torch.arange(num_blocks * block_size).unsqueeze(0)  # [1, max_keys]
    lengths = torch.tensor([seq_lens[i] for i in seq_ids]).unsqueeze(1)  # [num_decodes, 1]
    return DecodeBatch(
        token_rows=torch.tensor([query_start_loc[i] for i in seq_ids], dtype=torch.int64),
        block_table=block_table[seq_ids, :num_blocks],
        key_mask=positions < lengths,
        seq_lens=lengths.reshape(-1).to(torch.int64),
    )
