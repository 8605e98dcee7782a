r"""Load time of a model in a fresh process: `LLM(path)` construction to the first generated token.

    python benchmarks/bench_load.py /tmp/2b4t-i2s.gguf --runs 3
    python benchmarks/bench_load.py /tmp/2b4t-i2s.gguf --runs 2 --checkout /work/main   # alternating

Each run is a new Python process (imports, numba's first use and the page cache as a restarted server
sees them; the file is read once beforehand so every run finds it cached). The child times `import
bitserve` + torch, `LLM(path, backend=...)` (its weights part from the loader), the first one-token
greedy generate, and the process CPU time of the last two (a busy machine stretches wall time, not
this); then RSS (anon / file) and, from /proc/self/smaps, how much of the GGUF's own mapping is
resident and how much of it is anonymous (copied-on-write: must be 0 when weights are read in place).
--checkout adds a second source tree (PYTHONPATH) run alternately with this one. Nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

CHILD = r"""
import json, os, sys, time
path, backend = sys.argv[1], sys.argv[2]
clock = time.perf_counter
t0 = clock()
import torch  # noqa: F401
from bitserve import LLM, SamplingParams
t1, c1 = clock(), time.process_time()
llm = LLM(path, backend=backend)
t2 = clock()
llm.generate(["The capital of France is"], SamplingParams(max_tokens=1, temperature=0.0))
t3, c3 = clock(), time.process_time()
status = {}
for line in open("/proc/self/status"):
    name, _, rest = line.partition(":")
    if name in ("VmRSS", "RssAnon", "RssFile"):
        status[name] = int(rest.split()[0]) // 1024
mapping, current = {"Rss": 0, "Anonymous": 0}, None
for line in open("/proc/self/smaps"):
    fields = line.split()
    if fields and "-" in fields[0] and not fields[0].endswith(":"):
        current = fields[5] if len(fields) > 5 else ""
    elif current == path and fields[0].rstrip(":") in mapping:
        mapping[fields[0].rstrip(":")] += int(fields[1]) // 1024
print(json.dumps({
    "import_s": t1 - t0, "llm_s": t2 - t1, "weights_s": llm.instance.loaded.load_seconds,
    "first_token_s": t3 - t2, "ready_s": t3 - t1, "ready_cpu_s": c3 - c1,
    "rss_mb": status, "gguf_mapping_mb": mapping, "loadavg": os.getloadavg()[0],
}))
"""


def run_child(checkout: Path, path: str, backend: str) -> dict:
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    done = subprocess.run(  # cwd: `python -c` puts the working directory first on sys.path
        [sys.executable, "-c", CHILD, path, backend],
        env=env,
        cwd=checkout,
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(done.stdout.strip().splitlines()[-1])


def row(name: str, result: dict) -> str:
    rss, mapping = result["rss_mb"], result["gguf_mapping_mb"]
    return (
        f"{name:>12}  LLM() {result['llm_s']:5.2f} s (weights {result['weights_s']:4.2f})  first token "
        f"{result['first_token_s']:4.2f} s  ready {result['ready_s']:5.2f} s wall / "
        f"{result['ready_cpu_s']:5.2f} s CPU  RSS {rss['VmRSS']} MB (anon {rss['RssAnon']} + file "
        f"{rss['RssFile']}), GGUF mapping {mapping['Rss']} MB resident / {mapping['Anonymous']} MB anon  "
        f"load avg {result['loadavg']:.1f}"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    for flag, options in (
        ("model", {"help": "a GGUF file"}),
        ("--backend", {"default": "auto"}),
        ("--runs", {"type": int, "default": 3, "help": "fresh processes per source tree"}),
        ("--checkout", {"type": Path, "help": "a second source tree, run alternately"}),
    ):
        parser.add_argument(flag, **options)
    args = parser.parse_args()
    path = str(Path(args.model).resolve())
    with open(path, "rb") as fh:  # into the page cache: every run then reads it from memory
        while fh.read(1 << 24):
            pass
    trees = [("this tree", ROOT)] + ([(str(args.checkout), args.checkout)] if args.checkout else [])
    print(f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}: {path}, backend {args.backend}, load {os.getloadavg()}")
    for _ in range(args.runs):
        for name, checkout in trees:
            print(row(name, run_child(checkout, path, args.backend)), flush=True)


if __name__ == "__main__":
    main()
