"""Decode-attention micro-benchmark of the Triton paged kernels (kernels/cuda/paged_attention.py). CUDA only.

Prints one JSON line per (batch, context): the GPU, the shape, the flash-decoding split count, median
microseconds per call (CUDA events around each call, after warm-up) and the effective bandwidth of the
K / V bytes the call must read (batch * context * kv_heads * head_dim * 2 tensors * dtype bytes / time).
Each timed call reads a fresh set of pages (several disjoint block tables over one pool of at least
--pool-mb): a decode step reads every layer's cache once, so the cache is cold in L2 as it is in a model.

    python benchmarks/bench_cuda_attention.py                       # 2B-4T shapes, f16 cache
    python benchmarks/bench_cuda_attention.py --batch 1 64 --context 4096 --splits 1 8 16
    python benchmarks/bench_cuda_attention.py --graph               # per call within CUDA-graph replays
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from collections.abc import Callable

import torch

from bitserve.kernels.cuda.paged_attention import decode_num_splits, paged_decode_attention

DTYPES = {"f16": torch.float16, "bf16": torch.bfloat16, "f32": torch.float32}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--context", type=int, nargs="+", default=[128, 1024, 4096])
    parser.add_argument("--heads", type=int, default=20)
    parser.add_argument("--kv-heads", type=int, default=5)
    parser.add_argument("--head-dim", type=int, default=128)
    parser.add_argument("--block-size", type=int, default=16)
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="f16")
    parser.add_argument(
        "--splits", type=int, nargs="*", default=[], help="split counts to force (default: auto)"
    )
    parser.add_argument("--iters", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--pool-mb", type=int, default=256, help="pages cycled through, to keep L2 cold")
    parser.add_argument("--graph", action="store_true", help="time replays of a captured CUDA graph")
    return parser.parse_args(argv)


def median_us(run: Callable[[int], None], iters: int, warmup: int) -> float:
    """Median of per-call CUDA-event timings (µs); run(i) launches call i. A GPU sleep queued first keeps
    the device busy while the host enqueues every timed call, so host launch overhead (Triton's Python
    launcher) stays out of the numbers: they are device time, back to back, as in a captured step."""
    for i in range(warmup):
        run(i)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    torch.cuda.synchronize()
    torch.cuda._sleep(2_000_000 * iters)  # ~1 ms of cycles per queued call: more than the host needs
    for i in range(iters):
        starts[i].record()
        run(warmup + i)
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) * 1000.0 for s, e in zip(starts, ends, strict=True))


def bench_case(args: argparse.Namespace, batch: int, context: int, splits: int | None) -> dict[str, object]:
    dtype, block_size = DTYPES[args.dtype], args.block_size
    blocks_per_seq = -(-context // block_size)
    kv_bytes = batch * context * args.kv_heads * args.head_dim * 2 * dtype.itemsize
    copies = max(1, -(-args.pool_mb * 2**20 // kv_bytes))  # tables over disjoint pages
    num_blocks = copies * batch * blocks_per_seq
    gen = torch.Generator(device="cuda").manual_seed(batch * 7 + context)
    cache = torch.randn(2, num_blocks, block_size, args.kv_heads, args.head_dim, device="cuda", dtype=dtype)
    pages = torch.randperm(num_blocks, device="cuda", generator=gen).to(torch.int32)
    tables = pages.view(copies, batch, blocks_per_seq)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, args.heads, args.head_dim, device="cuda")
    out = torch.empty_like(q)
    scale = args.head_dim**-0.5

    def call(i: int) -> None:
        paged_decode_attention(q, cache, tables[i % copies], seq_lens, scale, out=out, num_splits=splits)

    run, calls_per_run = call, 1
    if args.graph:  # one graph replaying a call over each page set (up to 64): per-call time = replay / calls
        call(0)
        calls_per_run = min(copies, 64)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for i in range(calls_per_run):
                call(i)
        run = lambda i: graph.replay()  # noqa: E731
    us = median_us(run, args.iters, args.warmup) / calls_per_run
    auto = decode_num_splits(batch, args.kv_heads, blocks_per_seq * block_size, q.device)
    return {
        "gpu": torch.cuda.get_device_name(),
        "batch": batch,
        "context": context,
        "heads": args.heads,
        "kv_heads": args.kv_heads,
        "head_dim": args.head_dim,
        "block_size": block_size,
        "dtype": args.dtype,
        "num_splits": splits if splits is not None else auto,
        "graph": args.graph,
        "us": round(us, 2),
        "kv_gb_per_s": round(kv_bytes / us / 1e3, 1),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if not torch.cuda.is_available():
        print("bench_cuda_attention: needs a CUDA device", file=sys.stderr)
        return 1
    for batch in args.batch:
        for context in args.context:
            for splits in args.splits or [None]:
                print(json.dumps(bench_case(args, batch, context, splits)), flush=True)
                torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())
