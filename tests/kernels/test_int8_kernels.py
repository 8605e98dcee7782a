"""The cpu backend's ternary kernel variants (kernels/cpu/isa.py, kernels/cpu/int8dot.py), each forced.

For every variant this CPU runs (the others are skipped): GEMV (T = 1) and GEMM (T > 1) outputs are
torch.equal to the reference backend's in bitnet mode, over odd K, M not a multiple of any row tile, and
token counts around the token tile; the integer core is exact at the int8 / int16 extremes (where a
too-long int16 accumulation would wrap). Plus the ISA dispatch rules themselves.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from bitserve.kernels.backend import KernelBackend, LinearMode
from bitserve.kernels.packed import TernaryCodes
from bitserve.kernels.select import available_backends, select_backend

pytestmark = pytest.mark.skipif("cpu" not in available_backends(), reason="numba not available")

if "cpu" in available_backends():
    from bitserve.kernels.cpu import int8dot
    from bitserve.kernels.cpu import ternary as cpu_ternary
    from bitserve.kernels.cpu.backend import CpuBackend
    from bitserve.kernels.cpu.isa import Isa, resolve_isa, supported_isas

    ISAS = list(Isa)
    SUPPORTED = supported_isas()
else:  # collected but skipped
    ISAS, SUPPORTED = [], []

SHAPES = [(1, 128), (13, 300), (37, 1000), (70, 2560), (9, 6912), (5, 2200)]  # K % 128 != 0 for 300 etc.
NUM_TOKENS = [1, 2, 5, 7, 33, 64]  # GEMM chunks: 2; 5 (one 4 x 5 tile); 4 + 3; a 1-token block (T = 33)
REPO = Path(__file__).resolve().parents[2]


def backend_for(isa: Isa) -> CpuBackend:
    if isa not in SUPPORTED:
        pytest.skip(f"this CPU cannot run the {isa.value} kernels")
    return CpuBackend(isa=isa)


@pytest.fixture(scope="module")
def reference() -> KernelBackend:
    return select_backend("reference")


def random_codes(m: int, k: int, seed: int, per_block: bool = False) -> TernaryCodes:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-1, 2, (m, k), generator=gen, dtype=torch.int8)
    if per_block:
        return TernaryCodes(values=values, scale=torch.rand(m, k // 256, generator=gen) + 0.01)
    return TernaryCodes(values=values, scale=torch.tensor(0.0371, dtype=torch.float32))


def random_x(t: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=gen) * 2
    x[0, 0] = 40.0  # an outlier, as real activations have
    return x


@pytest.mark.parametrize("isa", ISAS, ids=lambda isa: isa.value)
@pytest.mark.parametrize(("m", "k"), SHAPES)
def test_each_variant_is_bit_exact(isa: Isa, m: int, k: int, reference: KernelBackend) -> None:
    backend = backend_for(isa)
    codes = random_codes(m, k, seed=m + 3 * k)
    fast = backend.prepare_ternary(codes, mode=LinearMode.BITNET)
    oracle = reference.prepare_ternary(codes, mode=LinearMode.BITNET)
    for t in NUM_TOKENS:
        x = random_x(t, k, seed=t + m)
        assert torch.equal(backend.linear(x, fast), reference.linear(x, oracle)), (t, m, k)


@pytest.mark.parametrize("isa", ISAS, ids=lambda isa: isa.value)
def test_each_variant_is_bit_exact_with_block_scales(isa: Isa, reference: KernelBackend) -> None:
    backend = backend_for(isa)
    codes = random_codes(21, 768, seed=5, per_block=True)
    fast = backend.prepare_ternary(codes, mode=LinearMode.BITNET)
    oracle = reference.prepare_ternary(codes, mode=LinearMode.BITNET)
    for t in NUM_TOKENS:
        x = random_x(t, 768, seed=t)
        assert torch.equal(backend.linear(x, fast), reference.linear(x, oracle)), t


@pytest.mark.parametrize("isa", ISAS, ids=lambda isa: isa.value)
def test_full_rows_at_the_extremes(isa: Isa, reference: KernelBackend) -> None:
    """Rows of all +1 / all -1 / alternating against activations at +-127 (|x| = amax everywhere)."""
    backend = backend_for(isa)
    k = 4224  # 33 groups: two full int16 flushes of 16 groups and a partial one
    values = torch.stack(
        [torch.ones(k), -torch.ones(k), torch.ones(k) * torch.tensor([1.0, -1.0]).repeat(k // 2)]
    )
    values = torch.cat([values, torch.zeros(2, k)]).to(torch.int8)  # 5 rows: a row tail after any tile
    codes = TernaryCodes(values=values, scale=torch.tensor(0.5, dtype=torch.float32))
    x = torch.stack([torch.full((k,), -3.0), torch.full((k,), 3.0), torch.tensor([3.0, -3.0]).repeat(k // 2)])
    fast = backend.prepare_ternary(codes, mode=LinearMode.BITNET)
    oracle = reference.prepare_ternary(codes, mode=LinearMode.BITNET)
    for rows in (x[:1], x):
        expected = reference.linear(rows, oracle)
        assert torch.equal(backend.linear(rows, fast), expected)
    assert expected[0, 0].item() == pytest.approx(-127 * k / (127 / 3) * 0.5, rel=1e-6)


@pytest.mark.parametrize("isa", [isa for isa in ISAS if isa is not Isa.GENERIC], ids=lambda isa: isa.value)
@pytest.mark.parametrize("fill", [-128, 127])
def test_integer_core_at_int8_extremes(isa: Isa, fill: int) -> None:
    """q = -128 (the quantizer never makes it, the kernel must still take it) and 127 against code-2 rows
    (t = +1): each int16 lane reaches -32768 / 32512 at a 16-group flush. s_act = row scales = 1, so the
    output is f32(D) and must equal the exact integer D."""
    if isa not in SUPPORTED:
        pytest.skip(f"this CPU cannot run the {isa.value} kernels")
    kernels = int8dot.KERNELS[isa]
    m, k = 11, 16 * 128 * 2 + 384  # 35 groups
    gen = torch.Generator().manual_seed(fill & 0xFF)
    values = torch.ones(m, k, dtype=torch.int8)
    values[5:] = torch.randint(-1, 2, (m - 5, k), generator=gen, dtype=torch.int8)
    weight = int8dot.row_table(cpu_ternary.pack_ternary(values).numpy())
    kp = cpu_ternary.padded_in_features(k)
    for t in (1, 3):
        q = np.full((int8dot.padded_token_count(t, int8dot.GEMM_TOKENS), kp), fill, dtype=np.int8)
        q[:, k:] = 0  # padding columns hold q = 0
        q_sum = q[:t].sum(axis=1, dtype=np.int32)
        out = np.empty((t, m), dtype=np.float32)
        kernel = kernels.gemv if t == 1 else kernels.gemm
        kernel(weight, q if t > 1 else q[:1], q_sum, np.ones(t, np.float32), np.ones(m, np.float32), out)
        natural_q = torch.full((t, k), fill, dtype=torch.int64)
        expected = (natural_q @ values.to(torch.int64).t()).to(torch.float32)  # exact: |D| < 2^24
        assert torch.equal(torch.from_numpy(out), expected), t


@pytest.mark.parametrize("isa", ISAS, ids=lambda isa: isa.value)
def test_rows_do_not_depend_on_the_batch(isa: Isa) -> None:
    backend = backend_for(isa)
    weight = backend.prepare_ternary(random_codes(45, 640, seed=2), mode=LinearMode.BITNET)
    x = random_x(9, 640, seed=9)
    batched = backend.linear(x, weight)
    for i in range(9):
        assert torch.equal(backend.linear(x[i : i + 1], weight), batched[i : i + 1])


def test_int8_quantizer_matches_the_int16_one() -> None:
    x = random_x(5, 300, seed=8)
    x[1] = 0.0
    x[3, :7] = torch.tensor([127.0, 2.5, 3.5, -0.5, -1.5, 0.5, 126.5]) / 64
    kp = cpu_ternary.padded_in_features(300)
    q16, s16, sum16 = cpu_ternary.quantize_int16(x.numpy(), kp)
    q8, s8, sum8 = int8dot.quantize_int8(x.numpy(), kp, 6)
    assert q8.dtype == np.int8 and q8.shape == (6, kp) and not q8[5].any()
    assert np.array_equal(q8[:5].astype(np.int16), q16)
    assert np.array_equal(s8, s16) and np.array_equal(sum8, sum16)


# ---------------------------------------------------------------- dispatch


def test_dispatch_picks_the_best_supported_variant() -> None:
    assert supported_isas(frozenset({"avx2", "avx512vnni", "avx512vl"}))[0] is Isa.VNNI
    assert supported_isas(frozenset({"avx2", "avxvnni"}))[0] is Isa.VNNI
    assert supported_isas(frozenset({"avx2", "avx512vnni"})) == [Isa.AVX2, Isa.GENERIC]  # no VL: no ymm
    assert supported_isas(frozenset({"avx", "sse4.2"})) == [Isa.GENERIC]
    assert SUPPORTED[-1] is Isa.GENERIC
    assert resolve_isa("auto") is SUPPORTED[0]
    assert CpuBackend().isa in SUPPORTED


def test_dispatch_can_be_forced_and_refuses_what_cannot_run(monkeypatch: pytest.MonkeyPatch) -> None:
    assert CpuBackend(isa="generic").isa is Isa.GENERIC
    monkeypatch.setenv("BITSERVE_CPU_ISA", "generic")  # kernels never read the environment (settings does)
    assert CpuBackend().isa is SUPPORTED[0]
    assert CpuBackend(isa="auto").isa is SUPPORTED[0]
    with pytest.raises(ValueError, match="unknown cpu ISA"):
        CpuBackend(isa="sse9")
    unsupported = [isa for isa in Isa if isa not in SUPPORTED]
    for isa in unsupported:
        with pytest.raises(ValueError, match="not supported by this CPU"):
            CpuBackend(isa=isa)


COMPILE_VNNI = """
from numba import types
from bitserve.kernels.cpu import int8dot
u8, i8 = types.Array(types.uint8, 1, "C"), types.Array(types.int8, 2, "C")
weight = types.Tuple((u8, types.Array(types.int64, 1, "C")))
i32, f32 = types.Array(types.int32, 1, "C"), types.Array(types.float32, 1, "C")
out, i32x2 = types.Array(types.float32, 2, "C"), types.Array(types.int32, 2, "C")
for kernel in (int8dot.vnni_gemv, int8dot.vnni_gemm):
    kernel.compile((weight, i8, i32, f32, f32, out))
int8dot.vnni_block.compile((weight, i8, i32x2, f32, out, out))
"""


@pytest.mark.slow
@pytest.mark.parametrize(
    ("cpu", "features"),
    [
        ("icelake-server", "+avx2,+fma,+avx512f,+avx512bw,+avx512vl,+avx512vnni"),
        ("alderlake", "+avx2,+fma,+avxvnni"),
    ],
)
def test_vnni_kernels_compile_for_a_vnni_target(cpu: str, features: str, tmp_path: Path) -> None:
    """Where the CPU lacks VNNI the parity tests skip it; this at least has LLVM compile (not run) the VNNI
    kernels for such targets, in a child process with its own numba cache."""
    env = {
        **os.environ,
        "NUMBA_CPU_NAME": cpu,
        "NUMBA_CPU_FEATURES": features,
        "NUMBA_CACHE_DIR": str(tmp_path),
    }
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, "-c", COMPILE_VNNI], env=env, capture_output=True, text=True, timeout=600
    )
    assert done.returncode == 0, done.stderr[-2000:]
