"""Offline batched decode: `LLM` generating N sequences at once (no HTTP), and where a step's time goes.

    python benchmarks/bench_batch_decode.py                        # 16 sequences x 100 tokens, 2 threads
    python benchmarks/bench_batch_decode.py --split --threads 1    # + CPU time per part of a decode step

Greedy, ignore_eos, short distinct prompts (one prefill step, then decode steps of N sequences). Prints
aggregate output tok/s of each repeat (prefill included) with the load average: other processes sharing
the cores move these numbers, so compare builds in the same run, alternating (RESULTS.md runs this file
from two checkouts in turn). --split wraps the lean decode step's parts (kernels/cpu/decode_glue.py, the
int8 GEMMs, the LM head, the sampler) with a clock, per decode step: process CPU time with 1 thread
(robust to other processes' load, unlike wall time), wall time otherwise. Timings only.
"""

from __future__ import annotations

import bitserve  # noqa: F401  (first: sets the OpenMP wait default before torch / numba load libgomp)

# isort: split

import argparse  # noqa: E402
import collections  # noqa: E402
import os
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bitserve.kernels.cpu import decode_glue, fast_decode, prepared  # noqa: E402
from bitserve.llm import LLM  # noqa: E402
from bitserve.sampling_params import SamplingParams  # noqa: E402

WORDS = "The history of computing is a story of machines that learned to do more with less".split()
GLUE = ("norm_quantize", "residual_norm_quantize", "rope_attend_quantize", "gated_quantize")


class StepSplit:
    """Clock totals of wrapped callables, counted only inside decode steps (armed by `step`)."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.totals: collections.Counter[str] = collections.Counter()
        self.armed = False
        self.steps = 0

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            if not self.armed:
                return fn(*args, **kwargs)
            start = self.clock()
            try:
                return fn(*args, **kwargs)
            finally:
                self.totals[name] += self.clock() - start

        return timed

    def report(self) -> None:
        for name, total in self.totals.most_common():
            print(f"  {name:34s} {total / max(self.steps, 1) * 1e3:8.2f} ms / decode step")


def is_decode_step(scheduler: Any) -> bool:
    """Whether the next step is one token for each running request and nothing waits (no prefill)."""
    running = scheduler.running
    pending = (r.num_tokens - r.num_computed_tokens for r in running)
    return bool(running) and scheduler.num_waiting == 0 and all(n == 1 for n in pending)


def install_split(llm: LLM, split: StepSplit) -> None:
    for name in GLUE:  # the fast step calls them through its module's `decode_glue`
        setattr(fast_decode.decode_glue, name, split.wrap(f"glue {name}", getattr(decode_glue, name)))
    linear = prepared.Int8BlockLinear
    linear.run_quantized = split.wrap("int8 GEMM (layers + head)", linear.run_quantized)
    model = llm.instance.loaded.model
    model.compute_logits = split.wrap("LM head (compute_logits)", model.compute_logits)
    if model.compiled is not None:
        model.compiled.run_layers = split.wrap("lean step (compiled.run_layers)", model.compiled.run_layers)
    sampler = type(llm.engine.runner.sampler)
    sampler.__call__ = split.wrap("sampler", sampler.__call__)
    engine = llm.engine
    step = split.wrap("Engine.step", engine.step)
    plain_step = engine.step

    def decode_steps_only() -> Any:
        if not is_decode_step(engine.scheduler):
            return plain_step()
        split.armed, split.steps = True, split.steps + 1
        try:
            return step()
        finally:
            split.armed = False

    engine.step = decode_steps_only


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--sequences", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=100)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--split", action="store_true", help="CPU (1 thread) or wall time per step part")
    args = parser.parse_args()
    llm = LLM(args.model, num_threads=args.threads)
    prompts = [" ".join(WORDS[i % 5 :]) + f" {i}" for i in range(args.sequences)]
    params = SamplingParams(max_tokens=args.max_tokens, temperature=0.0, ignore_eos=True)
    # warm-up at the measured batch size: numba compiles (or loads) each batch shape's kernels once
    llm.generate(prompts, SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True))
    split = StepSplit(time.process_time if args.threads == 1 else time.perf_counter)
    if args.split:
        install_split(llm, split)
    for repeat in range(args.repeats):
        start = time.perf_counter()
        outputs = llm.generate(prompts, params)
        elapsed = time.perf_counter() - start
        tokens = sum(len(output.outputs[0].token_ids) for output in outputs)
        load = os.getloadavg()[0]
        print(
            f"run {repeat}: {args.sequences} sequences, {tokens} tokens in {elapsed:.2f} s: "
            f"{tokens / elapsed:.1f} tok/s (load {load:.2f}, threads {args.threads})",
            flush=True,
        )
    if args.split:
        print(f"per decode step ({'CPU, 1 thread' if args.threads == 1 else 'wall'}; {split.steps} steps):")
        split.report()
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
