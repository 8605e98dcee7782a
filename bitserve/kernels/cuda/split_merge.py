"""The in-kernel merge of flash-decoding's splits (paged_attention.DECODE_MERGE_IN_KERNEL): each split
program of the decode kernel counts its arrival once its partial and log2-sum-exp are stored, and the last
of a (sequence, KV head)'s splits merges its group's partials, so no reduce kernel follows. Its counters
live on the device, zero between launches. Imports triton: load only on the CUDA path.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

MERGE_COUNTERS_MIN = 8192  # arrival counters allocated at once (sequences x KV heads), int32
_MERGE_COUNTERS: dict[torch.device, torch.Tensor] = {}
_RETIRED_COUNTERS: list[torch.Tensor] = []  # replaced by larger ones: captured graphs may still use them


@triton.jit
def merge_if_last(
    part_ptr, lse_ptr, final_ptr, count_ptr, seq, kv_head, final_stride_b, final_stride_h,
    GROUP: tl.constexpr, MERGE_G: tl.constexpr, NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr,
    BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """After a split's partial and lse stores: count its arrival; the last of the (seq, kv_head)'s
    NUM_SPLITS splits merges the GROUP heads' partials into final and sets the counter back to zero."""
    tl.debug_barrier()  # every thread's partial and lse stores before the release below
    counter = count_ptr + seq * tl.num_programs(1) + kv_head
    arrived = tl.atomic_add(counter, 1, sem="acq_rel")
    if arrived == NUM_SPLITS - 1:
        first_head = kv_head * GROUP
        first_row = seq.to(tl.int64) * (tl.num_programs(1) * GROUP) + first_head
        final_row = final_ptr + seq.to(tl.int64) * final_stride_b + first_head * final_stride_h
        _merge_group(
            part_ptr, lse_ptr, first_row, final_row, final_stride_h, GROUP, MERGE_G, NUM_SPLITS, HEAD_DIM,
            BLOCK_S, BLOCK_D,
        )  # fmt: skip
        tl.store(counter, 0)  # the next launch (a later kernel) counts from zero


@triton.jit
def _merge_group(
    part_ptr, lse_ptr, first_row, out_row, out_stride_h, GROUP: tl.constexpr, BLOCK_G: tl.constexpr,
    NUM_SPLITS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_D: tl.constexpr,
):  # fmt: skip
    """GROUP heads' NUM_SPLITS partials each (part_ptr [rows, S, D] and lse_ptr [rows, S], contiguous, from
    row first_row) merged by their weights 2^(lse_s - max lse), the log-sum-exp merge of flash-decoding,
    stored at out_row + g * out_stride_h [D]: _decode_reduce_kernel's arithmetic, for a whole group in one
    load (one L2 round trip however large the group; the reduce kernel, one head a program, stays as it
    ran on the GPU). Reads bypass L1 (.cg): other programs of the decode kernel wrote them."""
    heads = tl.arange(0, BLOCK_G)
    splits = tl.arange(0, BLOCK_S)
    dims = tl.arange(0, BLOCK_D)
    head_ok = heads < GROUP
    dim_ok = dims < HEAD_DIM
    lse_offs = (first_row + heads)[:, None] * NUM_SPLITS + splits[None, :]  # [G, S]
    lse_ok = head_ok[:, None] & (splits < NUM_SPLITS)[None, :]
    lse = tl.load(lse_ptr + lse_offs, mask=lse_ok, other=float("-inf"), cache_modifier=".cg")
    part_ok = lse_ok[:, :, None] & dim_ok[None, None, :]
    parts_ptrs = part_ptr + lse_offs[:, :, None] * HEAD_DIM + dims[None, None, :]
    parts = tl.load(parts_ptrs, mask=part_ok, other=0.0, cache_modifier=".cg")  # [G, S, D]
    top = tl.max(lse, axis=1)
    top = tl.where(top == float("-inf"), 0.0, top)
    weight = tl.exp2(lse - top[:, None])  # [G, S]: 0 for empty splits
    total = tl.maximum(tl.sum(weight, axis=1), 1e-30)
    merged = tl.sum(parts * weight[:, :, None], axis=1) / total[:, None]  # [G, D]
    out_ptrs = out_row + heads[:, None] * out_stride_h + dims[None, :]
    tl.store(out_ptrs, merged, mask=head_ok[:, None] & dim_ok[None, :])


def merge_counters(device: torch.device, needed: int) -> torch.Tensor:
    """The device's zeroed int32 arrival counters of the in-kernel merge, at least `needed` of them. Each
    launch leaves them zero and kernels on one stream run one after another, so every launch shares them
    (decode attention on two streams at once would need counters of its own: bitserve's steps, graph
    replays included, run on the current stream, one at a time). Made (or grown) outside a CUDA graph
    capture: the eager warm-up before each capture runs first."""
    counters = _MERGE_COUNTERS.get(device)
    if counters is None or counters.numel() < needed:
        if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
            raise RuntimeError("the decode merge counters must be made before a CUDA graph capture")
        if counters is not None:
            _RETIRED_COUNTERS.append(counters)
        counters = torch.zeros(max(needed, MERGE_COUNTERS_MIN), dtype=torch.int32, device=device)
        _MERGE_COUNTERS[device] = counters
    return counters
