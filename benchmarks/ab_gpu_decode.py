"""A/B of batch-1 decode on CUDA by the bench row's own metric, variants alternating in one process.

    python benchmarks/ab_gpu_decode.py /tmp/bitserve-gpu/2b4t-i2s.gguf --rounds 2 \
        --variant base: --variant noslot:env:BITSERVE_CUDA_LOOKAHEAD_SLOT=0 \
        --variant "notail:bitserve.kernels.cuda.ternary_matmul:GEMV_EXACT_TAIL=False"

Each variant is `name:` followed by settings joined by `;` ('both:env:X=1;module:ATTR=2'), each
`module:ATTR=literal` (a module-level switch, set before the model loads:
profile_gpu_step.apply_settings) or `env:NAME=value`; settings not named by a variant keep the values
they had when this script started, so `base:` is the code as it is. Per variant and round: load the
model, `bench_gpu.decode_rate` (ms a step over 128 tokens from a 16-token prompt, the median of three;
the bench's decode row, with its `lookahead_hits`) and the batch-1 graph's replay time (shortest-context
bucket, best of 3 x 200). A graph replay alone misses what grows with the context and what the engine
does between replays; this measures both (on the H200, 2026-11-28: a change that cost 1.4% in replay
cost 5-7% here). One JSON line per measurement. An env switch that the code reads once per process
(BITSERVE_CUDA_PDL) cannot be varied here; the lookahead ones (BITSERVE_CUDA_LOOKAHEAD,
BITSERVE_CUDA_LOOKAHEAD_SLOT) are read at each load and can.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import bench_gpu  # noqa: E402
from profile_gpu_step import REPLAY_CONTEXT, apply_settings, replay_us  # noqa: E402


def parse_variant(text: str) -> tuple[str, list[str]]:
    name, _, settings = text.partition(":")
    if not name:
        raise SystemExit(f"--variant {text!r}: give it a name, `name:settings`")
    return name, [s for s in settings.split(";") if s]


def snapshot(settings: list[str]) -> list[str]:
    """The current values of every setting some variant changes, as settings that restore them."""
    restore = []
    for setting in settings:
        target = setting.partition("=")[0]
        kind, _, attr = target.partition(":")
        if kind == "env":
            restore.append(f"{target}={os.environ.get(attr, '')}")
        else:
            restore.append(f"{target}={getattr(importlib.import_module(kind), attr)!r}")
    return restore


def apply(settings: list[str]) -> None:
    module_settings = []
    for setting in settings:
        target, _, value = setting.partition("=")
        kind, _, name = target.partition(":")
        if kind != "env":
            module_settings.append(setting)
        elif value:
            os.environ[name] = value
        else:
            os.environ.pop(name, None)
    apply_settings(module_settings)


def measure(path: str, kv_bytes: int) -> dict:
    llm = bench_gpu.load_on_cuda(path, kv_bytes)
    try:
        rate = bench_gpu.decode_rate(llm, 1, 128)
        graphs = llm.engine.runner.graphs
        # replays that repeat one step, of the graph a greedy decode step runs
        graph = graphs.held_graph(1, graphs.widths[0], REPLAY_CONTEXT, greedy=True)
        replay = replay_us(graph, count=200, rounds=3)
        return {**rate, "replay_ms": round(replay / 1000, 3)}
    finally:
        llm.close()
        torch.cuda.empty_cache()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("model")
    parser.add_argument("--variant", action="append", required=True, help="name:setting;setting;...")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--kv-bytes", type=int, default=8 << 30)
    args = parser.parse_args()
    variants = [parse_variant(v) for v in args.variant]
    baseline = snapshot([s for _, settings in variants for s in settings])
    for round_ in range(args.rounds):
        for name, settings in variants:
            apply(baseline)
            apply(settings)
            start = time.perf_counter()
            row = {"variant": name, "round": round_, **measure(args.model, args.kv_bytes)}
            row |= {"card": torch.cuda.get_device_name(0), "s": round(time.perf_counter() - start)}
            sys.stdout.write(json.dumps(row) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
