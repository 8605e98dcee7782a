"""Linear-kernel benchmark: each backend against torch fp32 F.linear on the same shapes, same process.

Prints, per backend, weight shape (M x K) and batch size T: median ms, GB/s of runtime weight bytes
(PreparedLinear.nbytes / time), and speedup over torch fp32 F.linear (>1 is faster). The first call of
each (backend, mode, path) includes numba compilation, or loading it from numba's cache; it is shown as
"first call" and excluded from the timings.

    python benchmarks/bench_kernels.py                      # cpu backend, bitnet mode, 2 threads
    python benchmarks/bench_kernels.py --backends reference cpu --mode float --tokens 1 64
    python benchmarks/bench_kernels.py --isa-compare --bandwidth          # cpu ternary kernel variants
    python benchmarks/bench_kernels.py --isa-compare --model /tmp/2b4t-i2s.gguf   # + decode tok/s
    git show main:bitserve/kernels/cpu/int8dot.py > /tmp/int8dot_main.py
    python benchmarks/bench_kernels.py --kernel-baseline /tmp/int8dot_main.py --cold   # kernels alone, A/B
    python benchmarks/bench_kernels.py --kernel-baseline /tmp/int8dot_main.py --model /tmp/2b4t-i2s.gguf

--isa-compare times the cpu backend's bitnet-mode ternary kernel variants (kernels/cpu/isa.py: generic =
the int16 numba kernels, avx2 / vnni = the int8 ones) on the same weights and inputs, rounds alternating
between variants, best of --repeats calls per round, best round kept; at 1 and 2 threads (--cold: each timed
call runs over copies of the weight totalling 128 MB, so they come from DRAM as in a model). GMAC/s =
M * K * T / time of the whole prepared-weight call (quantize + kernel); at T = 1 it is G weights/s.
--bandwidth measures read bandwidth with numpy sums over a 1 GB array (2 threads: two halves summed
concurrently; numpy drops the GIL) and prints the bytes-per-token bound of the 2B-4T shape. --model loads
that file once per variant in this process and alternates greedy decode runs between them.
--kernel-baseline times the best variant's int8 GEMV (T = 1) / GEMM kernel alone (quantize outside the
timing) of this checkout against another version of int8dot.py, as GB/s of packed weights and % of the
numpy read bandwidth measured in the same run; with --model, instead that file's greedy decode tok/s
with each version's kernels, swapped into the loaded model between alternating runs.

OpenMP threads wait as bitserve sets them up (a bounded spin, bitserve/__init__.py: importing it first
sets the environment before torch loads libgomp); pass OMP_WAIT_POLICY=PASSIVE or ACTIVE to compare.
"""

from __future__ import annotations

import bitserve  # noqa: F401  (first: sets the OpenMP wait default before torch / numba load libgomp)

# isort: split

import argparse  # noqa: E402
import functools  # noqa: E402
import os
import statistics  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable, Sequence  # noqa: E402
from concurrent.futures import ThreadPoolExecutor  # noqa: E402
from pathlib import Path  # noqa: E402

import numpy as np  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bitserve.kernels.backend import LinearMode  # noqa: E402
from bitserve.kernels.packed import TernaryCodes  # noqa: E402
from bitserve.kernels.select import available_backends, select_backend  # noqa: E402

DEFAULT_SHAPES = ["2560x2560", "640x2560", "6912x2560", "2560x6912"]
ISA_SHAPES = ["6912x2560", "2560x6912", "2560x2560"]
# 2B-4T per layer (M, K, count): q, o; k, v; gate, up; down. 30 layers, F16 tied embedding / LM head.
LAYER_SHAPES_2B = [(2560, 2560, 2), (640, 2560, 2), (6912, 2560, 2), (2560, 6912, 1)]
LAYERS_2B, VOCAB_2B, HIDDEN_2B = 30, 128256, 2560
COLD_BYTES = 128 << 20  # --cold: packed weights cycled through per timed call (more than the L3)


def time_ms(fn: Callable[[], object], min_repeats: int, min_seconds: float) -> float:
    """Median wall time of fn in ms over at least min_repeats calls and min_seconds."""
    samples = []
    start = time.perf_counter()
    while len(samples) < min_repeats or time.perf_counter() - start < min_seconds:
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
    return statistics.median(samples) * 1e3


