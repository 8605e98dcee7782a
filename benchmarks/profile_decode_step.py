r"""Where a single-stream decode step's time goes: a sampling profile (py-spy --native) split into
kernels and Python (issue 10's "per-step Python and dispatch time <= 3 ms on SmolLM2").

    python benchmarks/profile_decode_step.py                     # SmolLM2, 2 threads, ~6 s of decode
    python benchmarks/profile_decode_step.py --model PATH --seconds 10 --rate 250 --raw /tmp/stacks.txt

Loads the model with `LLM`, runs one request's prefill, then decode steps (`Engine.step`, greedy,
`ignore_eos`) for --seconds while `py-spy record --native` samples this process (the engine runs in the
main thread; numba's workers have no Python state, so the main thread's samples are the step's wall
time, its own share of the parallel kernels included). Each sample is put in one bucket by its
innermost frames:
- kernels: numba-compiled code (JIT frames have no symbol) or its thread pool, torch / BLAS math;
- numba dispatch: the dispatcher matching argument types before a compiled call;
- Python: the interpreter running bitserve's (and the stdlib's) Python code, including
  torch's Python-facing C++ glue (tensor creation, `.numpy()`, indexing);
- other native: libc (memcpy, malloc) and the rest.
py-spy pauses the process for each sample: expect a few % on top of the unprofiled step time, which is
measured first, without py-spy, for the same number of steps. Timings are whatever the machine gives.
"""

from __future__ import annotations

import argparse
import collections
import os
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from bitserve import LLM, SamplingParams  # noqa: E402
from bitserve.config import EngineConfig, ModelConfig  # noqa: E402
from bitserve.engine.messages import EngineRequest  # noqa: E402

KERNEL_MARKERS = ("libgomp", "libiomp", "tbb", "workqueue", "omppool", "libtorch_cpu", "mkl", "sleef")
DISPATCH_MARKERS = ("_dispatcher", "numba/core/dispatcher", "typeof", "_helperlib")
PYTHON_MARKERS = ("libpython", "_PyEval", "PyObject_", "_PyObject", "python3.", "libtorch_python")
MIN_PROFILED_S = 3.0  # decoding under py-spy, whatever --seconds (profiled_steps says why)


def frame_kind(frame: str) -> str:
    """ "python" for a Python-level frame (py-spy writes `func (file.py:line)`), else the native
    library or symbol text."""
    return "python" if ".py:" in frame or frame.endswith(".py)") else "native"


def bucket(stack: list[str]) -> str:
    """One bucket for a sample, from its innermost frames (see the module docstring)."""
    leaf = stack[-1]
    native_tail = []
    for frame in reversed(stack):
        if frame_kind(frame) == "python":
            break
        native_tail.append(frame)
    if not native_tail:
        return "Python"
    text = " ".join(native_tail)
    if any(marker in text for marker in DISPATCH_MARKERS):
        return "numba dispatch"
    if leaf.startswith("0x") or "???" in leaf or any(marker in text for marker in KERNEL_MARKERS):
        return "kernels"
    if any(marker in text for marker in PYTHON_MARKERS):
        return "Python"
    return "other native"


def read_stacks(path: Path) -> collections.Counter[tuple[str, ...]]:
    """py-spy's raw (collapsed) output: `frame;frame;...;frame count` per line."""
    stacks: collections.Counter[tuple[str, ...]] = collections.Counter()
    for line in path.read_text().splitlines():
        frames, _, count = line.rpartition(" ")
        if frames and count.isdigit():
            stacks[tuple(frames.split(";"))] += int(count)
    return stacks


