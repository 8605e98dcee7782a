"""Whole-model runtime benchmark (issue 2): bitserve beside llama.cpp, in one process.

    python benchmarks/bench_model.py                  # 2B-4T-shaped I2_S + SmolLM2 vs llama.cpp
    python benchmarks/bench_model.py --tq2 --json benchmarks/out/bench.json
    python benchmarks/bench_model.py --skip-2b        # SmolLM2 only (fast)
    python benchmarks/bench_model.py --skip-2b --skip-smollm2 --dense-ab   # SmolLM2 f32 copies or not

Measures, with 2 threads and bitserve's OpenMP wait default (a bounded spin; llama.cpp runs in this process
and shares it):
- 2B-4T-shaped `bitnet-b1.58` I2_S file (random ternary weights, made by make_2b4t_model.py into
  benchmarks/out/ when missing): load time (`LLM(path)`, backend "auto", then again with "cpu"),
  resident memory sampled from /proc/self/status while generating, prefill tok/s (a ~128-token
  prompt, time to first token) and decode tok/s (greedy, ignore_eos), plus a cProfile of decode steps.
- SmolLM2-135M-Instruct Q4_1: the same numbers for bitserve and llama.cpp (llama-cpp-python), run
  alternately on the same token ids, and their ratios.
- --tq2: the same 2B weights as TQ2_0 (arch `bitnet`) through llama.cpp, beside bitserve's I2_S, and
  beside bitserve loading that same TQ2_0 file.
- --fast-decode-ab: the 2B I2_S file on the cpu backend with its lean decode step
  (kernels/cpu/fast_decode.py) on and off, alternating, and a cProfile of decode steps each way.
- --dense-ab: SmolLM2 in bitserve with a 1 GiB f32 copy budget (`max_dense_weight_bytes`, the default
  before 53b7e63) beside none (0, today's default: packed Q4_1 blocks only), alternating; load time and RSS
  growth of each load.
bitserve is driven through its Engine one step at a time (no detokenization); llama.cpp through
`Llama.eval` with a greedy argmax over the last logits. Timings only; nothing is asserted.
"""

from __future__ import annotations

import bitserve  # noqa: F401  (first: sets the OpenMP wait default before torch / numba load libgomp)

# isort: split

import argparse  # noqa: E402
import cProfile  # noqa: E402
import gc  # noqa: E402
import json  # noqa: E402
import os
import pstats  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import threading  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from pathlib import Path  # noqa: E402
from typing import Any  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bitserve.engine.messages import EngineRequest  # noqa: E402
from bitserve.kernels.select import cpu_kernel_choices  # noqa: E402
from bitserve.llm import LLM  # noqa: E402
from bitserve.loader.catalog import resolve_model  # noqa: E402
from bitserve.sampling_params import SamplingParams  # noqa: E402

OUT_DIR = ROOT / "benchmarks" / "out"
TEXT = (
    "The history of computing is a story of machines that learned to do more with less. Early "
    "calculators filled rooms and consumed the power of a small town, yet they could only add and "
    "multiply a few thousand numbers each second. Transistors replaced vacuum tubes, integrated "
    "circuits replaced hand-wired boards, and each generation of engineers found new ways to pack "
    "more logic into less space. Today a phone in a pocket holds billions of transistors and runs "
    "programs that translate languages, recognise faces and answer questions in plain English. "
    "Language models are the newest chapter: they predict the next word of a text, one token at a "
    "time, and their cost is dominated by reading their weights from memory for every token. "
    "Ternary models store each weight as minus one, zero or plus one, which cuts that memory "
    "traffic several times over and lets a modest processor keep up with a human reader. The "
    "engineering question is no longer whether such models can run on a laptop, but how quickly, "
    "how cheaply and how reliably they can serve many people at once."
)


# ------------------------------------------------------------------------------------------ memory
def proc_status_kb(*fields: str) -> dict[str, int]:
    """Selected fields of /proc/self/status in kB (VmRSS, VmHWM, RssAnon, RssFile, ...)."""
    out = {}
    with open("/proc/self/status", encoding="ascii") as fh:
        for line in fh:
            name, _, rest = line.partition(":")
            if name in fields:
                out[name] = int(rest.split()[0])
    return out


