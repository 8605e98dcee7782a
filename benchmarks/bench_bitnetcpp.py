r"""bitserve beside bitnet.cpp's `llama-bench` on the same 2B-4T-shaped I2_S file, alternating in one run.

    /work/shared/peers/build-bitnet-cpp.sh BITNET LINUX FORK /tmp/bitnetcpp   # the peer, outside the project
    python benchmarks/make_2b4t_model.py /tmp/2b4t-i2s.gguf
    python benchmarks/bench_bitnetcpp.py /tmp/bitnetcpp/BitNet/build/bin/llama-bench \
        --model /tmp/2b4t-i2s.gguf

Each round runs bitserve's prefill (a --prefill-tokens prompt, time to first token) and decode
(--decode-tokens greedy tokens after an 8-token prompt) through its Engine, as bench_model.py does, then
`llama-bench -m FILE -t THREADS -p PREFILL -n DECODE -r 3 -o json` as a child process (its pp / tg
averages parsed from the JSON). llama-bench's tg starts from an empty context; bitserve's decode from 8
tokens: the same per-token work to within one attention row. Prints each round, the medians, their
ratios bitserve / bitnet.cpp, and the decode bound: bytes read per token (every tensor of the file,
the tied F16 embedding as the LM head) / read bandwidth measured here with numpy
(bench_kernels.read_bandwidth). Load average before and after, CPU model and flags go with the numbers.
Timings only; nothing is asserted.
"""

from __future__ import annotations

import bitserve  # noqa: F401  (first: sets the OpenMP wait default before torch / numba load libgomp)

# isort: split

import argparse  # noqa: E402
import json  # noqa: E402
import os
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark modules

from bench_kernels import read_bandwidth  # noqa: E402
from bench_model import TEXT, BitserveRunner, machine_info, measure, warm_up  # noqa: E402

from bitserve.llm import LLM  # noqa: E402
from bitserve.loader.gguf_reader import read_gguf  # noqa: E402

ISA_FLAGS = ("avx2", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "fma", "f16c")


def load_average() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def bytes_per_token(path: Path) -> int:
    """Weight bytes one decode step reads: every tensor once; the token embedding only when it is also
    the LM head (no `output.weight`: a tied head is read whole every step, an embedding lookup is not)."""
    with read_gguf(path) as gguf:
        sizes = {name: info.nbytes for name, info in gguf.tensors.items()}
    if "output.weight" in sizes:
        sizes.pop("token_embd.weight", None)
    return sum(sizes.values())


def cpu_flags() -> list[str]:
    """The ISA flags that decide which kernel variant runs, as /proc/cpuinfo lists them."""
    with open("/proc/cpuinfo", encoding="ascii") as fh:
        flags = next((line.split(":", 1)[1].split() for line in fh if line.startswith("flags")), [])
    return [flag for flag in ISA_FLAGS if flag in flags]


def run_llama_bench(binary: Path, model: Path, args: argparse.Namespace) -> dict[str, float]:
    """One llama-bench run; returns its pp and tg averages (tok/s) and the wall time of the child."""
    argv = [
        str(binary),
        "-m",
        str(model),
        "-t",
        str(args.threads),
        "-p",
        str(args.prefill_tokens),
        "-n",
        str(args.decode_tokens),
        "-r",
        str(args.peer_repeats),
        "-o",
        "json",
    ]
    start = time.perf_counter()
    # the peer waits with its own OpenMP defaults, not the wait settings bitserve put in this environment
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")}
    done = subprocess.run(argv, capture_output=True, text=True, check=False, env=env)
    wall_s = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"llama-bench exited with {done.returncode}:\n{done.stderr[-4000:]}")
    rows = json.loads(done.stdout)
    rates = {"wall_s": wall_s}
    for row in rows:
        key = "prefill_tok_s" if row["n_prompt"] > 0 else "decode_tok_s"
        rates[key] = float(row["avg_ts"])
        rates[key.replace("tok_s", "stddev")] = float(row["stddev_ts"])
    return rates


