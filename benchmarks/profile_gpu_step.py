"""Where a batch-1 decode step goes on CUDA: host (engine + runner) vs the replayed graph, and the
graph's kernels by GPU time (torch.profiler over replays). One JSON line per model, then the table.

    python benchmarks/profile_gpu_step.py /tmp/bitserve-gpu/2b4t-i2s.gguf [more.gguf ...]
        [--set bitserve.kernels.cuda.paged_attention:PREFETCH_OLD_KEYS=False]

BITSERVE_PROFILE_BATCH=N profiles the graph of the N-sequence bucket instead of batch 1 (the kernel
table; the step times stay batch 1). BITSERVE_PROFILE_HOST=1 adds the host side's cProfile (engine
steps of the batch-1 decode loop, sorted by own time): what the host does between two graph replays.
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


def replay_us(graph: torch.cuda.CUDAGraph, count: int = 100, rounds: int = 1) -> float:
    """Mean µs of `count` back-to-back replays (after one warm replay), the best of `rounds` such runs."""
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


def apply_settings(settings: list[str]) -> None:
    """`module:ATTR=literal` pairs set before any model loads: a module-level switch of the kernels
    (e.g. bitserve.kernels.cuda.paged_attention:PREFETCH_OLD_KEYS=False) for an A/B in one command."""
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
        graph = graphs.graphs[batch, graphs.widths[0]]  # the shortest-context bucket
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
        llm.close()
        del llm
        torch.cuda.empty_cache()


if __name__ == "__main__":
    main()