class RssSampler:
    """Samples VmRSS (with its anon / file split) every `interval_s` in a thread; keeps the peak."""

    def __init__(self, interval_s: float = 0.02) -> None:
        self.interval_s = interval_s
        self.peak: dict[str, int] = {"VmRSS": 0, "RssAnon": 0, "RssFile": 0}
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.sample()
            self._stop.wait(self.interval_s)

    def sample(self) -> None:
        now = proc_status_kb("VmRSS", "RssAnon", "RssFile")
        if now.get("VmRSS", 0) > self.peak["VmRSS"]:
            self.peak = now

    def __enter__(self) -> RssSampler:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.sample()


def mb(kb: int) -> float:
    return kb / 1024.0


# ------------------------------------------------------------------------------------------ prompts
def prompt_ids(base: Sequence[int], length: int, variant: int) -> list[int]:
    """`length` ids cut from `base` repeated, starting at a variant-dependent offset, so each variant
    starts with different tokens (bitserve's prefix cache never serves a measured prompt)."""
    start = (variant * 7) % len(base)
    ids = list(base[start:]) + list(base) * (length // len(base) + 1)
    return ids[:length]


# ------------------------------------------------------------------------------------------ bitserve
def bitserve_generate(
    llm: LLM, ids: Sequence[int], max_tokens: int, tag: str, on_step: Callable[[int], None] | None = None
) -> tuple[list[float], list[int]]:
    """Greedy-generate through the engine; returns each step's wall time and the generated ids."""
    engine = llm.engine
    params = SamplingParams(max_tokens=max_tokens, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest(tag, tuple(ids), params, llm.tokenizer.eos_token_ids))
    step_times, tokens = [], []
    while engine.has_unfinished_requests():
        if on_step is not None:
            on_step(len(step_times))
        start = time.perf_counter()
        result = engine.step()
        step_times.append(time.perf_counter() - start)
        for output in result.outputs:
            tokens.extend(output.new_token_ids)
    return step_times, tokens


class BitserveRunner:
    """Prefill / decode measurements of one loaded bitserve model; request ids stay unique."""

    def __init__(self, llm: LLM, name: str = "bitserve") -> None:
        self.llm = llm
        self.name = name
        self._count = 0

    def _tag(self) -> str:
        self._count += 1
        return f"bench-{self.name}-{self._count}"

    def prefill(self, ids: Sequence[int]) -> float:
        """Seconds to the first token of a fresh prompt (prompt forward + LM head + sampling)."""
        return sum(bitserve_generate(self.llm, ids, 1, self._tag())[0])

    def decode(self, ids: Sequence[int], num_tokens: int) -> tuple[list[float], list[int]]:
        """Per-token decode step times (prefill step dropped) and all generated ids."""
        times, tokens = bitserve_generate(self.llm, ids, num_tokens + 1, self._tag())
        return times[1:], tokens


class FastStepRunner(BitserveRunner):
    """A BitserveRunner whose model runs with the given fast decode step (None: the module forward)."""

    def __init__(self, llm: LLM, name: str, fast_decode: Any) -> None:
        super().__init__(llm, name)
        self.fast_decode = fast_decode

    def switch(self) -> None:
        self.llm.instance.loaded.model.compiled = self.fast_decode

    def prefill(self, ids: Sequence[int]) -> float:
        self.switch()
        return super().prefill(ids)

    def decode(self, ids: Sequence[int], num_tokens: int) -> tuple[list[float], list[int]]:
        self.switch()
        return super().decode(ids, num_tokens)


# ------------------------------------------------------------------------------------------ llama.cpp
class LlamaCppRunner:
    """The same measurements through llama-cpp-python's Llama.eval and a greedy argmax."""

    name = "llama.cpp"

    def __init__(self, path: Path, threads: int, n_ctx: int = 1024) -> None:
        import llama_cpp

        self._llama_cpp = llama_cpp
        start = time.perf_counter()
        self.llm = llama_cpp.Llama(
            str(path), n_threads=threads, n_threads_batch=threads, n_ctx=n_ctx, verbose=False
        )
        self.load_s = time.perf_counter() - start
        self.n_vocab = self.llm.n_vocab()

    def _argmax(self) -> int:
        logits = np.ctypeslib.as_array(self._llama_cpp.llama_get_logits(self.llm.ctx), shape=(self.n_vocab,))
        return int(np.argmax(logits))

    def prefill(self, ids: Sequence[int]) -> float:
        self.llm.reset()
        start = time.perf_counter()
        self.llm.eval(list(ids))
        self._argmax()
        return time.perf_counter() - start

    def decode(self, ids: Sequence[int], num_tokens: int) -> tuple[list[float], list[int]]:
        self.llm.reset()
        self.llm.eval(list(ids))
        tokens = [self._argmax()]
        times = []
        for _ in range(num_tokens):
            start = time.perf_counter()
            self.llm.eval([tokens[-1]])
            tokens.append(self._argmax())
            times.append(time.perf_counter() - start)
        return times, tokens

    def close(self) -> None:
        self.llm.close()


# ------------------------------------------------------------------------------------------ measurement
def measure(
    runner: Any, base_ids: Sequence[int], args: argparse.Namespace, variant: int, num_prefills: int = 1
) -> dict[str, Any]:
    """Prefill run(s) (median kept) and one decode run of `runner`; prompts depend on `variant` and
    are never reused, so bitserve's prefix cache serves none of them."""
    prefill_runs = []
    for index in range(num_prefills):
        prefill_ids = prompt_ids(base_ids, args.prefill_tokens, 2 * (variant + 100 * index))
        prefill_runs.append(runner.prefill(prefill_ids))
    prefill_s = statistics.median(prefill_runs)
    times, tokens = runner.decode(
        prompt_ids(base_ids, args.decode_prompt_tokens, 2 * variant + 1), args.decode_tokens
    )
    median_step = statistics.median(times)
    return {
        "prefill_tokens": args.prefill_tokens,
        "prefill_runs_s": prefill_runs,
        "prefill_s": prefill_s,
        "prefill_tok_s": args.prefill_tokens / prefill_s,
        "decode_tokens": len(times),
        "decode_s": sum(times),
        "decode_tok_s": len(times) / sum(times),
        "decode_median_step_ms": median_step * 1e3,
        "decode_tok_s_median_step": 1.0 / median_step,
        "tokens": tokens,
    }


def best_of(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Median over repeats of each rate (noise on a shared machine only ever slows a run down)."""
    keys = ("prefill_tok_s", "decode_tok_s", "decode_tok_s_median_step", "decode_median_step_ms")
    merged = {k: statistics.median(r[k] for r in runs) for k in keys}
    merged["repeats"] = len(runs)
    merged["tokens"] = runs[0]["tokens"]
    return merged


def warm_up(runner: Any, base_ids: Sequence[int], args: argparse.Namespace) -> None:
    """Compile / load numba kernels and touch the weights: both the GEMV and the GEMM paths."""
    runner.prefill(prompt_ids(base_ids, args.prefill_tokens, 1000))
    runner.decode(prompt_ids(base_ids, args.decode_prompt_tokens, 1001), 2)


def compare(
    pairs: list[tuple[Any, Any]], base_ids: Sequence[int], args: argparse.Namespace
) -> dict[str, Any]:
    """Runs each (bitserve, llama.cpp) pair alternately `args.repeats` times on the same prompts."""
    results: dict[str, list[dict[str, Any]]] = {}
    for runner_a, runner_b in pairs:
        warm_up(runner_a, base_ids, args)
        warm_up(runner_b, base_ids, args)
        for repeat in range(args.repeats):
            for runner in (runner_a, runner_b):
                results.setdefault(runner.name, []).append(measure(runner, base_ids, args, repeat))
    return {name: best_of(runs) for name, runs in results.items()}


def agreement(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the common prefix of two greedy generations."""
    count = 0
    for x, y in zip(a, b, strict=False):
        if x != y:
            break
        count += 1
    return count


# ------------------------------------------------------------------------------------------ profile
def _code_key(func: Any) -> tuple[str, int, str]:
    code = getattr(func, "py_func", func).__code__  # numba dispatchers keep the Python function
    return (code.co_filename, code.co_firstlineno, code.co_name)


def profile_categories() -> list[tuple[str, Any]]:
    """(label, function) whose cumulative time is one part of a decode step."""
    from bitserve.core.scheduler import Scheduler
    from bitserve.engine.engine import Engine
    from bitserve.kernels.cpu import decode_glue, int8dot, ternary
    from bitserve.kernels.cpu.backend import CpuBackend
    from bitserve.kernels.cpu.fast_decode import FastCpuDecode
    from bitserve.layers.activation import relu2_and_mul
    from bitserve.layers.attention import PagedAttention
    from bitserve.layers.embedding import LMHead, TokenEmbedding
    from bitserve.layers.linear import Linear, LinearGroup
    from bitserve.layers.norm import RMSNorm
    from bitserve.layers.rotary import RotaryEmbedding
    from bitserve.layers.sampler import Sampler
    from bitserve.runner.input_batch import build_batch_inputs

    return [
        ("engine step (total)", Engine.step),
        ("LM head (LMHead.forward)", LMHead.forward),
        ("linears: groups (LinearGroup.forward)", LinearGroup.forward),
        ("linears: single (Linear.forward)", Linear.forward),
        # numba dispatchers are profiled under their Python function's code (see _code_key)
        ("  int8dot GEMV kernel, avx2 (avx2_gemv)", int8dot.avx2_gemv),
        ("  int8dot GEMM kernel, avx2 (avx2_gemm)", int8dot.avx2_gemm),
        ("  int8dot GEMV kernel, vnni (vnni_gemv)", int8dot.vnni_gemv),
        ("  int8dot GEMM kernel, vnni (vnni_gemm)", int8dot.vnni_gemm),
        ("  int8 activation quantize (quantize_int8)", int8dot.quantize_int8),
        ("  generic GEMV kernel (bitnet_linear_kernel)", ternary.bitnet_linear_kernel),
        ("  generic activation quantize (quantize_int16)", ternary.quantize_int16),
        ("attention (PagedAttention.forward)", PagedAttention.forward),
        ("RMSNorm (all)", RMSNorm.forward),
        ("RoPE (RotaryEmbedding.forward)", RotaryEmbedding.forward),
        ("relu2 * up (torch)", relu2_and_mul),
        ("relu2 * up (cpu backend, numba)", CpuBackend.relu2_and_mul),
        ("fast decode step (FastCpuDecode.run_layers)", FastCpuDecode.run_layers),
        ("  glue: norm + quantize (first layer)", decode_glue.norm_quantize),
        ("  glue: residual + norm + quantize", decode_glue.residual_norm_quantize),
        ("  glue: RoPE + KV write + attention + sub-norm + quantize", decode_glue.rope_attend_quantize),
        ("  glue: relu2 / SiLU * up + sub-norm + quantize", decode_glue.gated_quantize),
        ("embedding lookup (TokenEmbedding.forward)", TokenEmbedding.forward),
        ("sampler (Sampler.__call__)", Sampler.__call__),
        ("scheduler schedule()", Scheduler.schedule),
        ("scheduler update()", Scheduler.update),
        ("batch inputs (build_batch_inputs)", build_batch_inputs),
    ]


def profile_decode(llm: LLM, ids: Sequence[int], num_steps: int, top: int = 15) -> dict[str, Any]:
    """cProfile `num_steps` decode steps (the prefill step runs unprofiled first)."""
    engine = llm.engine
    params = SamplingParams(max_tokens=num_steps + 1, temperature=0.0, ignore_eos=True)
    engine.add_request(EngineRequest("bench-profile", tuple(ids), params, llm.tokenizer.eos_token_ids))
    engine.step()
    profiler = cProfile.Profile()
    num_profiled, wall = 0, 0.0
    while engine.has_unfinished_requests():
        start = time.perf_counter()
        profiler.enable()
        engine.step()
        profiler.disable()
        wall += time.perf_counter() - start
        num_profiled += 1
    stats = pstats.Stats(profiler).stats  # type: ignore[attr-defined]
    categories = []
    for label, func in profile_categories():
        entry = stats.get(_code_key(func))
        calls, cumulative = (entry[1], entry[3]) if entry else (0, 0.0)
        categories.append(
            {
                "label": label,
                "ms_per_step": cumulative / num_profiled * 1e3,
                "calls_per_step": calls / num_profiled,
            }
        )
    rows = sorted(stats.items(), key=lambda item: item[1][2], reverse=True)[:top]
    top_rows = [
        {
            "function": f"{Path(k[0]).name}:{k[1]}({k[2]})" if k[0] != "~" else k[2],
            "ms_per_step": v[2] / num_profiled * 1e3,
            "calls_per_step": v[1] / num_profiled,
        }
        for k, v in rows
    ]
    return {
        "steps": num_profiled,
        "wall_ms_per_step": wall / num_profiled * 1e3,
        "categories": categories,
        "top_tottime": top_rows,
    }


def print_profile(profile: dict[str, Any]) -> None:
    total = profile["categories"][0]["ms_per_step"] or 1.0
    print(
        f"\ncProfile of {profile['steps']} decode steps "
        f"(wall {profile['wall_ms_per_step']:.1f} ms/step under the profiler)"
    )
    print(f"  {'part of the step':50} {'ms/step':>9} {'share':>6} {'calls':>6}")
    for row in profile["categories"]:
        print(
            f"  {row['label']:50} {row['ms_per_step']:9.1f} "
            f"{row['ms_per_step'] / total:6.1%} {row['calls_per_step']:6.0f}"
        )
    print(f"  top functions by own time:\n  {'function':60} {'ms/step':>9} {'calls':>6}")
    for row in profile["top_tottime"]:
        print(f"  {row['function'][:60]:60} {row['ms_per_step']:9.1f} {row['calls_per_step']:6.0f}")


# ------------------------------------------------------------------------------------------ sections
def ensure_model(path: Path, fmt: str, num_layers: int) -> Path:
    """Make the synthetic 2B file in a child process when missing (keeps this process's RSS clean)."""
    if not path.exists():
        print(f"generating {path} ({fmt}, {num_layers} layers) ...", flush=True)
        script = ROOT / "benchmarks" / "make_2b4t_model.py"
        subprocess.run(
            [sys.executable, str(script), str(path), "--format", fmt, "--layers", str(num_layers)], check=True
        )
    return path


def load_timed(path: Path, backend: str) -> tuple[LLM, float, dict[str, int]]:
    with RssSampler() as sampler:
        start = time.perf_counter()
        llm = LLM(str(path), backend=backend)
        seconds = time.perf_counter() - start
    return llm, seconds, sampler.peak


def bench_2b(args: argparse.Namespace, report: dict[str, Any]) -> list[int]:
    """Load twice, measure memory, prefill, decode and the profile on the I2_S file; returns decode ids."""
    path = ensure_model(args.model_2b, "I2_S", args.layers)
    before = proc_status_kb("VmRSS")["VmRSS"]
    llm, load_auto_s, load_peak = load_timed(path, "auto")
    after_load = proc_status_kb("VmRSS", "RssAnon", "RssFile")
    runner = BitserveRunner(llm)
    base_ids = llm.tokenizer.encode(TEXT, add_special=False)
    warm_up(runner, base_ids, args)
    with RssSampler() as sampler:
        run = measure(runner, base_ids, args, 0, num_prefills=args.repeats)
    section = {
        "file": str(path),
        "file_bytes": path.stat().st_size,
        "load_auto_s": load_auto_s,
        "weights_load_s": llm.instance.loaded.load_seconds,
        "rss_before_load_mb": mb(before),
        "rss_load_peak_mb": mb(load_peak["VmRSS"]),
        "rss_after_load_mb": mb(after_load["VmRSS"]),
        "rss_after_load_anon_mb": mb(after_load["RssAnon"]),
        "rss_after_load_file_mb": mb(after_load["RssFile"]),
        "rss_generate_peak_mb": mb(sampler.peak["VmRSS"]),
        "rss_generate_peak_anon_mb": mb(sampler.peak["RssAnon"]),
        "rss_generate_peak_file_mb": mb(sampler.peak["RssFile"]),
        "vm_hwm_mb": mb(proc_status_kb("VmHWM")["VmHWM"]),
        **{k: v for k, v in run.items() if k != "tokens"},
    }
    if args.profile_steps:
        section["profile"] = profile_decode(
            llm, prompt_ids(base_ids, args.decode_prompt_tokens, 77), args.profile_steps
        )
    llm.close()
    del llm, runner
    gc.collect()
    llm, section["load_cpu_s"], _ = load_timed(path, "cpu")
    llm.close()
    del llm
    gc.collect()
    report["2b_i2s"] = section
    return run["tokens"]


def bench_smollm2(args: argparse.Namespace, report: dict[str, Any]) -> None:
    path = args.smollm2_file or resolve_model("smollm2-135m-instruct")
    start = time.perf_counter()
    llm = LLM(str(path), cpu_isa=args.cpu_isa)
    bitserve_load_s = time.perf_counter() - start
    llama = LlamaCppRunner(path, args.threads)
    base_ids = llm.tokenizer.encode(TEXT, add_special=False)
    results = compare([(BitserveRunner(llm), llama)], base_ids, args)
    results["bitserve"]["load_s"], results["llama.cpp"]["load_s"] = bitserve_load_s, llama.load_s
    results["greedy_agreement"] = agreement(results["bitserve"]["tokens"], results["llama.cpp"]["tokens"])
    results["file"] = Path(path).name
    report["smollm2"] = results
    llama.close()
    llm.close()


DENSE_NAMES = ("f32-copy-1GiB", "packed-only")


def bench_smollm2_dense(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """A 1 GiB f32 dense budget against none, on SmolLM2, alternating in this process."""
    path = resolve_model("smollm2-135m-instruct")
    runners, loads = [], {}
    for name, budget in zip(DENSE_NAMES, (1 << 30, 0), strict=True):
        before = proc_status_kb("VmRSS")["VmRSS"]
        start = time.perf_counter()
        llm = LLM(str(path), max_dense_weight_bytes=budget)
        loads[name] = (time.perf_counter() - start, mb(proc_status_kb("VmRSS")["VmRSS"] - before))
        runners.append(BitserveRunner(llm, name))
    base_ids = runners[0].llm.tokenizer.encode(TEXT, add_special=False)
    results = compare([(runners[0], runners[1])], base_ids, args)
    for name, (load_s, rss_mb) in loads.items():
        results[name]["load_s"], results[name]["rss_growth_mb"] = load_s, rss_mb
    results["greedy_agreement"] = agreement(*(results[name]["tokens"] for name in DENSE_NAMES))
    report["smollm2_dense"] = results
    for runner in runners:
        runner.llm.close()


def bench_2b_tq2(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """llama.cpp on the TQ2_0 twin beside bitserve on the I2_S file, then beside bitserve on the same
    TQ2_0 file (all three loaded: RSS not measured). Each pair alternates on its own, so each ratio
    comes from one stretch of machine load."""
    i2s = ensure_model(args.model_2b, "I2_S", args.layers)
    tq2 = ensure_model(args.model_2b_tq2, "TQ2_0", args.layers)
    llm = LLM(str(i2s))
    start = time.perf_counter()
    llm_tq2 = LLM(str(tq2))
    tq2_load_s = time.perf_counter() - start
    llama = LlamaCppRunner(tq2, args.threads)
    base_ids = llm.tokenizer.encode(TEXT, add_special=False)
    tq2_args = argparse.Namespace(**{**vars(args), "repeats": 1})
    for key, bitserve_llm in (("2b_tq2_vs_i2s", llm), ("2b_tq2_vs_tq2", llm_tq2)):
        results = compare([(BitserveRunner(bitserve_llm), llama)], base_ids, tq2_args)
        results["llama.cpp"]["load_s"] = llama.load_s
        report[key] = results
    report["2b_tq2_vs_tq2"]["bitserve"]["load_s"] = tq2_load_s
    llama.close()
    llm_tq2.close()
    llm.close()


FAST_NAMES = ("fast-step-on", "fast-step-off")


def bench_fast_decode_ab(args: argparse.Namespace, report: dict[str, Any]) -> None:
    """The 2B I2_S file on the cpu backend, its lean decode step on and off in turn (same model, same
    prompts), then a cProfile of decode steps each way."""
    path = ensure_model(args.model_2b, "I2_S", args.layers)
    llm = LLM(str(path), backend="cpu")
    model = llm.instance.loaded.model
    fast = model.compiled
    if fast is None:
        raise SystemExit(f"{path}: no fast decode step on the cpu backend (see kernels/cpu/fast_decode.py)")
    on, off = (FastStepRunner(llm, name, step) for name, step in zip(FAST_NAMES, (fast, None), strict=True))
    base_ids = llm.tokenizer.encode(TEXT, add_special=False)
    results = compare([(on, off)], base_ids, args)
    results["greedy_agreement"] = agreement(results[on.name]["tokens"], results[off.name]["tokens"])
    if args.profile_steps:
        for runner in (on, off):
            runner.switch()
            ids = prompt_ids(base_ids, args.decode_prompt_tokens, 77)
            results[runner.name]["profile"] = profile_decode(llm, ids, args.profile_steps)
    model.compiled = fast
    report["2b_fast_decode"] = results
    llm.close()


# ------------------------------------------------------------------------------------------ report
def machine_info() -> dict[str, Any]:
    cpu = next(
        (
            line.split(":", 1)[1].strip()
            for line in open("/proc/cpuinfo", encoding="ascii")
            if line.startswith("model name")
        ),
        "?",
    )
    mem_kb = next(
        int(line.split()[1])
        for line in open("/proc/meminfo", encoding="ascii")
        if line.startswith("MemTotal")
    )
    return {
        "date": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "nproc": os.cpu_count(),
        "cpu": cpu,
        "ram_gib": round(mem_kb / 2**20, 1),
        "torch": torch.__version__,
        "python": sys.version.split()[0],
        "omp_wait_policy": os.environ.get("OMP_WAIT_POLICY"),
        "gomp_spincount": os.environ.get("GOMP_SPINCOUNT"),
        "loadavg_start": os.getloadavg(),
        "cpu_flags": _vector_flags(),
        "cpu_kernels": cpu_kernel_choices(),  # the cpu backend's ISA variant and block activations here
    }


def _vector_flags() -> list[str]:
    """The /proc/cpuinfo flags that pick the kernels (avx2, fma, f16c, avx512*, avx_vnni)."""
    with open("/proc/cpuinfo", encoding="ascii") as cpuinfo:
        flags = next((line.split(":", 1)[1].split() for line in cpuinfo if line.startswith("flags")), [])
    return sorted(f for f in flags if f in ("avx2", "fma", "f16c", "avx_vnni") or f.startswith("avx512"))


def print_pair(
    title: str, results: dict[str, Any], names: tuple[str, str] = ("bitserve", "llama.cpp")
) -> None:
    a, b = results[names[0]], results[names[1]]
    print(f"\n{title} (median of {a['repeats']} alternating runs)")
    ratio = f"ratio {names[0][0]}/{names[1][0]}"  # "ratio b/l": bitserve / llama.cpp
    print(f"  {'':22} {names[0]:>13} {names[1]:>13} {ratio:>10}")
    for key, label in (
        ("prefill_tok_s", "prefill tok/s"),
        ("decode_tok_s", "decode tok/s"),
        ("decode_tok_s_median_step", "decode tok/s (med step)"),
        ("decode_median_step_ms", "decode ms/token (med)"),
        ("load_s", "load s"),
        ("rss_growth_mb", "RSS growth of load, MB"),
    ):
        if key in a and key in b:
            print(f"  {label:22} {a[key]:13.2f} {b[key]:13.2f} {a[key] / b[key]:10.3f}")
    if "greedy_agreement" in results:
        print(
            f"  greedy tokens identical before the first difference: "
            f"{results['greedy_agreement']} of {len(a['tokens'])}"
        )


def print_report(report: dict[str, Any]) -> None:
    info = report["machine"]
    print(
        f"\n{info['date']}: {info['nproc']} CPUs ({info['cpu']}), {info['ram_gib']} GiB, "
        f"torch {info['torch']}, OMP_WAIT_POLICY={info['omp_wait_policy']}, "
        f"GOMP_SPINCOUNT={info['gomp_spincount']}, "
        f"load average {info['loadavg_start']} -> {info.get('loadavg_end')}"
    )
    print(f"CPU flags: {' '.join(info['cpu_flags'])}; cpu kernels: {info['cpu_kernels']}")
    section = report.get("2b_i2s")
    if section:
        print(f"\n2B-4T-shaped I2_S ({section['file']}, {section['file_bytes'] / 1e9:.2f} GB)")
        print(
            f"  load: {section['load_auto_s']:.1f} s (auto; weights {section['weights_load_s']:.1f} s), "
            f"{section['load_cpu_s']:.1f} s (cpu)"
        )
        print(
            f"  RSS: {section['rss_before_load_mb']:.0f} MB before load, "
            f"peak {section['rss_load_peak_mb']:.0f} MB while loading, "
            f"{section['rss_after_load_mb']:.0f} MB after (anon {section['rss_after_load_anon_mb']:.0f} "
            f"+ file {section['rss_after_load_file_mb']:.0f})"
        )
        print(
            f"  RSS while generating: peak {section['rss_generate_peak_mb']:.0f} MB "
            f"(anon {section['rss_generate_peak_anon_mb']:.0f} "
            f"+ file {section['rss_generate_peak_file_mb']:.0f}); goal <= 2048 MB; "
            f"VmHWM {section['vm_hwm_mb']:.0f} MB"
        )
        print(
            f"  prefill: {section['prefill_tok_s']:.2f} tok/s ({section['prefill_tokens']} tokens, median of "
            f"{', '.join(f'{t:.2f}' for t in section['prefill_runs_s'])} s; time to first token)"
        )
        print(
            f"  decode:  {section['decode_tok_s']:.3f} tok/s "
            f"({section['decode_tokens']} tokens in {section['decode_s']:.1f} s, "
            f"median step {section['decode_median_step_ms']:.0f} ms = "
            f"{section['decode_tok_s_median_step']:.3f} tok/s)"
        )
        if "profile" in section:
            print_profile(section["profile"])
    if "smollm2" in report:
        print_pair(f"SmolLM2-135M-Instruct, {report['smollm2']['file']}", report["smollm2"])
    if "smollm2_dense" in report:
        print_pair(
            "SmolLM2-135M-Instruct Q4_1: bitserve --max-dense-weight-bytes 1 GiB vs 0",
            report["smollm2_dense"],
            DENSE_NAMES,
        )
    if "2b_tq2_vs_i2s" in report:
        print_pair(
            "2B-4T-shaped: bitserve I2_S (bitnet-b1.58) vs llama.cpp TQ2_0 (bitnet), same ternary weights",
            report["2b_tq2_vs_i2s"],
        )
    if "2b_fast_decode" in report:
        results = report["2b_fast_decode"]
        print_pair("2B-4T-shaped I2_S, cpu backend: lean decode step on / off", results, FAST_NAMES)
        for name in FAST_NAMES:
            if "profile" in results[name]:
                print(f"\n{name}:")
                print_profile(results[name]["profile"])
    if "2b_tq2_vs_tq2" in report:
        print_pair(
            "2B-4T-shaped: bitserve TQ2_0 vs llama.cpp TQ2_0 (both arch bitnet), the same file",
            report["2b_tq2_vs_tq2"],
        )


def parse_args() -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--model-2b", type=Path, default=OUT_DIR / "2b4t-i2s.gguf", help="made when missing")
    parser.add_argument(
        "--model-2b-tq2", type=Path, default=OUT_DIR / "2b4t-tq2_0.gguf", help="made when missing"
    )
    parser.add_argument("--layers", type=int, default=30, help="layers of a generated 2B file")
    parser.add_argument("--skip-2b", action="store_true")
    parser.add_argument("--skip-smollm2", action="store_true")
    parser.add_argument(
        "--smollm2-file", type=Path, default=None, help="another GGUF for the SmolLM2 rows (e.g. requantized)"
    )
    parser.add_argument(
        "--cpu-isa",
        default="auto",
        help="bitserve's cpu kernel variant for the SmolLM2 rows (avx2 on an AVX-512 machine: the AVX2 row)",
    )
    parser.add_argument("--tq2", action="store_true", help="also llama.cpp on the TQ2_0 twin of the 2B file")
    parser.add_argument(
        "--fast-decode-ab", action="store_true", help="2B decode with the lean cpu decode step on vs off"
    )
    parser.add_argument(
        "--dense-ab", action="store_true", help="SmolLM2: 1 GiB f32 dense budget vs 0, alternating"
    )
    parser.add_argument("--prefill-tokens", type=int, default=128)
    parser.add_argument("--decode-prompt-tokens", type=int, default=8)
    parser.add_argument("--decode-tokens", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3, help="alternating runs per engine (SmolLM2)")
    parser.add_argument(
        "--profile-steps", type=int, default=4, help="2B decode steps under cProfile (0: none)"
    )
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--json", type=Path, default=None, help="also write the numbers here")
    return parser.parse_args()


def main() -> None:
    args = parse_args()
    torch.set_num_threads(args.threads)
    import numba

    numba.set_num_threads(min(args.threads, numba.config.NUMBA_NUM_THREADS))
    report: dict[str, Any] = {
        "machine": machine_info(),
        "command": " ".join([Path(sys.executable).name, *sys.argv]),
    }
    if not args.skip_2b:
        bench_2b(args, report)
    if not args.skip_smollm2:
        bench_smollm2(args, report)
    if args.dense_ab:
        bench_smollm2_dense(args, report)
    if args.tq2:
        bench_2b_tq2(args, report)
    if args.fast_decode_ab:
        bench_fast_decode_ab(args, report)
    report["machine"]["loadavg_end"] = os.getloadavg()
    print_report(report)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1, default=str), encoding="utf-8")


if __name__ == "__main__":
    main()
