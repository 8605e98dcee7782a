"""docs/formats.md §3 semantics of the reference ternary linear, against independent numpy re-derivations.

The numpy helpers below are written from docs/formats.md §3 and ggml's C code, not from bitserve:
scalar loops, numpy float32 arithmetic step by step, int64 integer sums.
"""

from __future__ import annotations

import ctypes
import importlib.util
import os
import platform
from fractions import Fraction

import numpy as np
import pytest
import torch

from bitserve.kernels.backend import LinearMode
from bitserve.kernels.packed import TernaryCodes
from bitserve.kernels.reference import ternary
from bitserve.kernels.reference.backend import ReferenceBackend

# ---------------------------------------------------------------- independent numpy references


def np_quantize_row(x: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """One row, scalar loop: f64 amax with the 1e-5 floor, f32 s_act, rint of the f32 product."""
    amax = 1e-5
    for v in x:
        amax = max(amax, abs(float(v)))  # Python float is f64
    s_act = np.float32(127.0 / amax)  # f64 division, one rounding to f32
    q = np.empty(x.shape[0], dtype=np.int64)
    for j, v in enumerate(x):
        prod = np.float32(v) * s_act  # numpy f32 * f32 -> f32
        q[j] = min(127, max(-128, int(np.rint(prod))))  # np.rint is half-to-even
    return q, s_act


def np_epilogue(d: np.ndarray, s_act: np.float32, w_scale: np.float32) -> np.ndarray:
    """fl32(fl32(fl32(D) / s_act) * w_scale) with numpy f32 ops, one row."""
    quotient = d.astype(np.float32) / np.float32(s_act)
    assert quotient.dtype == np.float32
    return quotient * np.float32(w_scale)


def np_nearest_int(v: np.float32) -> int:
    """ggml nearest_int: add 1.5 * 2^23 in f32 and read the low mantissa bits."""
    val = np.array([np.float32(v) + np.float32(12582912.0)], dtype=np.float32)
    return int((val.view(np.int32)[0] & 0x007FFFFF) - 0x00400000)


def np_quantize_q8k_block(x: np.ndarray) -> tuple[np.ndarray, np.float32]:
    """ggml quantize_row_q8_K_ref for one 256-value block."""
    amax, vmax = np.float32(0), np.float32(0)
    for v in x:
        if abs(v) > amax:
            amax, vmax = abs(v), v
    if amax == 0:
        return np.zeros(256, dtype=np.int64), np.float32(0)
    iscale = np.float32(-127.0) / np.float32(vmax)
    q = np.array([min(127, np_nearest_int(iscale * np.float32(v))) for v in x], dtype=np.int64)
    return q, np.float32(1.0) / iscale


def exact_fma_f32(a: np.float32, b: np.float32, c: np.float32) -> np.float32:
    """fl32(a * b + c) with one round-half-to-even, computed with exact rationals."""
    exact = Fraction(float(a)) * Fraction(float(b)) + Fraction(float(c))
    guess = np.float32(float(exact))  # may be off by one ulp (double rounding)
    candidates = [np.nextafter(guess, np.float32(-np.inf)), guess, np.nextafter(guess, np.float32(np.inf))]
    errors = [abs(Fraction(float(v)) - exact) for v in candidates]
    best = min(errors)
    ties = [v for v, err in zip(candidates, errors, strict=True) if err == best]
    return min(ties, key=lambda v: int(np.array(v, dtype=np.float32).view(np.int32)) & 1)  # even mantissa


def np_tq2_avx2_dot(codes_row: np.ndarray, x: np.ndarray, d_w: np.ndarray) -> np.float32:
    """ggml_vec_dot_tq2_0_q8_K (AVX2, GCC build: mul + add fused into FMA) for one weight row.

    codes_row: t + 1 per element, in natural order [K]; d_w: f32 [K // 256].
    """
    sumf = [np.float32(0)] * 8
    for b in range(x.shape[0] // 256):
        qy, dy = np_quantize_q8k_block(x[b * 256 : (b + 1) * 256])
        codes = codes_row[b * 256 : (b + 1) * 256].astype(np.int64)
        sumi16 = np.zeros(16, dtype=np.int64)  # 16 int16 lanes of sumi0 + sumi1
        for j in (0, 32):  # 32-byte chunks of qs; byte m of chunk j holds 4 codes at shifts 2l
            for shift in range(4):
                qx = codes[4 * j + 32 * shift : 4 * j + 32 * shift + 32]  # (qs[j + m] >> 2l) & 3
                qyl = qy[4 * j + 32 * shift : 4 * j + 32 * shift + 32]
                sumi16 += qx[0::2] * qyl[0::2] + qx[1::2] * qyl[1::2]  # maddubs: byte pairs
        bsums = qy.reshape(16, 16).sum(axis=1)
        sumi16 -= bsums
        sumi32 = sumi16[0::2] + sumi16[1::2]  # madd_epi16 with ones
        d = np.float32(dy * np.float32(d_w[b]))
        sumf = [exact_fma_f32(np.float32(v), d, acc) for v, acc in zip(sumi32, sumf, strict=True)]
    hi_lo = [np.float32(sumf[i + 4] + sumf[i]) for i in range(4)]
    return np.float32(np.float32(hi_lo[0] + hi_lo[2]) + np.float32(hi_lo[1] + hi_lo[3]))


# ---------------------------------------------------------------- helpers


def random_codes(m: int, k: int, seed: int, scale: float = 0.0123) -> TernaryCodes:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-1, 2, (m, k), generator=gen, dtype=torch.int8)
    return TernaryCodes(values=values, scale=torch.tensor(scale, dtype=torch.float32))


def random_x(t: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(t, k, generator=gen, dtype=torch.float32) * 3


# ---------------------------------------------------------------- activation quantization


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_quantize_matches_scalar_reference(seed: int) -> None:
    x = random_x(5, 300, seed)
    x[1] *= 1e-3  # small magnitudes
    x[2, 7] = 1e4  # one outlier dominates amax
    q, s_act = ternary.quantize_activations(x)
    assert q.dtype == torch.int8 and s_act.dtype == torch.float32
    for row in range(x.shape[0]):
        q_np, s_np = np_quantize_row(x[row].numpy())
        assert s_act[row].item() == s_np
        assert np.array_equal(q[row].numpy().astype(np.int64), q_np)


def test_s_act_is_correctly_rounded_on_many_rows() -> None:
    # s_act = fl32(127 / amax) with one rounding. (torch's `scalar / tensor` multiplies by a reciprocal
    # and is off by one ulp on some rows, so an implementation must not use it.)
    x = random_x(4096, 64, seed=5)
    _, s_act = ternary.quantize_activations(x)
    amax = np.maximum(np.abs(x.numpy()).max(axis=1).astype(np.float64), 1e-5)
    assert np.array_equal(s_act.numpy(), (127.0 / amax).astype(np.float32))


def test_all_zero_and_tiny_rows_use_the_floor() -> None:
    x = torch.zeros(2, 64)
    x[1, 3] = 1e-7  # below the 1e-5 floor: s_act = fl32(127 / 1e-5), q = rne(1.27) = 1
    q, s_act = ternary.quantize_activations(x)
    assert s_act[0].item() == np.float32(127.0 / 1e-5) == s_act[1].item()
    assert not q[0].any()
    assert q[1, 3].item() == 1 and int(q[1].abs().sum()) == 1


def test_exact_halves_round_to_even() -> None:
    # amax = 127/64 is exact in f32, so s_act = 64 and x * s_act hits k + 0.5 exactly.
    halves = [2.5, 3.5, -0.5, -1.5, 0.5, 126.5]
    x = torch.tensor([[127.0 / 64] + [h / 64 for h in halves]], dtype=torch.float32)
    q, s_act = ternary.quantize_activations(x)
    assert s_act.item() == 64.0
    assert q[0].tolist() == [127, 2, 4, 0, -2, 0, 126]  # half-away-from-zero would give 3, 4, -1, ...


def test_extremes_map_to_plus_minus_127() -> None:
    # fl32(x * s_act) never exceeds 127 in magnitude for finite x (s_act is 127/amax rounded once), so
    # the -128 clamp bound is never reached: the most negative value maps to -127 exactly.
    x = random_x(64, 256, 7)
    x[:, 0] = -x.abs().amax(dim=1) * 1.0001
    q, _ = ternary.quantize_activations(x)
    assert bool((q[:, 0] == -127).all())
    assert int(q.min()) >= -127 and int(q.max()) <= 127


# ---------------------------------------------------------------- integer accumulation + epilogue


@pytest.mark.parametrize(
    ("m", "k", "t"),
    [(1, 128, 1), (37, 256, 2), (33, 128, 3), (129, 2560, 7), (31, 6912, 16), (65, 512, 33), (7, 384, 64)],
)
def test_integer_accumulation_is_exact(m: int, k: int, t: int) -> None:
    gen = torch.Generator().manual_seed(m * 1000 + k + t)
    q = torch.randint(-128, 128, (t, k), generator=gen, dtype=torch.int8)
    q[0, :] = -128  # the extreme int8 row, all weights hit
    values = random_codes(m, k, seed=k + t).values
    values[0, :] = -1
    d = ternary.integer_matmul(q, values)
    expected = q.numpy().astype(np.int64) @ values.numpy().astype(np.int64).T
    assert d.dtype == torch.int32
    assert np.array_equal(d.numpy().astype(np.int64), expected)


@pytest.mark.parametrize(("m", "k", "t"), [(37, 256, 3), (129, 2560, 16), (5, 6912, 2)])
def test_full_pipeline_is_bit_exact(m: int, k: int, t: int) -> None:
    codes = random_codes(m, k, seed=m + k, scale=0.0371)
    x = random_x(t, k, seed=t)
    y = ReferenceBackend().linear(x, ReferenceBackend().prepare_ternary(codes, mode=LinearMode.BITNET))
    w64 = codes.values.numpy().astype(np.int64)
    for row in range(t):
        q_np, s_np = np_quantize_row(x[row].numpy())
        expected = np_epilogue(w64 @ q_np, s_np, np.float32(0.0371))
        assert np.array_equal(y[row].numpy().view(np.int32), expected.view(np.int32))


def test_batch_invariance() -> None:
    backend = ReferenceBackend()
    weight = backend.prepare_ternary(random_codes(77, 512, seed=3), mode=LinearMode.BITNET)
    x = random_x(16, 512, seed=4)
    batched = backend.linear(x, weight)
    for row in (0, 9, 15):
        alone = backend.linear(x[row : row + 1].clone(), weight)
        assert torch.equal(alone[0], batched[row])


def test_linear_group_equals_separate_linears() -> None:
    backend = ReferenceBackend()
    weights = [
        backend.prepare_ternary(random_codes(m, 256, seed=m), mode=LinearMode.BITNET) for m in (64, 16)
    ]
    x = random_x(5, 256, seed=9)
    grouped = backend.linear_group(x, weights)
    for w, y in zip(weights, grouped, strict=True):
        assert torch.equal(y, backend.linear(x, w))


# ---------------------------------------------------------------- per-block scales


def per_block_codes(m: int, k: int, seed: int) -> TernaryCodes:
    codes = random_codes(m, k, seed)
    gen = torch.Generator().manual_seed(seed + 1)
    scale = torch.rand(m, k // 256, generator=gen, dtype=torch.float32) + 0.01
    return TernaryCodes(values=codes.values, scale=scale)


def test_per_block_scales_match_numpy() -> None:
    m, k, t = 9, 768, 3
    codes = per_block_codes(m, k, seed=11)
    x = random_x(t, k, seed=12)
    backend = ReferenceBackend()
    y = backend.linear(x, backend.prepare_ternary(codes, mode=LinearMode.BITNET))
    w = codes.values.numpy().astype(np.int64)
    scale = codes.scale.numpy()
    for row in range(t):
        q_np, s_np = np_quantize_row(x[row].numpy())
        for r in range(m):
            acc = np.float32(0)
            for b in range(k // 256):
                d_b = int(w[r, b * 256 : (b + 1) * 256] @ q_np[b * 256 : (b + 1) * 256])
                acc = np.float32(acc + (np.float32(d_b) / s_np) * scale[r, b])
            assert y[row, r].numpy().view(np.int32) == np.array(acc).view(np.int32)


def test_zero_blocks_do_not_force_per_block_scales() -> None:
    # A TQ file gives all-zero blocks d = 0; the tensor still has one scale and the I2_S epilogue.
    codes = random_codes(6, 512, seed=5, scale=0.25)
    values = codes.values.clone()
    values[2, 256:] = 0
    scale = torch.full((6, 2), 0.25)
    scale[2, 1] = 0.0
    collapsed = ternary.collapse_block_scales(TernaryCodes(values=values, scale=scale))
    assert collapsed.is_per_tensor and collapsed.scale.item() == 0.25
    mixed = scale.clone()
    mixed[3, 0] = 0.5
    assert not ternary.collapse_block_scales(TernaryCodes(values=values, scale=mixed)).is_per_tensor


# ---------------------------------------------------------------- float and llamacpp-tq modes


def test_float_mode_matches_numpy() -> None:
    backend = ReferenceBackend()
    for codes in (random_codes(21, 512, seed=1, scale=0.5), per_block_codes(21, 512, seed=2)):
        x = random_x(4, 512, seed=3)
        y = backend.linear(x, backend.prepare_ternary(codes, mode=LinearMode.FLOAT))
        scale = codes.scale.numpy()
        w = codes.values.numpy().astype(np.float64) * (np.repeat(scale, 256, axis=1) if scale.ndim else scale)
        expected = x.numpy().astype(np.float64) @ w.T
        np.testing.assert_allclose(y.numpy(), expected, rtol=1e-5, atol=1e-5)


def test_q8k_quantization_matches_ggml_reference() -> None:
    x = random_x(3, 512, seed=21)
    x[0, :256] = 0  # all-zero block: d = 0
    x[1, 10], x[1, 20] = -7.0, 7.0  # tie in |x|: the first (negative) one sets the sign of iscale
    x[2, 256:] *= 1e-30  # tiny but non-zero block
    q, d = ternary.quantize_q8k(x)
    for row in range(3):
        for b in range(2):
            q_np, d_np = np_quantize_q8k_block(x[row, b * 256 : (b + 1) * 256].numpy())
            assert np.array_equal(q[row, b * 256 : (b + 1) * 256].numpy().astype(np.int64), q_np)
            assert d[row, b].numpy().view(np.int32) == np.array(d_np).view(np.int32)


@pytest.mark.parametrize("per_block", [False, True])
def test_llamacpp_tq_matches_avx2_emulation(per_block: bool) -> None:
    m, k, t = 5, 768, 2
    codes = per_block_codes(m, k, seed=31) if per_block else random_codes(m, k, seed=31, scale=0.0371)
    x = random_x(t, k, seed=32)
    backend = ReferenceBackend()
    y = backend.linear(x, backend.prepare_ternary(codes, mode=LinearMode.LLAMACPP_TQ))
    scale = codes.scale.numpy().astype(np.float16).astype(np.float32)
    d_w = scale if per_block else np.full((m, k // 256), scale, dtype=np.float32)
    for row in range(t):
        for r in range(m):
            expected = np_tq2_avx2_dot(codes.values[r].numpy() + 1, x[row].numpy(), d_w[r])
            assert y[row, r].numpy().view(np.int32) == np.array(expected).view(np.int32)


def test_llamacpp_tq_rejects_k_off_the_block_size() -> None:
    from bitserve.errors import UnsupportedModel

    with pytest.raises(UnsupportedModel, match="multiple of 256"):
        ReferenceBackend().prepare_ternary(random_codes(4, 384, seed=0), mode=LinearMode.LLAMACPP_TQ)


def test_fma_f32_matches_exact_rounding() -> None:
    gen = torch.Generator().manual_seed(0)
    a = torch.randint(-3000, 3000, (2000,), generator=gen).float()
    b = torch.rand(2000, generator=gen) * 1e-3
    c = torch.randn(2000, generator=gen) * 0.5
    # Constructed cases around the f32 midpoint 1 + 2^-24 (between 1 and 1 + 2^-23), c = 1:
    # [0] a * b = 2^-24 + 2^-60: f64 rounds the sum onto the midpoint; the exact value rounds up.
    # [1] a * b = 2^-24 - 2^-60: onto the midpoint from below; rounds down. [2] an exact tie (to even).
    c[:4] = 1.0
    a[:4] = torch.tensor([1 + 2.0**-12, 1 + 2.0**-18, 1.0, 3.0])
    b[:4] = torch.tensor(
        [2.0**-24 * (1 - 2.0**-12 + 2.0**-24), 2.0**-24 * (1 - 2.0**-18), 2.0**-24, 2.0**-24]
    )
    got = ternary.fma_f32(a, b, c)
    for i in range(2000):
        assert got[i].item() == exact_fma_f32(np.float32(a[i]), np.float32(b[i]), np.float32(c[i])), i
    assert got[:4].tolist() == [1.0 + 2.0**-23, 1.0, 1.0, 1.0 + 2.0**-22]
    naive = (a[:1].double() * b[:1].double() + 1.0).float()  # f64 then f32: double rounding
    assert naive.item() == 1.0  # so case [0] really tells a true FMA from the naive emulation


def _ggml_cpu_library() -> ctypes.CDLL:
    spec = importlib.util.find_spec("llama_cpp")
    if spec is None or spec.origin is None:
        pytest.skip("llama-cpp-python is not installed")
    if platform.machine() not in ("x86_64", "AMD64"):
        pytest.skip("the emulated kernel is ggml's x86 AVX2 one")
    lib_dir = os.path.join(os.path.dirname(spec.origin), "lib")
    if not os.path.isfile(os.path.join(lib_dir, "libggml-cpu.so")):
        pytest.skip("llama-cpp-python has no libggml-cpu.so (not a Linux shared-library build)")
    ctypes.CDLL(os.path.join(lib_dir, "libggml-base.so"), mode=ctypes.RTLD_GLOBAL)
    lib = ctypes.CDLL(os.path.join(lib_dir, "libggml-cpu.so"), mode=ctypes.RTLD_GLOBAL)
    lib.ggml_cpu_init()
    lib.quantize_row_q8_K.argtypes = [ctypes.c_void_p, ctypes.c_void_p, ctypes.c_int64]
    lib.ggml_vec_dot_tq2_0_q8_K.argtypes = [ctypes.c_int, ctypes.c_void_p, ctypes.c_size_t]
    lib.ggml_vec_dot_tq2_0_q8_K.argtypes += [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    lib.ggml_vec_dot_tq2_0_q8_K.argtypes += [ctypes.c_size_t, ctypes.c_int]
    return lib


@pytest.mark.crossval
def test_llamacpp_tq_matches_ggml_library() -> None:
    """Q8_K quantization and the TQ2_0 dot product, bit for bit against the installed ggml (x86)."""
    import gguf

    lib = _ggml_cpu_library()
    block_q8k = np.dtype([("d", "<f4"), ("qs", "i1", 256), ("bsums", "<i2", 16)])
    m, k, t = 24, 1024, 6
    codes = random_codes(m, k, seed=41, scale=0.0371)
    tq2 = gguf.quants.quantize(codes.values.numpy() * np.float32(0.0371), gguf.GGMLQuantizationType.TQ2_0)
    x = random_x(t, k, seed=42)
    x[1, :256] = 0.0  # an all-zero Q8_K block
    backend = ReferenceBackend()
    y = backend.linear(x, backend.prepare_ternary(codes, mode=LinearMode.LLAMACPP_TQ))
    q8, d_x = ternary.quantize_q8k(x)
    for row in range(t):
        x_row = np.ascontiguousarray(x[row].numpy())
        blocks = np.zeros(k // 256, dtype=block_q8k)
        lib.quantize_row_q8_K(x_row.ctypes.data, blocks.ctypes.data, k)
        assert np.array_equal(blocks["qs"].reshape(-1), q8[row].numpy())
        assert np.array_equal(blocks["d"], d_x[row].numpy())
        for r in range(m):
            out = np.zeros(1, dtype=np.float32)
            weight_row = np.ascontiguousarray(tq2[r])
            lib.ggml_vec_dot_tq2_0_q8_K(
                k, out.ctypes.data, 0, weight_row.ctypes.data, 0, blocks.ctypes.data, 0, 1
            )
            assert out[0].view(np.int32) == y[row, r].numpy().view(np.int32), (row, r)
