"""Same-run A/B of two bitserve source trees (an old commit against the working tree): greedy decode tok/s
of one model file, the two trees alternating in fresh processes, so both see the same machine moments.

    git worktree add /tmp/bitserve-old <commit>
    python benchmarks/ab_checkouts.py /tmp/bitserve-old . MODEL.gguf --tokens 64 --rounds 4 [--streams 16]

Each run imports bitserve from its tree (PYTHONPATH), loads the model on the given backend / device,
warms up, then times a one-token generate (prefill) and an N-token generate from the same prompt(s):
decode tok/s = streams * (N - 1) / (t_N - t_1). Prints each run and the median ratio new / old.
Timings only; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

RUN = r"""
import json, sys, time
from bitserve.llm import LLM
from bitserve.sampling_params import SamplingParams
path, backend, device = sys.argv[1:4]
tokens, streams = int(sys.argv[4]), int(sys.argv[5])
llm = LLM(path, backend=backend, device=device)
prompts = [f"The history of computing, part {i}:" for i in range(streams)]
def timed(n):
    params = SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)
    start = time.perf_counter()
    llm.generate(prompts, params)
    return time.perf_counter() - start
timed(4)
one, full = timed(1), timed(tokens)
print(json.dumps({"tok_s": streams * (tokens - 1) / (full - one)}))
llm.close()
"""


def run_once(tree: Path, args: argparse.Namespace) -> float:
    env = {**os.environ, "PYTHONPATH": str(tree.resolve())}
    command = [sys.executable, "-c", RUN, str(args.model), args.backend, args.device]
    command += [str(args.tokens), str(args.streams)]
    done = subprocess.run(command, env=env, capture_output=True, text=True, timeout=1800, check=False)
    if done.returncode != 0:
        raise SystemExit(f"{tree}: run failed\n{done.stderr[-3000:]}")
    return float(json.loads(done.stdout.strip().splitlines()[-1])["tok_s"])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("old", type=Path, help="the baseline source tree (a git worktree of a commit)")
    parser.add_argument("new", type=Path, help="the tree under test")
    parser.add_argument("model", type=Path)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--streams", type=int, default=1, help="sequences decoded together")
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--backend", default="auto")
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()
    rates: dict[str, list[float]] = {"old": [], "new": []}
    for round_index in range(args.rounds):
        order = ("old", "new") if round_index % 2 == 0 else ("new", "old")
        for name in order:
            rate = run_once(getattr(args, name), args)
            rates[name].append(rate)
            sys.stdout.write(f"round {round_index + 1} {name}: {rate:.2f} tok/s\n")
            sys.stdout.flush()
    ratios = [new / old for new, old in zip(rates["new"], rates["old"], strict=True)]
    summary = {name: statistics.median(values) for name, values in rates.items()}
    sys.stdout.write(
        f"median old {summary['old']:.2f}, new {summary['new']:.2f} tok/s; new/old per round "
        f"{', '.join(f'{r:.3f}' for r in ratios)}; median {statistics.median(ratios):.3f}\n"
    )


if __name__ == "__main__":
    main()
