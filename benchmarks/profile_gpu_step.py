"""Where a batch-1 decode step goes on CUDA: host (engine + runner) vs the replayed graph, and the
graph's kernels by GPU time (torch.profiler over replays). One JSON line per model, then the table.

    python benchmarks/profile_gpu_step.py /tmp/bitserve-gpu/2b4t-i2s.gguf [more.gguf ...]
        [--set bitserve.runner.cuda_graphs:MAX_BUCKET=64]

BITSERVE_PROFILE_BATCH=N profiles the graph of the N-sequence bucket instead of batch 1 (the kernel
table; the step times stay batch 1). BITSERVE_PROFILE_HOST=1 adds the host side's cProfile (engine
steps of the batch-1 decode loop, sorted by own time): what the host does between two graph replays.
BITSERVE_PROFILE_TIMELINE=1 adds the step as the GPU runs it in a greedy generate (launches ahead, the
copies between graphs; torch.profiler over 65 tokens): the step period, the GPU's idle time, and every
operation outside the kernel chain with its time and the idle gap before it.
"""

from __future__ import annotations

import argparse
import ast
import cProfile
import importlib
import io
import json
import os
import pstats
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bitserve import LLM, SamplingParams  # noqa: E402
from bitserve.engine.messages import EngineRequest  # noqa: E402


def step_times(llm: LLM, num_steps: int = 64) -> list[float]:
    engine = llm.engine
    params = SamplingParams(max_tokens=num_steps + 2, temperature=0, ignore_eos=True)
    engine.add_request(EngineRequest("p", tuple(range(100, 116)), params, frozenset()))
    engine.step()  # prefill
    times = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - start)
    return times[2:]


REPLAY_CONTEXT = 82  # keys each row of a timed replay attends over: where step_times' generate ends


def replay_us(graph: torch.cuda.CUDAGraph, count: int = 100, rounds: int = 1) -> float:
    """Mean µs of `count` back-to-back replays (after one warm replay), the best of `rounds` such runs.
    Replays must not change the graph's inputs: take the graph from DecodeGraphs.held_graph."""
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    best = float("inf")
    for _ in range(rounds):
        graph.replay()
        start.record()
        for _ in range(count):
            graph.replay()
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) * 1000 / count)
    return best


def kernel_table(graph: torch.cuda.CUDAGraph) -> str:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA, ProfilerActivity.CPU]) as prof:
        for _ in range(10):
            graph.replay()
        torch.cuda.synchronize()
    return prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)


def host_profile(llm: LLM) -> str:
    """cProfile of a batch-1 decode loop's engine steps, the top functions by own time."""
    profiler = cProfile.Profile()
    profiler.enable()
    step_times(llm, num_steps=200)
    profiler.disable()
    text = io.StringIO()
    pstats.Stats(profiler, stream=text).sort_stats("tottime").print_stats(30)
    return text.getvalue()


STEP_END_KERNEL = "_argmax_kernel"  # the decode graph's last kernel (kernels/cuda/argmax.py)


