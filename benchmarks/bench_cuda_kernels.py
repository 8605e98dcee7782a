"""CUDA ternary-linear micro-benchmark (bitserve/kernels/cuda, Triton); needs a CUDA device.

For each weight shape (M x K) of BitNet b1.58 2B-4T and token count T: time of one `ternary_linear` call,
GB/s of packed-weight bytes (M * K / 4 / time) and that rate's share of the device-to-device copy
bandwidth measured in the same run (torch copy_ of 1 GB, bytes read + written). Timing: a CUDA graph of
20 back-to-back calls, each on its own copy of the weights (together larger than L2, so the weights
come from HBM as in a model), replayed after warm-up; median over the replays, divided by 20.
Prints the GPU name, then one JSON line per row.

    python benchmarks/bench_cuda_kernels.py                 # the default shapes and T = 1, 16, 64, 256
    python benchmarks/bench_cuda_kernels.py --tokens 1 2 4 8 --quantize
    python benchmarks/bench_cuda_kernels.py --sweep         # every GEMV / GEMM tile config (tuning)

Imports torch, triton and bitserve.kernels.cuda only (no server dependencies).
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from collections.abc import Callable

import torch
import triton
import triton.language as tl

from bitserve.kernels.cuda import ternary_matmul as tm
from bitserve.kernels.cuda.quantize import norm_quantize

SHAPES = [
    (2560, 2560),
    (3840, 2560),
    (2560, 6912),
    (13824, 2560),
]  # o-proj, stacked qkv, down, stacked gate/up
CALLS_PER_GRAPH = 20  # distinct weight copies per replay
GEMV_SWEEP = [
    tm.GemvConfig(bm, bw, warps)
    for warps in (1, 2, 4)
    for bm in (1, 2, 4, 8, 16)
    for bw in (64, 128, 256, 512)
    if bw // 4 <= 32 * warps and bm * bw >= 4 * 32 * warps and bm * bw <= 32 * 32 * warps
]
GEMM_SWEEP = [
    tm.GemmConfig(bt, bn, warps, stages, split)
    for bt, bn, warps in (
        (16, 64, 4),
        (16, 128, 4),
        (32, 64, 4),
        (32, 128, 4),
        (64, 64, 4),
        (64, 128, 4),
        (128, 128, 8),
    )
    for stages in (3,)
    for split in (0, 1)
]


@triton.jit
def _noop_kernel(out_ptr):
    tl.store(out_ptr + tl.program_id(0), 1.0)


def time_graph(calls: list[Callable[[], object]], replays: int = 50) -> float:
    """Median µs of one call: calls captured back to back in one CUDA graph, replayed after warm-up."""
    for call in calls:
        call()  # compile outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for call in calls:
            call()
    for _ in range(5):
        graph.replay()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(replays):
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1000 / len(calls))
    return statistics.median(times)


def copy_bandwidth() -> float:
    """GB/s of a 1 GB device-to-device copy_, counting bytes read and written."""
    src = torch.empty(2**30, dtype=torch.uint8, device="cuda").random_(0, 255)
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(10):
        start.record()
        dst.copy_(src)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / 1000)
    return 2 * src.numel() / statistics.median(times) / 1e9


class Problem:
    """CALLS_PER_GRAPH weight copies of one shape and one activation batch, on the GPU."""

    def __init__(self, m: int, k: int, num_tokens: int) -> None:
        self.m, self.k, self.num_tokens = m, k, num_tokens
        self.packed = [
            torch.randint(0, 255, (m, k // 4), dtype=torch.uint8, device="cuda") & 0b10101010
            for _ in range(CALLS_PER_GRAPH)
        ]  # codes 0 and 2 only (w = -1, +1): valid planes
        self.scale = torch.rand(m, device="cuda") + 0.5
        self.x = torch.randn(num_tokens, k, device="cuda")
        self.q, self.s_act = norm_quantize(self.x, None, 1e-6)
        self.out = [torch.empty(num_tokens, m, device="cuda") for _ in range(CALLS_PER_GRAPH)]

    def calls(
        self, launch: Callable[..., object] | None = None, cfg: object = None
    ) -> list[Callable[[], object]]:
        def make(i: int) -> Callable[[], object]:
            if launch is None:
                return lambda: tm.ternary_linear(
                    self.q, self.s_act, self.packed[i], self.scale, out=self.out[i]
                )
            return lambda: launch(self.q, self.s_act, self.packed[i], self.scale, None, self.out[i], cfg)

        return [make(i) for i in range(CALLS_PER_GRAPH)]

    def row(self, us: float, copy_gbps: float, **extra: object) -> dict[str, object]:
        gbps = self.m * self.k / 4 / (us * 1e-6) / 1e9
        return {
            "shape": f"{self.m}x{self.k}",
            "T": self.num_tokens,
            "us": round(us, 2),
            "weight_GBps": round(gbps, 1),
            "copy_share": round(gbps / copy_gbps, 3),
            **extra,
        }


def check(problem: Problem, launch: Callable[..., object], cfg: object) -> bool:
    """The config's output against ternary_linear's path decoded in float64 on the GPU (exact)."""
    from bitserve.kernels.cuda.ternary_pack import unpack_ternary_planes
    from bitserve.kernels.reference.ternary import bitnet_epilogue, integer_matmul

    out = torch.full_like(problem.out[0], float("nan"))
    launch(problem.q, problem.s_act, problem.packed[0], problem.scale, None, out, cfg)
    values = unpack_ternary_planes(problem.packed[0], problem.k)
    ref = bitnet_epilogue(
        integer_matmul(problem.q, values).cpu(), problem.s_act.cpu(), problem.scale.cpu()[None]
    )
    return bool(torch.equal(out.cpu(), ref))


def sweep_jobs(tokens: list[int]) -> list[tuple[int, int, int, Callable[..., object], object]]:
    """(M, K, T, launch, config) of every sweep point, T outermost (the decode T first)."""
    jobs = []
    for num_tokens in tokens:
        is_gemv = num_tokens <= tm.GEMV_MAX_T
        launch, configs = (tm.launch_gemv, GEMV_SWEEP) if is_gemv else (tm.launch_gemm, GEMM_SWEEP)
        for m, k in SHAPES:
            for cfg in configs:
                if is_gemv and cfg.block_m * num_tokens > 32:
                    continue  # one [BM, BW] accumulator per token: too many registers
                jobs.append((m, k, num_tokens, launch, cfg))
    return jobs


def precompile(tokens: list[int], part: int, parts: int) -> None:
    """Run every parts-th sweep point once (fills Triton's on-disk cache; no timing)."""
    for m, k, num_tokens, launch, cfg in sweep_jobs(tokens)[part::parts]:
        q = torch.zeros(num_tokens, k, dtype=torch.int8, device="cuda")
        packed = torch.zeros(m, k // 4, dtype=torch.uint8, device="cuda")
        ones = torch.ones(max(m, num_tokens), device="cuda")
        out = torch.empty(num_tokens, m, device="cuda")
        try:
            launch(q, ones[:num_tokens], packed, ones[:m], None, out, cfg)
        except Exception as exc:  # noqa: BLE001 - reported again by the timing pass
            sys.stderr.write(f"precompile {m}x{k} T={num_tokens} {cfg}: {exc}\n")
    torch.cuda.synchronize()


def sweep(tokens: list[int], copy_gbps: float, jobs: int) -> None:
    """Every tile config of the path T takes, per shape and T; the best of each last."""
    if jobs > 1:
        command = [sys.executable, __file__, "--tokens", *map(str, tokens), "--precompile-parts", str(jobs)]
        procs = [subprocess.Popen([*command, "--precompile-part", str(i)]) for i in range(jobs)]
        for proc in procs:
            proc.wait()
    results: dict[tuple[int, int, int], list[tuple[float, object]]] = {}
    problems: dict[tuple[int, int, int], Problem] = {}
    for m, k, num_tokens, launch, cfg in sweep_jobs(tokens):
        key = (m, k, num_tokens)
        if key not in problems:
            problems.clear()
            problems[key] = Problem(m, k, num_tokens)
        problem = problems[key]
        try:
            us = time_graph(problem.calls(launch, cfg), replays=20)
        except Exception as exc:  # noqa: BLE001 - a config that does not compile is skipped
            print(
                json.dumps({"shape": f"{m}x{k}", "T": num_tokens, "cfg": list(cfg), "error": str(exc)[:80]})
            )
            continue
        results.setdefault(key, []).append((us, cfg))
        print(json.dumps(problem.row(us, copy_gbps, cfg=list(cfg))), flush=True)
    for (m, k, num_tokens), timed in results.items():
        ranked = sorted(timed)
        problem = Problem(m, k, num_tokens)
        launch = tm.launch_gemv if num_tokens <= tm.GEMV_MAX_T else tm.launch_gemm
        ok = check(problem, launch, ranked[0][1])
        top3 = [list(cfg) for _, cfg in ranked[:3]]
        print(json.dumps(problem.row(ranked[0][0], copy_gbps, best=top3[0], exact=ok, top3=top3)), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--tokens", type=int, nargs="+", default=[1, 16, 64, 256])
    parser.add_argument("--sweep", action="store_true", help="time every tile config instead of the table's")
    parser.add_argument("--quantize", action="store_true", help="also time norm_quantize per T and width")
    parser.add_argument("--jobs", type=int, default=1, help="--sweep: compile in this many processes first")
    parser.add_argument("--precompile-part", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--precompile-parts", type=int, default=1, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.precompile_part is not None:
        precompile(args.tokens, args.precompile_part, args.precompile_parts)
        return 0
    if not torch.cuda.is_available():
        sys.stderr.write("bench_cuda_kernels.py needs a CUDA device\n")
        return 2
    copy_gbps = copy_bandwidth()
    flag = torch.empty(2560, device="cuda")
    noop_us = time_graph([lambda: _noop_kernel[(1280,)](flag)] * CALLS_PER_GRAPH)
    header = {
        "gpu": torch.cuda.get_device_name(),
        "copy_GBps_rw": round(copy_gbps, 1),
        "empty_kernel_us": round(noop_us, 2),
    }
    sys.stdout.write(json.dumps(header) + "\n")
    if args.sweep:
        sweep(args.tokens, copy_gbps, args.jobs)
        return 0
    for m, k in SHAPES:
        for num_tokens in args.tokens:
            problem = Problem(m, k, num_tokens)
            path = "gemv" if tm.use_gemv(m, k, num_tokens) else "gemm"
            row = problem.row(time_graph(problem.calls()), copy_gbps, path=path)
            sys.stdout.write(json.dumps(row) + "\n")
    if args.quantize:
        for width, activation in ((2560, None), (13824, "relu2"), (6912, None)):
            for num_tokens in args.tokens:
                x = torch.randn(num_tokens, width, device="cuda")
                w = torch.rand(width // 2 if activation else width, device="cuda")
                calls = [lambda x=x, w=w, act=activation: norm_quantize(x, w, 1e-6, activation=act)]
                calls = calls * CALLS_PER_GRAPH
                us = time_graph(calls)
                row = {"op": "norm_quantize", "width": width, "activation": activation, "T": num_tokens}
                sys.stdout.write(json.dumps({**row, "us": round(us, 2)}) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
