"""Decode-step CUDA graphs, one per (batch-size bucket, context bucket).

At batch 1 a 2B ternary decode step is ~300 short kernels; launched from Python they cost more than
the whole memory traffic of the step. A graph replays them with one launch. Batch buckets are powers of
two (1, 2, 4, ..., 256, capped by max_num_seqs); context buckets are block-table widths of 256 and 1024
keys and the full max_model_len. A short-context bucket runs decode attention in one split (the
flash-decoding split rule reads the table width, not the lengths, which a graph cannot see), saving the
split reduction; longer ones keep the kernel's own rule.

Each graph reads static input buffers and writes static logits (f32) and each row's argmax (greedy
sampling's token, kernels/cuda/argmax.py, in the same kernel that widens an F16 head's logits): a step of
n sequences copies its inputs
(one pinned int64 block and the int32 block table, two non-blocking copies) into the first n rows of the
smallest fitting bucket, pads the rest with a harmless row (token 0 at position 0, one key, writing to
the scratch KV slot), replays, and reads the first n rows of its outputs. All graphs share one pool.

The input buffers are flat, and a bucket's graph reads a contiguous prefix of them: [4, size] int64
(ids, positions, slots, seq_lens) and [size, width] int32 (the table). So every host -> device copy is one
plain DMA from pinned memory. (Row slices of [4, 256] / [256, width_max] tensors were strided: torch
copied them through a pageable temporary and a scatter kernel, one more kernel and gap a step. Measured
alone on an H200 the change is inside the noise, 1.036 / 1.036 -> 1.043 / 1.030 ms a 2B batch-1 step:
benchmarks/RESULTS.md, 2026-11-29.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

import torch

from bitserve.core.scheduler_output import ScheduledRequest
from bitserve.models.cuda_decoder import CudaDecoder, DeviceAttentionMetadata
from bitserve.runner.pinned_pair import PinnedPair

logger = logging.getLogger(__name__)

MAX_BUCKET = 256
CONTEXT_BUCKETS = (256, 1024)  # keys; the last bucket is always max_model_len
SINGLE_SPLIT_KEYS = 256  # contexts this short attend in one split
# rows of the packed int64 input block
INPUT_IDS, POSITIONS, SLOTS, SEQ_LENS = range(4)


def bucket_sizes(max_batch: int) -> list[int]:
    """Powers of two from 1 up to the first one >= min(max_batch, MAX_BUCKET)."""
    limit = min(max(max_batch, 1), MAX_BUCKET)
    sizes = [1]
    while sizes[-1] < limit:
        sizes.append(sizes[-1] * 2)
    return sizes


def context_widths(max_blocks_per_seq: int, block_size: int) -> list[int]:
    """Block-table widths of the context buckets, ascending, the last one max_blocks_per_seq."""
    widths = {min(-(-keys // block_size), max_blocks_per_seq) for keys in CONTEXT_BUCKETS}
    return sorted(widths | {max_blocks_per_seq})


class DecodeGraphs:
    def __init__(
        self,
        decoder: CudaDecoder,
        kv_caches: list[torch.Tensor],
        *,
        max_batch: int,
        max_blocks_per_seq: int,
        scratch_block: int,
        device: torch.device,
    ) -> None:
        self.decoder = decoder
        self.kv_caches = kv_caches
        self.block_size = kv_caches[0].shape[2]  # [2, blocks, block_size, kv_heads, head_dim]
        self.sizes = bucket_sizes(max_batch)
        self.widths = context_widths(max_blocks_per_seq, self.block_size)
        self.scratch_block = scratch_block  # a KV page no sequence owns: padded rows write there
        self.scratch_slot = scratch_block * self.block_size
        # a harmless row (ids, positions, slots, seq_lens): token 0 at position 0, one key, in the scratch
        self.padding_row = (0, 0, self.scratch_slot, 1)
        size, width = self.sizes[-1], self.widths[-1]
        # static inputs on the device (see the module docstring: bucket views are contiguous prefixes)
        self._inputs = torch.zeros(4 * size, dtype=torch.int64, device=device)
        self._table = torch.full((size * width,), scratch_block, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        # Two pinned staging buffers for each, used in turn: a launch ahead (runner/cuda_lookahead.py) may
        # still be copying from one when the next launch fills the other; each buffer's event marks its
        # copy done before the host writes it again.
        self._host_inputs = PinnedPair(lambda: torch.empty(4 * size, dtype=torch.int64))
        self._host_table = PinnedPair(lambda: torch.empty(size * width, dtype=torch.int32))
        self._last: tuple[int, int] | None = None  # (size, width) of the last launch
        self._table_blocks: list[int] = []  # each row's blocks in the device table, as last written
        self._table_host = torch.empty(0, 0, dtype=torch.int32)  # the last launch's table [size, width]
        self.graphs: dict[tuple[int, int], torch.cuda.CUDAGraph] = {}
        self.logits: dict[tuple[int, int], torch.Tensor] = {}  # [size, vocab] f32
        self.token_ids: dict[tuple[int, int], torch.Tensor] = {}  # [size] int64: each row's argmax
        self.pool = None

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def inputs(self, size: int) -> torch.Tensor:
        """The size bucket's inputs on the device: int64 [4, size] (ids, positions, slots, seq_lens)."""
        return self._inputs[: 4 * size].view(4, size)

    def block_table(self, size: int, width: int) -> torch.Tensor:
        """The (size, width) bucket's block table on the device: int32 [size, width]."""
        return self._table[: size * width].view(size, width)

    def _metadata(self, size: int, width: int) -> DeviceAttentionMetadata:
        inputs = self.inputs(size)
        return DeviceAttentionMetadata(
            slot_mapping=inputs[SLOTS],
            block_table=self.block_table(size, width),
            seq_lens=inputs[SEQ_LENS],
            query_start_loc=self.query_start_loc[: size + 1],
            max_query_len=1,
            decode_only=True,
            decode_splits=1 if width * self.block_size <= SINGLE_SPLIT_KEYS else None,
        )

    def _step(self, size: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        ids, positions = self.inputs(size)[INPUT_IDS], self.inputs(size)[POSITIONS]
        hidden = self.decoder(ids, positions, self.kv_caches, self._metadata(size, width))
        return self.decoder.logits_and_argmax(hidden)  # f32 [size, vocab], int64 [size]

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Warm up (Triton compiles each kernel specialization on first use) and capture every bucket,
        largest first so the smaller graphs reuse its pool."""
        started = time.perf_counter()
        for size in reversed(self.sizes):
            for width in reversed(self.widths):
                self._pad(size, width)  # the buckets share memory: this one's padding, harmless rows
                self._step(size, width)  # eager warm-up: compilation happens outside the capture
                torch.cuda.synchronize()
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool):
                    self.logits[size, width], self.token_ids[size, width] = self._step(size, width)
                if self.pool is None:
                    self.pool = graph.pool()
                self.graphs[size, width] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured decode CUDA graphs for batch sizes %s x table widths %s in %.1f s",
            self.sizes,
            self.widths,
            time.perf_counter() - started,
        )

    def run(self, requests: Sequence[ScheduledRequest]) -> torch.Tensor:
        """A decode-only step of len(requests) sequences -> logits f32 [len(requests), vocab] (a view of
        the bucket's static output: read it before the next step)."""
        num = len(requests)
        size = next(s for s in self.sizes if s >= num)
        needed = max(len(request.block_ids) for request in requests)
        width = next(w for w in self.widths if w >= needed)
        block_size, scratch = self.block_size, self.scratch_block
        rows: list[list[int]] = [[], [], [], []]
        table: list[list[int]] = []
        for request in requests:
            position = request.start_position
            rows[INPUT_IDS].append(request.token_ids[0])
            rows[POSITIONS].append(position)
            rows[SLOTS].append(request.block_ids[position // block_size] * block_size + position % block_size)
            rows[SEQ_LENS].append(position + 1)
            table.append(request.block_ids + [scratch] * (width - len(request.block_ids)))
        padding = size - num  # rows past the step's sequences: the padding row
        for row, pad in zip(rows, self.padding_row, strict=True):
            row.extend([pad] * padding)
        table.extend([[scratch] * width] * padding)
        self._table_host = torch.tensor(table, dtype=torch.int32)
        self._send_rows(torch.tensor(rows, dtype=torch.int64), 0, size)
        self._send_table(size, width)
        self._table_blocks = [len(request.block_ids) for request in requests]
        return self._replay(size, width, num)

    def replay_next(
        self,
        token_ids: torch.Tensor,
        requests: Sequence[ScheduledRequest],
        positions: Sequence[int],
        slots: Sequence[int],
    ) -> torch.Tensor | None:
        """The last launch's sequences (`requests`, in its row order) one position on: token_ids int64
        [num] (on the device: that step's tokens, never read by the host here), each at `positions`
        writing `slots` (the caller checked that every position falls in a block the sequence owns) ->
        logits f32 [num, vocab], as run() returns them. Blocks appended to a sequence since its table row
        was written go into the row first; None, launching nothing, where a table no longer fits the
        last launch's width."""
        if self._last is None:
            raise RuntimeError("replay_next needs a launch before it")
        size, width = self._last
        if any(len(request.block_ids) > width for request in requests):
            return None
        if append_blocks(self._table_host, self._table_blocks, requests):
            self._send_table(size, width)
        num = len(positions)
        padding = size - num  # the padded rows' positions, slots and lengths, as run() wrote them
        columns = (list(positions), list(slots), [position + 1 for position in positions])
        rows = [
            values + [pad] * padding
            for values, pad in zip(columns, self.padding_row[POSITIONS:], strict=True)
        ]
        self._send_rows(torch.tensor(rows, dtype=torch.int64), POSITIONS, size)
        self.inputs(size)[INPUT_IDS, :num].copy_(token_ids)  # device to device
        return self._replay(size, width, num)

    def _pad(self, size: int, width: int) -> None:
        """Every row of the bucket the padding row, its table all the scratch block."""
        inputs = self.inputs(size)
        for row, value in enumerate(self.padding_row):
            inputs[row].fill_(value)
        self.block_table(size, width).fill_(self.scratch_block)

    def _send_rows(self, rows: torch.Tensor, first_row: int, size: int) -> None:
        """rows int64 [n, size] -> rows first_row .. first_row + n of the size bucket's inputs: whole rows
        of a contiguous block, so one DMA from the staging buffer whose last copy is done."""
        staging, copied = self._host_inputs.take()
        last_row = first_row + rows.shape[0]
        staged = staging[: 4 * size].view(4, size)[first_row:last_row]
        staged.copy_(rows)
        self.inputs(size)[first_row:last_row].copy_(staged, non_blocking=True)
        copied.record()

    def _send_table(self, size: int, width: int) -> None:
        """The host's table of the last launch [size, width] -> the bucket's device table, one DMA from
        pinned memory."""
        staging, copied = self._host_table.take()
        staged = staging[: size * width].view(size, width)
        staged.copy_(self._table_host)
        self.block_table(size, width).copy_(staged, non_blocking=True)
        copied.record()

    def _replay(self, size: int, width: int, num: int) -> torch.Tensor:
        self._last = (size, width)
        self.graphs[size, width].replay()
        return self.logits[size, width][:num]

    def last_token_ids(self, num: int) -> torch.Tensor:
        """The argmax of each of the last launch's first `num` rows, int64 [num] on the device (a view of
        the bucket's static output: copy it before the next launch of that bucket). What greedy rows
        sample, computed inside the graph."""
        if self._last is None:
            raise RuntimeError("last_token_ids needs a launch before it")
        return self.token_ids[self._last][:num]


def append_blocks(table: torch.Tensor, table_blocks: list[int], requests: Sequence[ScheduledRequest]) -> bool:
    """Blocks a sequence got since its table row was written (the scheduler reserves the next position's
    block a step ahead for the launch ahead) -> into `table` (int32 [rows, width], the host's copy of the
    last launch's table) and `table_blocks` (each row's block count); True when any row changed. The
    caller checked that every sequence's blocks fit the width."""
    changed = False
    for row, request in enumerate(requests):
        written, held = table_blocks[row], len(request.block_ids)
        if held > written:
            table[row, written:held] = torch.tensor(request.block_ids[written:], dtype=torch.int32)
            table_blocks[row] = held
            changed = True
    return changed
