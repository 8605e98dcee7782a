"""Decode-step CUDA graphs, one per (batch-size bucket, context bucket).

At batch 1 a 2B ternary decode step is ~300 short kernels; launched from Python they cost more than
the whole memory traffic of the step. A graph replays them with one launch. Batch buckets are powers of
two (1, 2, 4, ..., 256, capped by max_num_seqs); context buckets are block-table widths of 256 and 1024
keys and the full max_model_len. Decode attention's flash-decoding split count follows from the batch
and the bucket's table width (a graph cannot see the lengths): every bucket takes decode_num_splits'
count, which is 1 once a batch's programs fill the GPU (a one-split rule for short contexts made the
H200's 2B batch-1 step 1.5% slower, RESULTS.md 2026-11-29 10:50, and was removed).

Each graph reads static input buffers and writes static logits (f32) and each row's argmax (greedy
sampling's token, kernels/cuda/argmax.py, in the same kernel that widens an F16 head's logits). A step
of n sequences copies each row's token id and position, and the block table, into the first n rows of the
smallest fitting bucket (two non-blocking copies from pinned memory), pads the rest with a harmless row
(token 0 at position 0, its table all the scratch block: one key, written to the scratch page), replays,
and reads the first n rows of its outputs. The graph's first kernel derives each row's KV slot and
context length and gathers its embedding (kernels/cuda/decode_inputs.py); its last, the argmax, also
feeds the step after (kernels/cuda/argmax.py's StepFeed): each real row's token id and position + 1 go
into the inputs, and the tokens into pinned host memory. So a step launched ahead with the same rows
(replay_next) copies nothing but a table row that gained a block, and the host reads a step's tokens
(`readback`) without a copy. All graphs share one pool.

The input buffers are flat, and a bucket's graph reads a contiguous prefix of them: [4, size] int64
(ids, positions, slots, seq_lens) and [size, width] int32 (the table). So every host -> device copy is one
plain DMA from pinned memory. (Row slices of [4, 256] / [256, width_max] tensors were strided: torch
copied them through a pageable temporary and a scatter kernel, one more kernel and gap a step. Measured
alone on an H200 the change is inside the noise, 1.036 / 1.036 -> 1.043 / 1.030 ms a 2B batch-1 step:
benchmarks/RESULTS.md, 2026-11-29.)

Small buckets of a model with a float head also get a greedy graph each (`run(..., greedy=True)`, for
steps whose rows all take the argmax: the launch ahead's) where the decoder built its greedy head: the
same step ending in kernels/cuda/greedy_head.py, which finds the argmax from an int8 copy of the head
(half an F16 head's bytes). Its logits are -inf outside the argmax's candidates: not for sampling.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch

from bitserve.core.scheduler_output import ScheduledRequest
from bitserve.errors import UnsupportedModel
from bitserve.kernels.attention_metadata import AttentionMetadata
from bitserve.kernels.cuda.argmax import StepFeed
from bitserve.kernels.cuda.decode_inputs import INPUT_IDS, POSITIONS, SEQ_LENS, SLOTS, prepare_decode_step
from bitserve.kernels.cuda.decoder import CudaDecoder
from bitserve.runner.pinned_pair import PinnedPair

logger = logging.getLogger(__name__)

MAX_BUCKET = 256
CONTEXT_BUCKETS = (256, 1024)  # keys; the last bucket is always max_model_len


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


def held_output_bytes(
    decoder: CudaDecoder, *, max_batch: int, max_blocks_per_seq: int, block_size: int, vocab_size: int
) -> int:
    """Bytes the captured graphs' outputs hold in their pool for good: every graph's f32 logits
    [size, vocab] and int64 token ids [size] (DecodeGraphs.logits / token_ids), over the graphs
    capture_all captures (bucket_keys). Counted in the KV sizing's reserve (runner/cuda_memory.py): they
    stay live, so the pool cannot reuse them."""
    rows = sum(
        key.size
        for size in bucket_sizes(max_batch)
        for width in context_widths(max_blocks_per_seq, block_size)
        for key in bucket_keys(decoder, size, width)
    )
    return rows * (4 * vocab_size + 8)


def bucket_keys(decoder: CudaDecoder, size: int, width: int) -> list[GraphKey]:
    """A bucket's graphs: the full one, and a greedy one where the decoder's greedy head fits."""
    keys = [GraphKey(size, width, False)]
    if decoder.greedy_head_fits(size):
        keys.append(GraphKey(size, width, True))
    return keys


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
        # a harmless row's token id and position: token 0 at position 0, which with a table row of scratch
        # blocks the graph turns into one key written to the scratch page
        self.padding_row = (0, 0)
        size, width = self.sizes[-1], self.widths[-1]
        # static inputs on the device (see the module docstring: bucket views are contiguous prefixes)
        self._inputs = torch.zeros(4 * size, dtype=torch.int64, device=device)
        self._table = torch.full((size * width,), scratch_block, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(size + 1, dtype=torch.int32, device=device)
        # Two pinned staging buffers for each, used in turn: a launch ahead (runner/cuda_lookahead.py) may
        # still be copying from one when the next launch fills the other; each buffer's event marks its
        # copy done before the host writes it again.
        self._host_inputs = PinnedPair(lambda: torch.empty(2 * size, dtype=torch.int64))
        self._host_table = PinnedPair(lambda: torch.empty(size * width, dtype=torch.int32))
        # each row's token, written by the graph's argmax into row position % 2 (kernels/cuda/argmax.py)
        self.host_tokens = torch.zeros(2, size, dtype=torch.int64).pin_memory()
        # each launch's completion, in turn: at most two launches are unread (a step and the one ahead)
        self._launched = [torch.cuda.Event(), torch.cuda.Event()]
        self._last: GraphKey | None = None  # the last launch's graph
        self._last_positions: tuple[int, ...] = ()  # its rows' positions
        self._table_blocks: list[int] = []  # each row's blocks in the device table, as last written
        self._table_host = torch.empty(0, 0, dtype=torch.int32)  # the last launch's table [size, width]
        self.graphs: dict[GraphKey, torch.cuda.CUDAGraph] = {}
        self.logits: dict[GraphKey, torch.Tensor] = {}  # [size, vocab] f32
        # [size] int64: each row's argmax. Nothing reads it (the host reads tokens from host_tokens:
        # readback()); it is held so the shared pool never hands the graph's output to another allocation
        self.token_ids: dict[GraphKey, torch.Tensor] = {}
        self.pool = None

    def fits(self, num_seqs: int) -> bool:
        return num_seqs <= self.sizes[-1]

    def inputs(self, size: int) -> torch.Tensor:
        """The size bucket's inputs on the device: int64 [4, size] (ids, positions, slots, seq_lens)."""
        return self._inputs[: 4 * size].view(4, size)

    def block_table(self, size: int, width: int) -> torch.Tensor:
        """The (size, width) bucket's block table on the device: int32 [size, width]."""
        return self._table[: size * width].view(size, width)

    def _metadata(self, size: int, width: int) -> AttentionMetadata:
        inputs = self.inputs(size)
        return AttentionMetadata(
            slot_mapping=inputs[SLOTS],
            block_table=self.block_table(size, width),
            seq_lens=inputs[SEQ_LENS],
            query_start_loc=self.query_start_loc[: size + 1],
            block_size=self.block_size,
            max_query_len=1,
        )

    def _step(self, key: GraphKey) -> tuple[torch.Tensor, torch.Tensor]:
        size, width, greedy = key
        inputs, table, decoder = self.inputs(size), self.block_table(size, width), self.decoder
        # [size, hidden], times the model's embedding scale (Gemma) as CudaDecoder.forward does
        embedded = prepare_decode_step(
            inputs, table, decoder.embedding, self.block_size, decoder.embedding_scale
        )
        hidden = decoder.run_layers(embedded, inputs[POSITIONS], self.kv_caches, self._metadata(size, width))
        feed = StepFeed(inputs, table, self.scratch_block, self.host_tokens[:, :size])
        # f32 [size, vocab], int64 [size]
        return self.decoder.norm_logits_and_argmax(hidden, feed, greedy=greedy)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Warm up (Triton compiles each kernel specialization on first use) and capture every bucket,
        largest first so the smaller graphs reuse its pool."""
        started = time.perf_counter()
        for size in reversed(self.sizes):
            for width in reversed(self.widths):
                for key in bucket_keys(self.decoder, size, width):
                    self._pad(size, width)  # the buckets share memory: this one's padding, harmless rows
                    logits, _ = self._step(key)  # eager warm-up: compilation happens outside the capture
                    self._check_vocab(logits.shape[1])
                    torch.cuda.synchronize()
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool):
                        self.logits[key], self.token_ids[key] = self._step(key)
                    if self.pool is None:
                        self.pool = graph.pool()
                    self.graphs[key] = graph
        torch.cuda.synchronize()
        logger.info(
            "captured decode CUDA graphs for batch sizes %s x table widths %s (greedy head at %s) in %.1f s",
            self.sizes,
            self.widths,
            [size for size in self.sizes if self.decoder.greedy_head_fits(size)],
            time.perf_counter() - started,
        )

    def _check_vocab(self, head_rows: int) -> None:
        """The argmax feeds its token to the next step's embedding gather, which reads that row
        unchecked: a head with more rows than the token table could send it past the table."""
        table_rows = self.decoder.embedding.shape[0]
        if head_rows > table_rows:
            raise UnsupportedModel(
                f"the LM head has {head_rows} rows but the token embedding {table_rows}: a sampled token "
                "could have no embedding",
                hint="run it with --no-cuda-graphs, or fix the file's output / token_embd tensors",
            )

    def run(self, requests: Sequence[ScheduledRequest], *, greedy: bool = False) -> torch.Tensor:
        """A decode-only step of len(requests) sequences -> logits f32 [len(requests), vocab] (a view of
        the bucket's static output: read it before the next step). greedy=True, for rows that take only
        the argmax, replays the bucket's greedy graph where it has one: its logits are -inf outside the
        argmax's candidates (the module docstring)."""
        num = len(requests)
        size = next(s for s in self.sizes if s >= num)
        needed = max(len(request.block_ids) for request in requests)
        width = next(w for w in self.widths if w >= needed)
        scratch = self.scratch_block
        padding = size - num  # rows past the step's sequences: the padding row
        pad_id, pad_position = self.padding_row
        ids = [request.token_ids[0] for request in requests] + [pad_id] * padding
        positions = [request.start_position for request in requests]
        table = [request.block_ids + [scratch] * (width - len(request.block_ids)) for request in requests]
        table.extend([[scratch] * width] * padding)
        self._table_host = torch.tensor(table, dtype=torch.int32)
        self._send_rows(torch.tensor([ids, positions + [pad_position] * padding], dtype=torch.int64), size)
        self._send_table(size, width)
        self._table_blocks = [len(request.block_ids) for request in requests]
        return self._replay(self._key(size, width, greedy), positions)

    def replay_next(
        self, requests: Sequence[ScheduledRequest], positions: Sequence[int]
    ) -> torch.Tensor | None:
        """The last launch's sequences (`requests`, in its row order) one position on, each fed the token
        that launch computed (its argmax: the graph wrote it and the position into the inputs) ->
        logits f32 [num, vocab], as run() returns them. The caller checked that every position falls in a
        block the sequence owns. Blocks appended to a sequence since its table row was written go into
        the row first; None, launching nothing, where a table no longer fits the last launch's width."""
        if self._last is None:
            raise RuntimeError("replay_next needs a launch before it")
        size, width, _ = self._last
        if any(len(request.block_ids) > width for request in requests):
            return None
        if list(positions) != [position + 1 for position in self._last_positions]:
            raise RuntimeError("replay_next continues the last launch's rows, each one position on")
        if append_blocks(self._table_host, self._table_blocks, requests):
            self._send_table(size, width)
        return self._replay(self._last, positions)

    def held_graph(
        self, size: int, width: int, context: int, *, greedy: bool = False
    ) -> torch.cuda.CUDAGraph:
        """The (size, width) bucket's graph with inputs its replays leave as they are, for timing replays
        back to back (benchmarks/profile_gpu_step.py): every row a padded one at position context - 1, so
        each attends over `context` keys (of the scratch page) and the argmax feeds nothing back. (After
        a real step its rows are real, and each replay would move them one position on, past the
        bucket's table in a few hundred replays.) greedy=True: the graph a greedy step of the bucket
        replays, as in run(). The next step must be a run()."""
        if not 1 <= context <= width * self.block_size:
            raise ValueError(f"context {context} is outside the bucket's 1..{width * self.block_size} keys")
        self._pad(size, width)
        self.inputs(size)[POSITIONS].fill_(context - 1)
        self._last = None
        return self.graphs[self._key(size, width, greedy)]

    def _key(self, size: int, width: int, greedy: bool) -> GraphKey:
        """The bucket's greedy graph where greedy is asked and it has one, else its full graph."""
        return GraphKey(size, width, greedy and GraphKey(size, width, True) in self.graphs)

    def _pad(self, size: int, width: int) -> None:
        """Every row of the bucket the padding row, its table all the scratch block (the graph's first
        kernel derives the slots and lengths)."""
        inputs = self.inputs(size)
        for row, value in zip((INPUT_IDS, POSITIONS), self.padding_row, strict=True):
            inputs[row].fill_(value)
        self.block_table(size, width).fill_(self.scratch_block)

    def _send_rows(self, rows: torch.Tensor, size: int) -> None:
        """rows int64 [2, size] (ids, positions) -> the size bucket's first two input rows: a contiguous
        block, so one DMA from the staging buffer whose last copy is done."""
        staging, copied = self._host_inputs.take()
        staged = staging[: 2 * size].view(2, size)
        staged.copy_(rows)
        self.inputs(size)[INPUT_IDS : POSITIONS + 1].copy_(staged, non_blocking=True)
        copied.record()

    def _send_table(self, size: int, width: int) -> None:
        """The host's table of the last launch [size, width] -> the bucket's device table, one DMA from
        pinned memory."""
        staging, copied = self._host_table.take()
        staged = staging[: size * width].view(size, width)
        staged.copy_(self._table_host)
        self.block_table(size, width).copy_(staged, non_blocking=True)
        copied.record()

    def _replay(self, key: GraphKey, positions: Sequence[int]) -> torch.Tensor:
        self._last, self._last_positions = key, tuple(positions)
        self.graphs[key].replay()
        launched = self._launched.pop(0)
        launched.record()
        self._launched.append(launched)
        return self.logits[key][: len(positions)]

    def readback(self) -> TokenReadback:
        """The last launch's tokens (each row's argmax), for the host to read when that launch is done."""
        if self._last is None:
            raise RuntimeError("readback needs a launch before it")
        return TokenReadback(self.host_tokens, self._last_positions, self._launched[-1])


class GraphKey(NamedTuple):
    """A captured decode graph: its batch-size bucket, its table width, and whether it ends in the greedy
    head (the argmax only) rather than the full logits."""

    size: int
    width: int
    greedy: bool


@dataclass(frozen=True, slots=True)
class TokenReadback:
    """A launch's tokens in the pinned buffer its argmax writes (row position % 2 of each sequence's
    column): valid once `done` has completed, until the second launch after it (which a host launches
    only after reading this one: see kernels/cuda/argmax.py)."""

    host_tokens: torch.Tensor  # int64 [2, size], pinned
    positions: tuple[int, ...]  # each row's position in that launch
    done: torch.cuda.Event  # recorded after that launch

    def read(self) -> list[int]:
        """Waits for that launch alone (the one launched ahead after it runs on) -> each row's token."""
        self.done.synchronize()
        by_parity = self.host_tokens[:, : len(self.positions)].tolist()
        return [by_parity[position % 2][row] for row, position in enumerate(self.positions)]


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
