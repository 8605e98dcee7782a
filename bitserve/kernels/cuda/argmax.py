"""Greedy sampling's argmax over a vocabulary row, in one launch that spreads each row over many programs.

torch's CUDA argmax reduces a single row with one thread block: 27.8 µs for 128,256 logits on an H200,
2.7% of a 2B batch-1 decode step (benchmarks/RESULTS.md, 2026-11-29). Here each row is cut into BLOCK-wide
parts, one program each; a program writes its part's (value, first index) and the last program of the
row to arrive (an atomic counter) reduces the parts and resets the counter for the next launch.
`cast_argmax_rows` also writes the row widened to f32 as it reads it: in the decode graph the F16 head's
logits go through it, one kernel where a cast and torch's argmax were two (and a launch gap).

Semantics are torch.argmax's: the first index of the maximum, a NaN counting as the maximum (the first
NaN wins), -0.0 equal to +0.0.

With a `StepFeed` the row's last program also feeds the next decode step (runner/cuda_graphs.py): it
writes the row's token into the graph's input ids and advances its position by one (rows of a real
sequence only: a padded row, whose table row starts with the scratch block, stays as it was), and it
stores the token into pinned host memory, in row `position % 2` of the feed's host buffer. So a step
launched ahead needs no host -> device copy (nor a device -> device copy of the ids), and the host reads
the tokens without a device -> host copy: on an H200 each copy sat behind a 1.6-5.6 µs gap between the
graphs (benchmarks/RESULTS.md, 2026-11-29). Two rows suffice: a host reads a step's tokens before it
launches the second step after it, and consecutive steps of a sequence differ in position parity.
Imports triton: load only on the CUDA path.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from bitserve.kernels.cuda.decode_inputs import IDS_ROW, POSITIONS_ROW, check_step_inputs

BLOCK = 4096  # logits a program reduces: 32 programs a row of 128,256
NUM_WARPS = 8
INITIAL_ROWS = 1024  # arrival counters made at first use: the decode graphs' buckets (<= 256) fit
MAX_COLUMNS = 2**31 - 1  # indices are int32 inside the kernel
MAX_INDEX = tl.constexpr(MAX_COLUMNS)


@triton.jit
def _first_max(values, indices):
    """(value, index) of the first maximum of `values` [N] f32 (a NaN is the maximum), `indices` [N] int32
    their positions; lanes to ignore hold -inf at index MAX_INDEX."""
    is_nan = values != values
    nan_index = tl.min(tl.where(is_nan, indices, MAX_INDEX), axis=0)
    finite = tl.where(is_nan, float("-inf"), values)
    top = tl.max(finite, axis=0)
    top_index = tl.min(tl.where(finite == top, indices, MAX_INDEX), axis=0)
    has_nan = nan_index < MAX_INDEX
    return tl.where(has_nan, float("nan"), top), tl.where(has_nan, nan_index, top_index)


@dataclass(frozen=True, slots=True)
class StepFeed:
    """Where a decode graph's argmax feeds the next step (see the module docstring)."""

    inputs: torch.Tensor  # int64 [4, rows] contiguous: row 0 the ids, row 1 the positions (advanced here)
    block_table: torch.Tensor  # int32 [rows, width] contiguous: a row starting with scratch_block is padding
    scratch_block: int
    host_tokens: torch.Tensor  # int64 [2, >= rows], unit column stride, pinned: [position % 2, row]


@triton.jit
def _feed_next_step(
    best, row, inputs_ptr, table_ptr, tokens_ptr, n_rows, table_width, tokens_stride, scratch_block
):
    """Row `row`'s token `best` (int64) -> the host buffer's row position % 2, and, for a real sequence,
    the input ids and position + 1 of the step after."""
    position = tl.load(inputs_ptr + POSITIONS_ROW * n_rows + row)
    tl.store(tokens_ptr + (position % 2) * tokens_stride + row, best)
    if tl.load(table_ptr + row * table_width) != scratch_block:
        tl.store(inputs_ptr + IDS_ROW * n_rows + row, best)
        tl.store(inputs_ptr + POSITIONS_ROW * n_rows + row, position + 1)


