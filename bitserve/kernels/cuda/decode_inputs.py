"""The decode graphs' first kernel: a step's fed inputs -> what its layers read, in one launch.

A CUDA-graph decode step (runner/cuda_graphs.py) is fed each row's token id and position: by the host,
or, for a step launched ahead, by the step before it on the device (kernels/cuda/argmax.py's `StepFeed`).
This kernel gathers each token's embedding row widened to f32 (times the model's embedding scale,
Gemma's sqrt(hidden), where it has one) and derives the row's KV slot and context
length from its position and block table. Before it, the host computed slots and lengths and sent them
each step, and torch gathered and widened the embedding in two launches: on an H200 (2B-4T, batch 1)
a gather of 4.4 µs and a cast of 2.6 µs behind 2.0 and 0.6 µs gaps, beside a host copy whose gap was
5.6 µs (benchmarks/RESULTS.md, 2026-11-29). Imports triton: load only on the CUDA path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from bitserve.kernels.cuda.pdl import launch_options, pdl_enter

# rows of the int64 [4, size] input block the graphs feed (ids, positions) and this kernel fills
INPUT_IDS, POSITIONS, SLOTS, SEQ_LENS = range(4)
MAX_BLOCK = 4096  # embedding values a program copies
NUM_WARPS = 4
# the rows as kernels see them (a Triton kernel reads only constexpr globals): here and in argmax.py's feed
IDS_ROW, POSITIONS_ROW, SLOTS_ROW, SEQ_LENS_ROW = (tl.constexpr(row) for row in range(4))


@triton.jit
def _prepare_kernel(
    inputs_ptr, table_ptr, embedding_ptr, hidden_ptr, size, width, hidden_size, embedding_stride,
    block_size, scale, BLOCK: tl.constexpr, SCALED: tl.constexpr, USE_PDL: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0)
    chunk = tl.program_id(1)
    pdl_enter(USE_PDL)
    token = tl.load(inputs_ptr + IDS_ROW * size + row)
    position = tl.load(inputs_ptr + POSITIONS_ROW * size + row)
    cols = chunk * BLOCK + tl.arange(0, BLOCK)
    in_row = cols < hidden_size
    values = tl.load(embedding_ptr + token * embedding_stride + cols, mask=in_row, other=0.0)
    values = values.to(tl.float32)
    if SCALED:  # the module forward's f32 row * f32(scale)
        values = values * scale
    tl.store(hidden_ptr + row * hidden_size + cols, values, mask=in_row)
    if chunk == 0:
        # the host checks a fed position against the row's blocks; the clamp only keeps a bad one from
        # reading past the row
        column = tl.minimum(position // block_size, width - 1)
        block = tl.load(table_ptr + row * width + column).to(tl.int64)
        tl.store(inputs_ptr + SLOTS_ROW * size + row, block * block_size + position % block_size)
        tl.store(inputs_ptr + SEQ_LENS_ROW * size + row, position + 1)


def check_step_inputs(inputs: torch.Tensor, block_table: torch.Tensor) -> None:
    """The layout the decode graphs' kernels index by hand: inputs contiguous int64 [4, size], block_table
    contiguous int32 [size, width]."""
    if inputs.dim() != 2 or inputs.shape[0] != 4 or inputs.dtype != torch.int64 or not inputs.is_contiguous():
        raise ValueError(f"inputs must be contiguous int64 [4, size], got {tuple(inputs.shape)}")
    size = inputs.shape[1]
    table_ok = block_table.dim() == 2 and block_table.shape[0] == size and block_table.dtype == torch.int32
    if not (table_ok and block_table.is_contiguous()):
        raise ValueError(f"block_table must be contiguous int32 [{size}, width]")


def prepare_decode_step(
    inputs: torch.Tensor,
    block_table: torch.Tensor,
    embedding: torch.Tensor,
    block_size: int,
    scale: float = 1.0,
) -> torch.Tensor:
    """inputs int64 [4, size] (contiguous: ids, positions read; slots, seq_lens written), block_table
    int32 [size, width] (contiguous), embedding [vocab, hidden] (f32 / f16 / bf16, unit column stride)
    -> hidden f32 [size, hidden], each row its token's embedding row (widened to f32, then times
    `scale` where it is not 1.0). Row r's slot becomes
    block_table[r, positions[r] // block_size] * block_size + positions[r] % block_size and its
    seq_len positions[r] + 1."""
    check_step_inputs(inputs, block_table)
    size = inputs.shape[1]
    if embedding.dim() != 2 or embedding.stride(1) != 1:
        raise ValueError("embedding must be [vocab, hidden] with unit column stride")
    hidden_size = embedding.shape[1]
    hidden = torch.empty((size, hidden_size), dtype=torch.float32, device=inputs.device)
    if size == 0:
        return hidden
    block = min(triton.next_power_of_2(hidden_size), MAX_BLOCK)
    grid = (size, triton.cdiv(hidden_size, block))
    _prepare_kernel[grid](
        inputs, block_table, embedding, hidden, size, block_table.shape[1], hidden_size, embedding.stride(0),
        block_size, scale, BLOCK=block, SCALED=scale != 1.0, num_warps=NUM_WARPS,
        **launch_options(inputs.device),
    )  # fmt: skip
    return hidden
