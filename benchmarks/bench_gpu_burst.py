"""A burst at `bitserve serve --device cuda` with no tuning flags (issue 40), beside the engine offline and
transformers in the same run, on the 2B-4T-shaped I2_S file.

    python benchmarks/bench_gpu_burst.py --out results.jsonl [--concurrency 256] [--rounds 2]

Rows (JSON lines, also appended to --out):
- `offline`: LLM.generate of `concurrency` sequences x 128 tokens at the engine's defaults (the KV cache
  sized from the device's memory): wall tok/s.
- `transformers`: BitNetForCausalLM bf16 batched greedy generate of the same shape (bench_gpu.py's).
- `burst`: `concurrency` streamed 128-token completions sent at once by `--client-processes` processes
  (aiohttp, each with its share of the streams), per round: 200s / 429s / other, output tok/s from the
  first request sent to the last token read, and each client process's CPU seconds over its wall time
  (well under 1: the client is not the limit), each stream's first and last token times (min / median /
  max seconds after the burst's start: intake or decode), the CPU share of the server's API process and of
  its engine process over the round (1.0 = one core busy throughout: which side is the limit), then the
  ratios served / offline and served / transformers.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.bench_gpu import MODEL_2B, ROOT, emit, ensure_models, timed_generate, transformers_rate  # noqa: E402
from benchmarks.burst_client import MAX_TOKENS, burst  # noqa: E402
from bitserve import LLM  # noqa: E402


def start_server(port: int, log: Path) -> subprocess.Popen[bytes]:
    """`bitserve serve --device cuda` on the 2B file, no tuning flags; returns once /health/ready is 200."""
    import httpx

    command = [sys.executable, "-m", "bitserve", "serve", "--model", str(MODEL_2B), "--device", "cuda"]
    with log.open("wb") as handle:
        server = subprocess.Popen(command + ["--port", str(port)], cwd=ROOT, stdout=handle, stderr=handle)
    deadline = time.time() + 300
    while time.time() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health/ready", timeout=2).status_code == 200:
                return server
        except httpx.HTTPError:
            pass
        time.sleep(1)
    server.terminate()
    raise RuntimeError(f"the server did not become ready in 300 s (log: {log})")


def _stat_fields(pid: int) -> list[str]:
    """/proc/PID/stat after the command name (which may hold spaces): state, ppid, ... as proc(5) numbers
    them from 3."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of process `pid` so far."""
    fields = _stat_fields(pid)
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def process_tree(pid: int) -> list[int]:
    """`pid` and its descendants (the server, its engine process, multiprocessing's helpers)."""
    parents: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                parents[int(entry.name)] = int(_stat_fields(int(entry.name))[1])
            except (OSError, ValueError):
                continue  # the process ended while we looked
    tree, frontier = [pid], [pid]
    while frontier:
        children = [child for child, parent in parents.items() if parent in frontier]
        tree += children
        frontier = children
    return tree


def gc_pauses(metrics: str) -> dict[str, list[float]]:
    """The API process's collection pauses over its life, from /metrics: generation -> [count, seconds]."""
    from prometheus_client.parser import text_string_to_metric_families

    pauses: dict[str, list[float]] = {}
    for family in text_string_to_metric_families(metrics):
        if family.name != "bitserve_gc_pause_seconds":
            continue
        for sample in family.samples:
            slot = {"bitserve_gc_pause_seconds_count": 0, "bitserve_gc_pause_seconds_sum": 1}.get(sample.name)
            if slot is not None:
                pauses.setdefault(sample.labels["generation"], [0.0, 0.0])[slot] = round(sample.value, 4)
    return pauses


def start_py_spy(pids: list[int], folder: Path) -> list[subprocess.Popen[bytes]]:
    """py-spy recording each of `pids` (raw collapsed stacks, 250 Hz, without pausing it) until SIGINT."""
    folder.mkdir(parents=True, exist_ok=True)
    spies = [
        subprocess.Popen(
            ["py-spy", "record", "--pid", str(pid), "--rate", "250", "--format", "raw", "--nonblocking"]
            + ["--output", str(folder / f"py-spy-{pid}.txt")],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        for pid in pids
    ]
    time.sleep(2.0)  # attached before the burst's first request (the client waits 3 s itself)
    return spies


def offline_rate(concurrency: int) -> tuple[float, dict[str, Any]]:
    """Wall tok/s of LLM.generate at the engine's defaults (second run: the first warms), and its KV pool."""
    llm = LLM(str(MODEL_2B), device="cuda")
    prompts = [[(7 * i + j) % 1000 + 10 for j in range(16)] for i in range(concurrency)]
    timed_generate(llm, prompts, MAX_TOKENS)
    rate = concurrency * MAX_TOKENS / timed_generate(llm, prompts, MAX_TOKENS)
    kv = llm.engine.runner.layout.describe()
    llm.close()
    del llm
    torch.cuda.empty_cache()
    return rate, kv


def main() -> None:
    import httpx

    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument("--concurrency", type=int, default=256)
    parser.add_argument("--client-processes", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--port", type=int, default=8124)
    parser.add_argument("--skip-transformers", action="store_true")
    parser.add_argument(
        "--py-spy",
        type=Path,
        default=None,
        help="record the server's processes with py-spy (raw stacks, one file a process) in the last round",
    )
    args = parser.parse_args()
    ensure_models({"formats"})
    offline, kv = offline_rate(args.concurrency)
    emit(
        {"bench": "offline", "num_seqs": args.concurrency, "wall_tok_s": round(offline, 1), "kv": kv},
        args.out,
    )
    theirs = None
    if not args.skip_transformers:
        theirs = transformers_rate(args.concurrency, MAX_TOKENS)
        emit({"bench": "transformers", "num_seqs": args.concurrency, "tok_s": round(theirs, 1)}, args.out)
    torch.cuda.empty_cache()
    log = Path("/tmp/bitserve-gpu/burst-server.log")
    server = start_server(args.port, log)
    try:
        url = f"http://127.0.0.1:{args.port}"
        model = httpx.get(f"{url}/v1/models").json()["data"][0]["id"]
        for round_index in range(args.rounds):
            row = {"bench": "burst", "round": round_index, "concurrency": args.concurrency}
            pids = process_tree(server.pid)
            before = {pid: cpu_seconds(pid) for pid in pids}
            spies = start_py_spy(pids, args.py_spy) if args.py_spy and round_index == args.rounds - 1 else []
            row |= burst(url, model, args.concurrency, args.client_processes)
            for spy in spies:
                spy.send_signal(signal.SIGINT)
                spy.wait(timeout=60)
            # over the burst's own time (the idle 3 s before it cost ~0 CPU)
            row["server_cpu_share"] = {
                ("api" if pid == server.pid else f"child-{pid}"): round(
                    (cpu_seconds(pid) - before[pid]) / row["elapsed_s"], 3
                )
                for pid in pids
            }
            row["served_over_offline"] = round(row["output_tok_s"] / offline, 3)
            if theirs is not None:
                row["served_over_transformers"] = round(row["output_tok_s"] / theirs, 2)
            emit(row, args.out)
        stats = httpx.get(f"{url}/v1/stats").json()
        pauses = gc_pauses(httpx.get(f"{url}/metrics").text)
        emit({"bench": "burst-server", "admission": stats.get("admission_by_device"), "gc": pauses}, args.out)
    finally:
        server.terminate()
        server.wait(timeout=60)
    kv_lines = [line for line in log.read_text(errors="replace").splitlines() if "KV cache" in line]
    emit({"bench": "burst-server-log", "kv_lines": kv_lines[-3:]}, args.out)


if __name__ == "__main__":
    main()