def decode_steps(llm: LLM, prompt_ids: list[int], seconds: float, max_steps: int | None) -> tuple[int, float]:
    """Decode steps of one greedy request for `seconds` (or `max_steps`); (steps, wall seconds)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=max_steps or 100_000, temperature=0.0, ignore_eos=True)
    request_id = f"profile-{time.monotonic_ns()}"
    engine.add_request(EngineRequest(request_id, tuple(prompt_ids), params, llm.tokenizer.eos_token_ids))
    engine.step()  # the prefill
    num_steps, start = 0, time.perf_counter()
    while engine.has_unfinished_requests():
        engine.step()
        num_steps += 1
        if max_steps is None and time.perf_counter() - start >= seconds:
            break
    wall = time.perf_counter() - start
    engine.abort_requests([request_id])
    while engine.has_unfinished_requests():
        engine.step()
    return num_steps, wall


def profiled_steps(llm: LLM, prompt_ids: list[int], min_steps: int) -> tuple[int, float]:
    """At least `min_steps` decode steps and MIN_PROFILED_S of decoding (requests renewed where one runs
    out of context): py-spy --native can take over a second to attach on a busy machine (reading the
    symbols of libtorch), and a short run then ended before its first sample (seen in CI). (steps, wall)."""
    steps, wall = decode_steps(llm, prompt_ids, 0.0, min_steps)
    while wall < MIN_PROFILED_S:
        more_steps, more_wall = decode_steps(llm, prompt_ids, MIN_PROFILED_S - wall, None)
        steps, wall = steps + more_steps, wall + more_wall
    return steps, wall


def top_python_frames(stacks: collections.Counter[tuple[str, ...]], top: int) -> list[tuple[str, int]]:
    """Innermost Python frame of the samples bucketed as Python or numba dispatch."""
    counts: collections.Counter[str] = collections.Counter()
    for stack, count in stacks.items():
        if bucket(list(stack)) in ("Python", "numba dispatch"):
            python_frames = [frame for frame in stack if frame_kind(frame) == "python"]
            counts[python_frames[-1] if python_frames else stack[-1]] += count
    return counts.most_common(top)


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model", default="smollm2-135m-instruct")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--prompt-tokens", type=int, default=8)
    parser.add_argument("--seconds", type=float, default=6.0, help="profiled decode time")
    parser.add_argument("--rate", type=int, default=200, help="py-spy samples per second")
    parser.add_argument("--raw", type=Path, default=None, help="keep py-spy's collapsed stacks here")
    parser.add_argument("--top", type=int, default=12)
    args = parser.parse_args()

    llm = LLM(args.model, config=EngineConfig(model=ModelConfig(model=args.model, num_threads=args.threads)))
    prompt_ids = [llm.tokenizer.bos_token_id or 1] + list(range(100, 100 + args.prompt_tokens - 1))
    decode_steps(llm, prompt_ids, 1.0, None)  # warm up: numba compiles, caches fill
    steps, wall = decode_steps(llm, prompt_ids, args.seconds, None)
    plain_ms = wall / steps * 1e3
    print(f"unprofiled: {steps} decode steps, {plain_ms:.2f} ms/step ({1e3 / plain_ms:.1f} tok/s)")

    raw = args.raw or Path(tempfile.mkdtemp()) / "stacks.txt"
    spy = subprocess.Popen(
        ["py-spy", "record", "--native", "--rate", str(args.rate), "--format", "raw", "-o", str(raw)]
        + ["--pid", str(os.getpid())],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    time.sleep(1.0)  # attach; idle samples (this sleep) are dropped by py-spy
    steps, wall = profiled_steps(llm, prompt_ids, steps)
    spy.send_signal(signal.SIGINT)
    spy.wait(timeout=60)
    profiled_ms = wall / steps * 1e3
    stacks = read_stacks(raw) if raw.exists() else collections.Counter()
    total = sum(stacks.values())
    if not total:
        llm.close()
        raise SystemExit(f"py-spy wrote no samples to {raw} (can it ptrace this process? try as root)")
    buckets: collections.Counter[str] = collections.Counter()
    for stack, count in stacks.items():
        buckets[bucket(list(stack))] += count
    print(f"profiled: {steps} steps, {profiled_ms:.2f} ms/step, {total} samples at {args.rate}/s")
    for name in ("kernels", "numba dispatch", "Python", "other native"):
        share = buckets[name] / total if total else 0.0
        print(f"  {name:15s} {share:6.1%}  {share * plain_ms:6.2f} ms of the unprofiled step")
    print("innermost Python frames of the Python and dispatch samples:")
    for frame, count in top_python_frames(stacks, args.top):
        print(f"  {count / total:6.1%}  {count / total * plain_ms:6.2f} ms  {frame}")
    llm.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