@triton.jit
def _argmax_kernel(
    x_ptr, out_ptr, wide_ptr, part_values_ptr, part_indices_ptr, arrivals_ptr, n_cols, x_stride,
    wide_stride, n_parts, feed_inputs_ptr, feed_table_ptr, feed_tokens_ptr, table_width, tokens_stride,
    scratch_block, BLOCK: tl.constexpr, PARTS_BLOCK: tl.constexpr, WIDEN: tl.constexpr, FEED: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    part = tl.program_id(1)
    cols = part * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < n_cols
    x = tl.load(x_ptr + row * x_stride + cols, mask=in_row, other=float("-inf")).to(tl.float32)
    if WIDEN:  # f16 / bf16 -> f32 is exact: the values torch's .to(torch.float32) gives
        tl.store(wide_ptr + row * wide_stride + cols, x, mask=in_row)
    value, index = _first_max(x, tl.where(in_row, cols, MAX_INDEX))
    slot = row * n_parts + part
    tl.store(part_values_ptr + slot, value)
    tl.store(part_indices_ptr + slot, index)
    # every thread's stores before the arrival; the atomic (one thread) releases them at GPU scope, and the
    # last program's acquire makes all parts visible to it
    tl.debug_barrier()
    arrived = tl.atomic_add(arrivals_ptr + row, 1, sem="acq_rel", scope="gpu")
    if arrived == n_parts - 1:
        parts = tl.arange(0, PARTS_BLOCK)
        is_part = parts < n_parts
        first = row * n_parts
        values = tl.load(part_values_ptr + first + parts, mask=is_part, other=float("-inf"), volatile=True)
        indices = tl.load(part_indices_ptr + first + parts, mask=is_part, other=MAX_INDEX, volatile=True)
        _, best = _first_max(values, indices)
        token = best.to(tl.int64)
        tl.store(out_ptr + row, token)
        if FEED:
            _feed_next_step(
                token, row, feed_inputs_ptr, feed_table_ptr, feed_tokens_ptr, tl.num_programs(0), table_width,
                tokens_stride, scratch_block,
            )  # fmt: skip
        tl.store(arrivals_ptr + row, 0)  # the next launch on this stream starts from zero


class Argmax:
    """argmax_rows for one device: its arrival counters live across launches (reset by the kernel)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._arrivals = torch.zeros(INITIAL_ROWS, dtype=torch.int32, device=device)
        # counters outgrown by a larger launch: kept alive, since a CUDA graph captured with one still
        # points at it (freed, the caching allocator would hand its bytes to another tensor)
        self._outgrown: list[torch.Tensor] = []

    def __call__(
        self, logits: torch.Tensor, widened: torch.Tensor | None = None, feed: StepFeed | None = None
    ) -> torch.Tensor:
        """logits [rows, vocab] (f32, f16 or bf16; unit column stride) -> int64 [rows], torch.argmax's
        answer; `widened` f32 [rows, vocab] (unit column stride), when given, gets the logits as f32;
        `feed`, when given, gets each row's token (see StepFeed). Launches on the current stream;
        concurrent launches on other streams must not share it."""
        if logits.dim() != 2 or logits.stride(1) != 1:
            shape = tuple(logits.shape)
            raise ValueError(f"argmax_rows needs [rows, vocab] with unit column stride, got {shape}")
        num_rows, num_cols = logits.shape
        if num_cols == 0 or num_cols > MAX_COLUMNS:
            raise ValueError(f"argmax_rows needs 1 to {MAX_COLUMNS} columns, got {num_cols}")
        if widened is not None and (
            widened.dtype != torch.float32 or widened.shape != logits.shape or widened.stride(1) != 1
        ):
            raise ValueError("widened must be f32 logits' shape with unit column stride")
        out = torch.empty(num_rows, dtype=torch.int64, device=logits.device)
        if num_rows == 0:
            return out
        if self._arrivals.numel() < num_rows:
            self._outgrown.append(self._arrivals)
            self._arrivals = torch.zeros(num_rows, dtype=torch.int32, device=self.device)
        n_parts = triton.cdiv(num_cols, BLOCK)
        part_values = torch.empty(num_rows * n_parts, dtype=torch.float32, device=logits.device)
        part_indices = torch.empty(num_rows * n_parts, dtype=torch.int32, device=logits.device)
        wide = logits if widened is None else widened  # an unused pointer when not widening
        if feed is not None:
            _check_feed(feed, num_rows)
            feed_pointers = (feed.inputs, feed.block_table, feed.host_tokens)
            feed_values = (feed.block_table.shape[1], feed.host_tokens.stride(0), feed.scratch_block)
        else:  # unused pointers and values
            feed_pointers, feed_values = (out, out, out), (1, 1, 0)
        _argmax_kernel[(num_rows, n_parts)](
            logits, out, wide, part_values, part_indices, self._arrivals, num_cols, logits.stride(0),
            wide.stride(0), n_parts, *feed_pointers, *feed_values, BLOCK=BLOCK,
            PARTS_BLOCK=triton.next_power_of_2(n_parts), WIDEN=widened is not None, FEED=feed is not None,
            num_warps=NUM_WARPS,
        )  # fmt: skip
        return out


def _check_feed(feed: StepFeed, num_rows: int) -> None:
    if feed.inputs.shape[-1] != num_rows:
        shape = tuple(feed.inputs.shape)
        raise ValueError(f"feed.inputs must be [4, {num_rows}] (the logits' rows), got {shape}")
    check_step_inputs(feed.inputs, feed.block_table)
    tokens = feed.host_tokens
    if tokens.dim() != 2 or tokens.shape[0] != 2 or tokens.shape[1] < num_rows or tokens.stride(1) != 1:
        raise ValueError(f"feed.host_tokens must be int64 [2, >= {num_rows}] with unit column stride")
    if tokens.dtype != torch.int64:
        raise ValueError("feed.host_tokens must be int64")


_BY_DEVICE: dict[torch.device, Argmax] = {}


def _for_device(device: torch.device) -> Argmax:
    argmax = _BY_DEVICE.get(device)
    if argmax is None:
        argmax = _BY_DEVICE[device] = Argmax(device)
    return argmax


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """logits [rows, vocab] on a CUDA device (or the CPU under Triton's interpreter) -> int64 [rows]."""
    return _for_device(logits.device)(logits)


def cast_argmax_rows(logits: torch.Tensor, feed: StepFeed | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [rows, vocab] f16 / bf16 / f32 -> (the logits as f32, their argmax int64 [rows]), the
    tokens also fed to `feed` when given; f32 logits come back as they are."""
    argmax = _for_device(logits.device)
    if logits.dtype == torch.float32:
        return logits, argmax(logits, feed=feed)
    widened = torch.empty(logits.shape, dtype=torch.float32, device=logits.device)
    return widened, argmax(logits, widened, feed)
