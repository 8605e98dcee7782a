"""The F16 LM head's single-token GEMV: torch's (`F.linear` on F16) beside the cpu backend's numba kernel
(kernels/cpu/f16head.py), alternating in one process.

    python benchmarks/bench_head.py                                   # a 2B-4T-shaped random head alone
    python benchmarks/bench_head.py --model /tmp/2b4t-i2s.gguf        # + greedy decode steps, head swapped

Head alone: a random F16 [vocab, hidden] matrix (default 128256 x 2560, 657 MB: more than the L3, so
every call reads it from DRAM), --rounds rounds alternating torch and the kernel, --repeats calls each;
ms and GB/s of the head's bytes, medians, and whether the logits are the same bits. --model: that file
loaded once (cpu backend, --threads threads), greedy decode runs (--decode-tokens after an 8-token
prompt) alternating between the head kernels (LMHead.gemv set or cleared between runs): the median
engine step of each. Load average and CPU flags go with the numbers. Timings only; nothing is asserted.
"""

from __future__ import annotations

import bitserve  # noqa: F401  (first: sets the OpenMP wait default before torch / numba load libgomp)

# isort: split

import argparse  # noqa: E402
import os  # noqa: E402
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402

import numba  # noqa: E402
import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))  # the sibling benchmark modules

from bench_bitnetcpp import cpu_flags, load_average  # noqa: E402

from bitserve import LLM, SamplingParams  # noqa: E402
from bitserve.config import EngineConfig, ModelConfig  # noqa: E402
from bitserve.engine.messages import EngineRequest  # noqa: E402
from bitserve.kernels.cpu.backend import CpuBackend  # noqa: E402
from bitserve.layers.embedding import LMHead  # noqa: E402

PROMPT = (1, *range(100, 107))


def head_alone(args: argparse.Namespace) -> None:
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(args.vocab, args.hidden, generator=generator) * 0.05).to(torch.float16)
    hidden = torch.randn(1, args.hidden, generator=generator)
    head = LMHead(weight, CpuBackend(num_threads=args.threads))
    if head.gemv is None:
        raise SystemExit("this CPU / width has no numba F16 head (CpuBackend.half_head_gemv)")
    kernels: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {"torch": head.kernel, "numba": head.gemv}
    times: dict[str, list[float]] = {name: [] for name in kernels}
    logits = {}
    for _ in range(args.rounds):
        for name, kernel in kernels.items():
            for _ in range(args.repeats):
                start = time.perf_counter()
                logits[name] = kernel(hidden)
                times[name].append(time.perf_counter() - start)
    gigabytes = weight.numel() * weight.element_size() / 1e9
    for name, samples in times.items():
        median = statistics.median(samples[args.repeats :])  # the first round warms up
        print(f"  head alone, {name:5}: {median * 1e3:7.2f} ms  {gigabytes / median:5.1f} GB/s")
    same = torch.equal(logits["torch"].view(torch.int32), logits["numba"].view(torch.int32))
    print(f"  same logits (bits): {same}")


def decode_steps(llm: LLM, tag: str, tokens: int) -> list[float]:
    engine = llm.engine
    params = SamplingParams(max_tokens=tokens, temperature=0, ignore_eos=True)
    engine.add_request(EngineRequest(tag, PROMPT, params, frozenset()))
    engine.step()  # the prompt
    steps = []
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        engine.step()
        steps.append(time.perf_counter() - start)
    return steps


def model_decode(args: argparse.Namespace) -> None:
    config = EngineConfig(model=ModelConfig(model=str(args.model), backend="cpu", num_threads=args.threads))
    llm = LLM(str(args.model), config=config)
    head = llm.engine.runner.model.lm_head
    kernel = head.gemv
    if kernel is None:
        raise SystemExit("the model's head takes no numba kernel here (not F16, or the generic ISA)")
    medians: dict[str, list[float]] = {"torch": [], "numba": []}
    for index in range(args.rounds + 1):
        for name in medians:
            head.gemv = kernel if name == "numba" else None
            steps = decode_steps(llm, f"{name}-{index}", args.decode_tokens)
            if index:  # round 0 warms up both
                medians[name].append(statistics.median(steps))
    for name, runs in medians.items():
        median = statistics.median(runs)
        runs_ms = ", ".join(f"{run * 1e3:.1f}" for run in runs)
        print(
            f"  decode, head by {name:5}: median step {median * 1e3:6.2f} ms ({1 / median:5.2f} tok/s); "
            f"runs {runs_ms}"
        )
    llm.close()


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--vocab", type=int, default=128256)
    parser.add_argument("--hidden", type=int, default=2560)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument(
        "--model", type=Path, default=None, help="also decode this F16-head GGUF, head swapped"
    )
    parser.add_argument("--decode-tokens", type=int, default=40)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    numba.set_num_threads(args.threads)
    print(
        f"{time.strftime('%Y-%m-%d %H:%M:%S %Z')}: flags {' '.join(cpu_flags())}, {args.threads} threads, "
        f"load average {load_average()}",
        flush=True,
    )
    head_alone(args)
    if args.model is not None:
        model_decode(args)
    print(f"load average at the end {load_average()} (pid {os.getpid()})")


if __name__ == "__main__":
    main()