def step_timeline(events: list[dict[str, float | str]], chain_min_per_step: int = 10) -> dict[str, object]:
    """GPU events (name, ts, dur in µs; kernels and copies in stream order) of a decode loop -> per step
    (from one STEP_END_KERNEL's end to the next one's end, from the second such end on: the prefill and
    the first decode step are not measured): the median
    period and idle time, and for each operation that runs fewer than `chain_min_per_step` times a step
    (the head, the argmax, copies, casts: not the layer chain) its median time and the median idle gap
    before it."""
    ends = [i for i, event in enumerate(events) if event["name"] == STEP_END_KERNEL]
    periods, idles = [], []
    durations: dict[str, list[float]] = defaultdict(list)
    gaps: dict[str, list[float]] = defaultdict(list)
    counts: dict[str, int] = defaultdict(int)
    steps = list(zip(ends[1:-1], ends[2:], strict=False))  # consecutive ends: one fewer pair
    for first, last in steps:
        start = float(events[first]["ts"]) + float(events[first]["dur"])
        busy_until, idle = start, 0.0
        for event in events[first + 1 : last + 1]:
            name, ts, dur = str(event["name"]), float(event["ts"]), float(event["dur"])
            gap = max(0.0, ts - busy_until)
            idle += gap
            busy_until = max(busy_until, ts + dur)
            counts[name] += 1
            durations[name].append(dur)
            gaps[name].append(gap)
        periods.append(busy_until - start)
        idles.append(idle)
    if not steps:
        return {"steps": 0}
    outside = {
        name[:70]: {
            "us": round(statistics.median(durations[name]), 2),
            "gap_before_us": round(statistics.median(gaps[name]), 2),
            "per_step": round(count / len(steps), 2),
        }
        for name, count in counts.items()
        if count < chain_min_per_step * len(steps)
    }
    return {
        "steps": len(steps),
        "period_us_median": round(statistics.median(periods), 1),
        "idle_us_median": round(statistics.median(idles), 1),
        "outside_chain": outside,
    }


def timeline(llm: LLM, new_tokens: int = 65) -> dict[str, object]:
    """step_timeline of a batch-1 greedy generate of `new_tokens` (after one of the same length)."""
    from torch.profiler import ProfilerActivity, profile

    params = SamplingParams(max_tokens=new_tokens, temperature=0, ignore_eos=True)
    prompt = [list(range(100, 116))]
    llm.generate(prompt, params)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompt, params)
        torch.cuda.synchronize()
    cuda = torch.autograd.DeviceType.CUDA
    events = [
        {"name": e.name, "ts": e.time_range.start, "dur": e.time_range.end - e.time_range.start}
        for e in prof.events()
        if e.device_type == cuda
    ]
    return step_timeline(sorted(events, key=lambda event: event["ts"]))


def apply_settings(settings: list[str]) -> None:
    """`module:ATTR=literal` pairs set before any model loads: a module-level switch of the kernels
    (e.g. bitserve.runner.cuda_graphs:MAX_BUCKET=64) for an A/B in one command; kernel tiles are
    ModelConfig fields (cuda_gemv_tiles, cuda_decode_tile: ab_gpu_decode.py's config: settings)."""
    for setting in settings:
        target, _, literal = setting.partition("=")
        module_name, _, attr = target.partition(":")
        module = importlib.import_module(module_name)
        if not attr or not hasattr(module, attr):
            raise SystemExit(f"--set {setting}: {module_name} has no attribute {attr!r}")
        setattr(module, attr, ast.literal_eval(literal))


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("models", nargs="+")
    parser.add_argument("--set", action="append", default=[], help="module:ATTR=literal before loading")
    args = parser.parse_args()
    apply_settings(args.set)
    for path in args.models:
        llm = LLM(path, device="cuda")
        steps = step_times(llm)
        graphs = llm.engine.runner.graphs
        batch = int(os.environ.get("BITSERVE_PROFILE_BATCH", "1"))
        # the shortest-context bucket, every row at the context the steps above left (16 + 66 keys)
        # the graph a greedy decode step runs
        graph = graphs.held_graph(batch, graphs.widths[0], REPLAY_CONTEXT, greedy=True)
        row = {
            "model": Path(path).name,
            "card": torch.cuda.get_device_name(0),
            "step_ms_median": round(statistics.median(steps) * 1000, 3),
            "graph_batch": batch,
            "graph_replay_ms": round(replay_us(graph) / 1000, 3),
        }
        sys.stdout.write(json.dumps(row) + "\n")
        sys.stdout.write(kernel_table(graph) + "\n")
        if os.environ.get("BITSERVE_PROFILE_HOST") == "1":
            sys.stdout.write(host_profile(llm) + "\n")
        if os.environ.get("BITSERVE_PROFILE_TIMELINE") == "1":
            sys.stdout.write(json.dumps({"model": Path(path).name, "timeline": timeline(llm)}) + "\n")
        llm.close()
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