def alternate(llm: LLM, args: argparse.Namespace) -> dict[str, list[dict[str, Any]]]:
    """--rounds rounds of bitserve then llama-bench; every round is printed as it finishes."""
    runner = BitserveRunner(llm)
    base_ids = llm.tokenizer.encode(TEXT, add_special=False)
    warm_up(runner, base_ids, args)
    rounds: dict[str, list[dict[str, Any]]] = {"bitserve": [], "bitnet.cpp": []}
    for index in range(args.rounds):
        ours = measure(runner, base_ids, args, index)
        ours.pop("tokens")
        peer = run_llama_bench(args.llama_bench, args.model, args)
        rounds["bitserve"].append(ours)
        rounds["bitnet.cpp"].append(peer)
        print(
            f"round {index + 1}: bitserve prefill {ours['prefill_tok_s']:.2f} "
            f"decode {ours['decode_tok_s']:.2f}"
            f" | bitnet.cpp pp {peer['prefill_tok_s']:.2f} tg {peer['decode_tok_s']:.2f} tok/s"
            f" | load {os.getloadavg()[0]:.2f}",
            flush=True,
        )
    return rounds


def print_summary(rounds: dict[str, list[dict[str, Any]]], bound: dict[str, float]) -> None:
    print(f"\nmedian of {len(rounds['bitserve'])} alternating rounds")
    print(f"  {'':16} {'bitserve':>10} {'bitnet.cpp':>11} {'ratio':>7} {'bound':>8}")
    for key, label in (("prefill_tok_s", "prefill tok/s"), ("decode_tok_s", "decode tok/s")):
        ours = statistics.median(r[key] for r in rounds["bitserve"])
        peer = statistics.median(r[key] for r in rounds["bitnet.cpp"])
        limit = f"{bound['tok_s']:8.1f}" if key == "decode_tok_s" else f"{'-':>8}"
        print(f"  {label:16} {ours:10.2f} {peer:11.2f} {ours / peer:7.3f} {limit}")
    print(
        f"  decode bound: {bound['bytes'] / 1e6:,.0f} MB per token / {bound['gb_s']:.1f} GB/s read "
        f"({bound['threads']} threads, numpy sum) = {bound['tok_s']:.1f} tok/s"
    )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("llama_bench", type=Path, help="bitnet.cpp's llama-bench binary")
    parser.add_argument("--model", type=Path, default=Path("/tmp/2b4t-i2s.gguf"), help="2B-4T-shaped I2_S")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=3, help="alternating rounds")
    parser.add_argument("--peer-repeats", type=int, default=3, help="llama-bench -r per round")
    parser.add_argument("--prefill-tokens", type=int, default=128)
    parser.add_argument("--decode-prompt-tokens", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    args = parser.parse_args()

    import numba
    import torch

    torch.set_num_threads(args.threads)
    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    info = {
        **machine_info(),
        "flags": cpu_flags(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    print(
        f"{info['date']}: {info['cpu']}, flags {' '.join(info['flags'])}, {args.threads} threads, "
        f"load average {load_average()}",
        flush=True,
    )
    start = time.perf_counter()
    llm = LLM(str(args.model), backend="cpu")
    info["bitserve_load_s"] = time.perf_counter() - start
    rounds = alternate(llm, args)
    llm.close()
    gb_s = read_bandwidth([args.threads])[args.threads]
    per_token = bytes_per_token(args.model)
    bound = {"bytes": per_token, "gb_s": gb_s, "threads": args.threads, "tok_s": gb_s * 1e9 / per_token}
    info["loadavg_end"] = load_average()
    print_summary(rounds, bound)
    print(
        f"bitserve load {info['bitserve_load_s']:.1f} s; load average at start {info['loadavg_start']}, "
        f"at end {info['loadavg_end']}"
    )
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {"machine": info, "rounds": rounds, "bound": bound}
        args.json.write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")


if __name__ == "__main__":
    main()