def set_threads(num_threads: int) -> None:
    torch.set_num_threads(num_threads)
    try:
        import numba

        numba.set_num_threads(num_threads)
    except ImportError:
        pass


def best_seconds(fn: Callable[[], object], calls: int) -> float:
    best = float("inf")
    for _ in range(calls):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def isa_compare(
    isas: Sequence[str], thread_counts: Sequence[int], tokens: Sequence[int], args: argparse.Namespace
) -> None:
    """GMAC/s of each ternary kernel variant (the whole prepared-weight call: quantize + kernel)."""
    from bitserve.kernels.cpu.backend import CpuBackend

    backends = {name: CpuBackend(isa=name) for name in isas}
    gen = torch.Generator().manual_seed(0)
    print(
        f"{'thr':>3} {'shape':>10} {'T':>3} " + " ".join(f"{n + ' GMAC/s':>14}" for n in isas) + "  speedup"
    )
    for num_threads in thread_counts:
        set_threads(num_threads)
        for shape in args.shapes or ISA_SHAPES:
            m, k = (int(v) for v in shape.lower().split("x"))
            values = torch.randint(-1, 2, (m, k), generator=gen, dtype=torch.int8)
            codes = TernaryCodes(values=values, scale=torch.tensor(0.0371))
            copies = -(-COLD_BYTES // (m * k // 4)) if args.cold else 1  # cold: more weights than L3 holds
            weights = {
                n: [b.prepare_ternary(codes, mode=LinearMode.BITNET) for _ in range(copies)]
                for n, b in backends.items()
            }
            for num_tokens in tokens:
                x = torch.randn(num_tokens, k, generator=gen)
                calls = {n: (lambda ws=ws: [w(x) for w in ws]) for n, ws in weights.items()}  # noqa: B023
                outputs = {n: fn()[0] for n, fn in calls.items()}  # compiles; all must agree bit for bit
                first = next(iter(outputs.values()))
                assert all(torch.equal(first, y) for y in outputs.values()), "variants disagree"
                best = dict.fromkeys(calls, float("inf"))
                for _ in range(args.rounds):
                    for name, fn in calls.items():
                        best[name] = min(best[name], best_seconds(fn, args.repeats))
                rates = {n: copies * m * k * num_tokens / s / 1e9 for n, s in best.items()}
                ratio = rates[isas[-1]] / rates[isas[0]]
                cells = " ".join(f"{rates[n]:14.1f}" for n in isas)
                print(f"{num_threads:>3} {shape:>10} {num_tokens:>3} {cells}  {ratio:6.2f}x", flush=True)


def read_bandwidth(thread_counts: Sequence[int], rounds: int = 5) -> dict[int, float]:
    """GB/s of numpy sums over a 1 GB float32 array, best of `rounds`, split over n threads."""
    data = np.ones(1 << 28, dtype=np.float32)  # 1 GiB, touched once by np.ones
    results = {}
    with ThreadPoolExecutor(max(thread_counts)) as pool:
        for n in thread_counts:
            parts = np.array_split(data, n)
            best = min(
                best_seconds(lambda parts=parts: list(pool.map(np.sum, parts)), 1) for _ in range(rounds)
            )
            results[n] = data.nbytes / best / 1e9
    return results


def bandwidth_bound(thread_counts: Sequence[int]) -> None:
    """Decode tok/s ceiling of the 2B-4T shape: weight bytes read per token / measured read bandwidth."""
    ternary = sum(m * k * c for m, k, c in LAYER_SHAPES_2B) * LAYERS_2B // 4  # 2 bits per weight
    head = VOCAB_2B * HIDDEN_2B * 2  # F16 LM head, read whole every step
    for n, gbps in read_bandwidth(thread_counts).items():
        total = ternary + head
        print(
            f"{n} thread(s): read {gbps:.1f} GB/s; per token {ternary / 1e6:.0f} MB ternary + "
            f"{head / 1e6:.0f} MB F16 head = {total / 1e6:.0f} MB -> bound {gbps * 1e9 / total:.1f} tok/s "
            f"({gbps * 1e9 / ternary:.1f} tok/s for the ternary linears alone)"
        )


def load_int8dot(path: Path) -> object:
    """Another version of kernels/cpu/int8dot.py (e.g. `git show main:bitserve/kernels/cpu/int8dot.py`) as
    a module of its own, next to this checkout's."""
    import importlib.util

    spec = importlib.util.spec_from_file_location(f"int8dot_{path.stem}", path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


def kernel_ab(
    isa_name: str, thread_counts: Sequence[int], tokens: Sequence[int], args: argparse.Namespace
) -> None:
    """GB/s of packed weights read by the int8 ternary kernel alone (activations quantized once, outside
    the timing; T = 1: the GEMV, above: the GEMM) of this checkout and of --kernel-baseline, and that as a
    share of numpy's read bandwidth at the same thread count, measured in this run. Rounds alternate
    between the two, best kept."""
    from bitserve.kernels.cpu import int8dot
    from bitserve.kernels.cpu.isa import Isa

    modules = {"baseline": load_int8dot(args.kernel_baseline), "this": int8dot}
    bandwidth = read_bandwidth(thread_counts)
    print(
        f"{isa_name} kernels alone, {'cold' if args.cold else 'hot'}; numpy read GB/s "
        + ", ".join(f"{n} thr {g:.1f}" for n, g in bandwidth.items())
    )
    print(
        f"{'thr':>3} {'shape':>11} {'T':>3} "
        + " ".join(f"{f'{n} GB/s (%)':>18}" for n in modules)
        + "  ratio"
    )
    for shape in args.shapes or ISA_SHAPES:
        m, k = (int(v) for v in shape.lower().split("x"))
        for num_tokens in tokens:
            kernels = {
                name: getattr(module.KERNELS[Isa(isa_name)], "gemv" if num_tokens == 1 else "gemm")
                for name, module in modules.items()
            }
            calls, bytes_per_call = kernel_calls(kernels, m, k, num_tokens, args.cold)
            for num_threads in thread_counts:
                set_threads(num_threads)
                best = dict.fromkeys(calls, float("inf"))
                for _ in range(args.rounds):
                    for name, fn in calls.items():
                        best[name] = min(best[name], best_seconds(fn, args.repeats))
                rates = [bytes_per_call / s / 1e9 for s in best.values()]
                cells = " ".join(f"{g:11.1f} ({100 * g / bandwidth[num_threads]:3.0f}%)" for g in rates)
                print(
                    f"{num_threads:>3} {shape:>11} {num_tokens:>3} {cells}  {rates[-1] / rates[0]:5.2f}x",
                    flush=True,
                )
    if 1 in tokens:
        step_2b_gemvs(modules, isa_name, thread_counts, args)


def step_2b_gemvs(
    modules: dict[str, object], isa_name: str, thread_counts: Sequence[int], args: argparse.Namespace
) -> None:
    """ms of the ternary GEMV kernels of one 2B-4T decode step (30 layers x stacked q/k/v, o, stacked
    gate/up, down: 120 calls over 521 MB of packed weights, so from DRAM), each module's kernel in turn."""
    from bitserve.kernels.cpu import int8dot
    from bitserve.kernels.cpu.isa import Isa

    kernels = {name: module.KERNELS[Isa(isa_name)].gemv for name, module in modules.items()}
    rng = np.random.default_rng(1)
    hidden, inter = HIDDEN_2B, 6912
    shapes = [(hidden + 2 * 640, hidden), (hidden, hidden), (2 * inter, hidden), (hidden, inter)]
    layers = [
        [(int8dot.row_table(rng.integers(0, 256, (m, k // 4), dtype=np.uint8)), m, k) for m, k in shapes]
        for _ in range(LAYERS_2B)
    ]
    acts = {
        k: int8dot.quantize_int8(rng.standard_normal((1, k)).astype(np.float32), k, 1)
        for k in (hidden, inter)
    }
    row_scale = np.full(2 * inter, 0.0371, dtype=np.float32)
    outs = {m: np.empty((1, m), dtype=np.float32) for m, _ in shapes}

    def step(kernel: Callable[..., None]) -> None:
        for layer in layers:
            for weight, m, k in layer:
                q, s_act, q_sum = acts[k]
                kernel(weight, q, q_sum, s_act, row_scale[:m], outs[m])

    total = sum(m * k // 4 for m, k in shapes) * LAYERS_2B
    for num_threads in thread_counts:
        set_threads(num_threads)
        best = dict.fromkeys(kernels, float("inf"))
        for _ in range(args.rounds):
            for name, kernel in kernels.items():
                best[name] = min(best[name], best_seconds(functools.partial(step, kernel), args.repeats))
        cells = ", ".join(f"{n} {s * 1e3:.1f} ms ({total / s / 1e9:.1f} GB/s)" for n, s in best.items())
        print(f"{num_threads} thr: 2B-4T step's 120 GEMVs ({total / 1e6:.0f} MB): {cells}", flush=True)


def kernel_calls(
    kernels: dict[str, Callable[..., None]], m: int, k: int, num_tokens: int, cold: bool
) -> tuple[dict[str, Callable[[], object]], int]:
    """One timed call per kernel over random M x K packed weights (cold: copies totalling COLD_BYTES),
    all checked to agree bit for bit first -> (calls, packed bytes each call reads)."""
    from bitserve.kernels.cpu import int8dot

    rng = np.random.default_rng(0)
    copies = -(-COLD_BYTES // (m * k // 4)) if cold else 1
    weights = [int8dot.row_table(rng.integers(0, 256, (m, k // 4), dtype=np.uint8)) for _ in range(copies)]
    x = rng.standard_normal((num_tokens, k)).astype(np.float32)
    q, s_act, q_sum = int8dot.quantize_int8(x, k, int8dot.padded_tokens(num_tokens))
    row_scale = np.full(m, 0.0371, dtype=np.float32)
    outs = {name: np.empty((num_tokens, m), dtype=np.float32) for name in kernels}
    for name, kernel in kernels.items():
        kernel(weights[0], q, q_sum, s_act, row_scale, outs[name])  # compiles
    first = next(iter(outs.values()))
    assert all(np.array_equal(first, o) for o in outs.values()), "kernels disagree"

    def call(kernel: Callable[..., None], out: np.ndarray) -> None:
        for weight in weights:
            kernel(weight, q, q_sum, s_act, row_scale, out)

    calls = {name: functools.partial(call, kernel, outs[name]) for name, kernel in kernels.items()}
    return calls, copies * m * k // 4


def model_kernel_ab(path: Path, isa_name: str, args: argparse.Namespace) -> None:
    """Greedy decode tok/s of the model file with this checkout's int8 ternary kernels and with
    --kernel-baseline's: one load, the kernels swapped between alternating decode runs (so both see the
    same mapped weights, the same process and the same machine moments): in every int8 ternary linear
    (prefill, the module forward) and in the one-call ternary decode step (kernels/cpu/decode_step.py),
    whose layer loop is compiled a second time around the baseline's GEMV / GEMM."""
    from numba import njit

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_model import TEXT, BitserveRunner, prompt_ids

    from bitserve.kernels.cpu import decode_step, int8dot
    from bitserve.kernels.cpu.isa import Isa
    from bitserve.kernels.cpu.prepared import Int8BitnetLinear
    from bitserve.kernels.cpu.ternary_step import TernaryStep
    from bitserve.llm import LLM

    isa = Isa(isa_name)
    baseline = load_int8dot(args.kernel_baseline)
    kernels = {"baseline": baseline.KERNELS[isa], "this": int8dot.KERNELS[isa]}
    base_gemv, base_gemm = baseline.KERNELS[isa].gemv, baseline.KERNELS[isa].gemm

    layer_loop = uncached_decode_layers(decode_step)

    @njit(nogil=True)
    def baseline_decode_layers(x, model, step):  # noqa: ANN001, ANN202 - numba types them
        layer_loop(base_gemv, base_gemm, x, model, step)

    decode_layers = {"baseline": baseline_decode_layers, "this": decode_step.DECODE_LAYERS[isa]}
    set_threads(args.threads)
    runner = BitserveRunner(LLM(str(path), backend="cpu", cpu_isa=isa_name))
    linears, steps = live_objects(Int8BitnetLinear), live_objects(TernaryStep)

    def use(name: str) -> None:
        for linear in linears:
            linear._kernels = kernels[name]  # the prepared weight's entry points (bound at load)
        for step in steps:
            step.decode_layers = decode_layers[name]

    base = runner.llm.tokenizer.encode(TEXT, add_special=False)
    for name in kernels:
        use(name)
        runner.decode(prompt_ids(base, 8, 999), 2)  # compile / load kernels, touch the weights
    rates: dict[str, list[float]] = {n: [] for n in kernels}
    tokens: dict[str, list[int]] = {}
    for r in range(args.rounds):
        for name in kernels:
            use(name)
            times, tokens[name] = runner.decode(prompt_ids(base, 8, r), args.decode_tokens)
            rates[name].append(len(times) / sum(times))
    same = len({tuple(t) for t in tokens.values()}) == 1
    print(
        f"{args.threads} threads, {len(linears)} int8 linears, {len(steps)} one-call decode step(s), "
        f"{args.decode_tokens} decode tokens after an 8-token prompt, {args.rounds} alternating rounds; "
        f"greedy ids equal: {same}"
    )
    for name, values in rates.items():
        print(f"{name:8} decode tok/s best {max(values):.2f} median {statistics.median(values):.2f}")


def uncached_decode_layers(decode_step: object) -> Callable[..., None]:
    """decode_step._decode_layers and the _project it calls, compiled again without numba's on-disk cache:
    they take the GEMV / GEMM as arguments, so the cached versions would store a specialization on the
    baseline module's kernels, which every later process would fail to load (its module is not importable)."""
    import types

    from numba import njit

    namespace = dict(vars(decode_step))

    def copy(name: str) -> Callable[..., None]:
        py_func = getattr(decode_step, name).py_func
        return njit(nogil=True)(types.FunctionType(py_func.__code__, namespace, name, py_func.__defaults__))

    namespace["_project"] = copy("_project")
    return copy("_decode_layers")


def live_objects(cls: type) -> list:
    """Every live instance of cls (the loaded model's prepared weights or step tables)."""
    import gc
    import warnings

    with warnings.catch_warnings():  # isinstance() on every live object trips torch's deprecated aliases
        warnings.simplefilter("ignore", FutureWarning)
        return [o for o in gc.get_objects() if isinstance(o, cls)]


def model_decode(path: Path, isas: Sequence[str], args: argparse.Namespace) -> None:
    """Greedy decode tok/s of the model file under each variant: one LLM per variant in this process,
    decode runs alternating between them; best and median of --rounds runs."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from bench_model import TEXT, BitserveRunner, prompt_ids

    from bitserve.llm import LLM

    set_threads(args.threads)
    runners = {}
    for name in isas:
        t0 = time.perf_counter()
        runners[name] = BitserveRunner(LLM(str(path), backend="cpu", cpu_isa=name))
        print(f"{name}: loaded in {time.perf_counter() - t0:.1f} s", flush=True)
    base = next(iter(runners.values())).llm.tokenizer.encode(TEXT, add_special=False)
    for runner in runners.values():
        runner.decode(prompt_ids(base, 8, 999), 2)  # compile / load kernels, touch the weights
    rates: dict[str, list[float]] = {n: [] for n in isas}
    prefill: dict[str, list[float]] = {n: [] for n in isas}
    tokens: dict[str, list[int]] = {}
    for r in range(args.rounds):
        for name, runner in runners.items():
            times, tokens[name] = runner.decode(prompt_ids(base, 8, r), args.decode_tokens)
            rates[name].append(len(times) / sum(times))
            prefill[name].append(
                args.prefill_tokens / runner.prefill(prompt_ids(base, args.prefill_tokens, 50 + r))
            )
    same = len({tuple(t) for t in tokens.values()}) == 1
    print(
        f"{args.threads} threads, {args.decode_tokens} decode tokens after an 8-token prompt; "
        f"greedy ids equal: {same}"
    )
    for name in isas:
        print(
            f"{name:8} decode tok/s best {max(rates[name]):.2f} median {statistics.median(rates[name]):.2f}; "
            f"prefill ({args.prefill_tokens} tokens) tok/s best {max(prefill[name]):.1f}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--backends", nargs="+", default=None, help="default: every available but reference")
    parser.add_argument("--mode", default="bitnet", choices=[m.value for m in LinearMode])
    parser.add_argument("--shapes", nargs="+", default=DEFAULT_SHAPES, help="MxK (out x in)")
    parser.add_argument("--tokens", nargs="+", type=int, default=[1, 8, 64])
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--seconds", type=float, default=0.5, help="minimum timing window per cell")
    parser.add_argument("--isa-compare", action="store_true", help="compare the cpu ternary kernel variants")
    parser.add_argument(
        "--isas", nargs="+", default=None, help="variants to compare (default: generic + best)"
    )
    parser.add_argument("--thread-counts", nargs="+", type=int, default=[1, 2])
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (--isa-compare, --model)")
    parser.add_argument("--cold", action="store_true", help="--isa-compare from DRAM: cycle >128 MB weights")
    parser.add_argument("--bandwidth", action="store_true", help="read bandwidth and the 2B-4T decode bound")
    parser.add_argument(
        "--kernel-baseline", type=Path, default=None, help="another int8dot.py: kernels alone, A/B"
    )
    parser.add_argument("--model", type=Path, default=None, help="2B-4T I2_S file: decode tok/s per variant")
    parser.add_argument("--decode-tokens", type=int, default=32)
    parser.add_argument("--prefill-tokens", type=int, default=64)
    args = parser.parse_args()
    if args.isa_compare or args.bandwidth or args.model or args.kernel_baseline:
        run_isa_benchmarks(args)
        return

    set_threads(args.threads)
    names = args.backends or [n for n in available_backends() if n != "reference"] or ["reference"]
    mode = LinearMode(args.mode)
    policy = os.environ.get("OMP_WAIT_POLICY")
    print(
        f"torch {torch.__version__}, {args.threads} threads, mode {mode.value}, OMP_WAIT_POLICY={policy}, "
        f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}"
    )
    print(f"{'backend':10} {'shape':>10} {'T':>3} {'ms':>8} {'GB/s':>7} {'fp32 ms':>8} {'vs fp32':>8}")
    gen = torch.Generator().manual_seed(0)
    for shape in args.shapes:
        m, k = (int(v) for v in shape.lower().split("x"))
        values = torch.randint(-1, 2, (m, k), generator=gen, dtype=torch.int8)
        codes = TernaryCodes(values=values, scale=torch.tensor(0.0371))
        dense = values.float() * 0.0371
        for name in names:
            backend = select_backend(name)
            t0 = time.perf_counter()
            weight = backend.prepare_ternary(codes, mode=mode)
            prepare_s = time.perf_counter() - t0
            for num_tokens in args.tokens:
                x = torch.randn(num_tokens, k, generator=gen)
                t0 = time.perf_counter()
                backend.linear(x, weight)
                first_s = time.perf_counter() - t0
                ms = time_ms(lambda: backend.linear(x, weight), args.repeats, args.seconds)  # noqa: B023
                fp32_ms = time_ms(lambda: F.linear(x, dense), args.repeats, args.seconds)  # noqa: B023
                gbps = weight.nbytes / (ms * 1e-3) / 1e9
                print(
                    f"{name:10} {shape:>10} {num_tokens:>3} {ms:8.3f} {gbps:7.2f} {fp32_ms:8.3f} "
                    f"{fp32_ms / ms:7.2f}x   (first call {first_s:.2f} s, prepare {prepare_s:.2f} s, "
                    f"{weight.nbytes / 1e6:.1f} MB)"
                )


def run_isa_benchmarks(args: argparse.Namespace) -> None:
    from bitserve.kernels.cpu.isa import supported_isas

    isas = args.isas or ["generic", supported_isas()[0].value]
    print(
        f"torch {torch.__version__}, OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')}, "
        f"GOMP_SPINCOUNT={os.environ.get('GOMP_SPINCOUNT')}, variants {isas}"
    )
    if args.bandwidth:
        bandwidth_bound(args.thread_counts)
    if args.isa_compare:
        tokens = args.tokens if args.tokens != [1, 8, 64] else [1, 16]
        isa_compare(isas, args.thread_counts, tokens, args)
    if args.kernel_baseline and not args.model:
        kernel_ab(isas[-1], args.thread_counts, args.tokens if args.tokens != [1, 8, 64] else [1], args)
    if args.model and args.kernel_baseline:
        model_kernel_ab(args.model, isas[-1], args)
    elif args.model:
        model_decode(args.model, isas, args)


if __name__ == "__main__":
    main()
