"""The time a single kernel needs to read N bytes from device memory: the floor under any kernel that must
stream N bytes once (a batch-1 GEMV's weights), measured the way bench_gpu.py times its GEMVs.

A Triton kernel loads the bytes as int32 vectors (evict-first), sums each program's block and stores one
int32 a program: nothing but the reads. The fastest of a sweep over block sizes and warps, in a CUDA graph
of back-to-back calls that each read a different buffer (together over twice the L2, so every call reads
DRAM). PDL launch as the product's kernels (the next call's launch overlaps this one's tail).
Imports triton: run on a CUDA machine.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from bitserve.kernels.cuda.pdl import launch_options, pdl_enter

BLOCKS = (1024, 2048, 4096, 8192)
WARPS = (2, 4, 8)


@triton.jit
def _read_kernel(src_ptr, out_ptr, n, BLOCK: tl.constexpr, USE_PDL: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    values = tl.load(src_ptr + offs, mask=offs < n, other=0, eviction_policy="evict_first")
    pdl_enter(USE_PDL)  # the loads above go out before the wait, as the GEMV's weight loads do
    tl.store(out_ptr + tl.program_id(0), tl.sum(values, axis=0))


def distinct_copies(nbytes: int) -> int:
    """Buffers of nbytes whose total is over twice the device's L2: a chain over them reads DRAM."""
    l2_bytes = torch.cuda.get_device_properties(0).L2_cache_size
    return max(2, -(-2 * l2_bytes // nbytes) + 1)


def read_floor_us(nbytes: int, graph_time_us: Callable[[Callable[[int], object], int], float]) -> float:
    """Fastest µs to read nbytes (distinct buffers, DRAM) over the BLOCKS x WARPS sweep."""
    words = nbytes // 4
    copies = distinct_copies(nbytes)
    buffers = [torch.randint(0, 1 << 20, (words,), dtype=torch.int32, device="cuda") for _ in range(copies)]
    best = float("inf")
    for block, warps in itertools.product(BLOCKS, WARPS):
        grid = triton.cdiv(words, block)
        sink = torch.empty(grid, dtype=torch.int32, device="cuda")

        def read(i: int, block: int = block, warps: int = warps, grid: int = grid, sink=sink) -> None:  # noqa: ANN001
            _read_kernel[(grid,)](
                buffers[i], sink, words, BLOCK=block, num_warps=warps, **launch_options(sink.device)
            )

        best = min(best, graph_time_us(read, copies))
    return best
