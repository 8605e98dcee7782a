"""A/B of batch-1 decode on CUDA by the bench row's own metric, variants alternating in one process.

    python benchmarks/ab_gpu_decode.py /tmp/bitserve-gpu/2b4t-i2s.gguf --rounds 2 \
        --variant base: --variant noslot:config:cuda_lookahead_slot=False \
        --variant "tile:config:cuda_decode_tile='64,4,2'"

Each variant is `name:` followed by settings joined by `;`
('both:config:cuda_lookahead=False;module:ATTR=2'), each `config:FIELD=literal` (a ModelConfig field, the
kernel knobs among them, tile sweeps included: cuda_gemv_tiles, cuda_decode_tile; kernels/tuning.py,
passed at the load) or `module:ATTR=literal` (a module attribute set before the model loads:
profile_gpu_step.apply_settings); settings not named by a variant keep the values they had when this
script started, so `base:` is the code as it is. Per variant and round: load the model,
`bench_gpu.decode_rate` (ms a step over 128 tokens from a 16-token prompt, the median of three; the
bench's decode row, with its `lookahead_hits`) and the batch-1 graph's replay time (shortest-context
bucket, best of 3 x 200). A graph replay alone misses what grows with the context and what the engine does
between replays; this measures both (on the H200, 2026-11-28: a change that cost 1.4% in replay cost 5-7%
here). One JSON line per measurement. PDL (config:cuda_pdl) is one choice per device for the process
(kernels/cuda/pdl.py), so it cannot be varied here; the other knobs are read at each load and can.
"""

from __future__ import annotations

import argparse
import ast
import importlib
import json
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
    """The current values of every module switch some variant changes, as settings that restore them."""
    restore = []
    for setting in settings:
        target = setting.partition("=")[0]
        kind, _, attr = target.partition(":")
        if kind != "config":
            restore.append(f"{target}={getattr(importlib.import_module(kind), attr)!r}")
    return restore


def apply(settings: list[str]) -> dict[str, object]:
    """Set the module switches; return the ModelConfig fields (config:FIELD=literal) for the load."""
    module_settings, options = [], {}
    for setting in settings:
        target, _, value = setting.partition("=")
        kind, _, name = target.partition(":")
        if kind == "config":
            options[name] = ast.literal_eval(value)
        else:
            module_settings.append(setting)
    apply_settings(module_settings)
    return options


def measure(path: str, kv_bytes: int, options: dict[str, object]) -> dict:
    llm = bench_gpu.load_on_cuda(path, kv_bytes, **options)
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
            options = apply(settings)
            start = time.perf_counter()
            row = {"variant": name, "round": round_, **measure(args.model, args.kv_bytes, options)}
            row |= {"card": torch.cuda.get_device_name(0), "s": round(time.perf_counter() - start)}
            sys.stdout.write(json.dumps(row) + "\n")
            sys.stdout.flush()


if __name__ == "__main__":
    main()
