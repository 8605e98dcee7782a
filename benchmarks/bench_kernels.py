"""Linear-kernel benchmark: each backend against torch fp32 F.linear on the same shapes, same process.

Prints, per backend, weight shape (M x K) and batch size T: median ms, GB/s of runtime weight bytes
(PreparedLinear.nbytes / time), and speedup over torch fp32 F.linear (>1 is faster). The first call of
each (backend, mode, path) includes numba compilation, or loading it from numba's cache; it is shown as
"first call" and excluded from the timings.

    python benchmarks/bench_kernels.py                      # cpu backend, bitnet mode, 2 threads
    python benchmarks/bench_kernels.py --backends reference cpu --mode float --tokens 1 64

OMP_WAIT_POLICY defaults to PASSIVE here (set before torch loads libgomp): with libgomp's default
spin-waiting, a machine whose cores are busy with other work makes each parallel kernel call wait for
scheduler slices (~8 ms per call measured on a loaded 2-vCPU box). Pass OMP_WAIT_POLICY=ACTIVE to compare.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # before torch / numba load libgomp

import argparse  # noqa: E402
import statistics  # noqa: E402
import time  # noqa: E402
from collections.abc import Callable  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bitserve.kernels.backend import LinearMode  # noqa: E402
from bitserve.kernels.packed import TernaryCodes  # noqa: E402
from bitserve.kernels.select import available_backends, select_backend  # noqa: E402

DEFAULT_SHAPES = ["2560x2560", "640x2560", "6912x2560", "2560x6912"]


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
    args = parser.parse_args()

    set_threads(args.threads)
    names = args.backends or [n for n in available_backends() if n != "reference"] or ["reference"]
    mode = LinearMode(args.mode)
    policy = os.environ.get("OMP_WAIT_POLICY")
    print(f"torch {torch.__version__}, {args.threads} threads, mode {mode.value}, OMP_WAIT_POLICY={policy}")
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


if __name__ == "__main__":
    main()
