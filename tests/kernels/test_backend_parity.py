"""Every available kernel backend against the reference backend.

bitnet and llamacpp-tq modes: bit-exact (torch.equal) for every shape and batch size, including batch
sizes on both sides of the cpu backend's GEMV / sgemm switch. float mode and dense weights: within the
rigorous fp32 dot-product bound 2 * gamma_K * (|x| @ |W|^T), gamma_K = K u / (1 - K u), u = 2^-24, which
holds for any summation order (the only thing allowed to differ).
"""

from __future__ import annotations

import pytest
import torch

from bitserve.errors import UnsupportedModel
from bitserve.kernels.backend import KernelBackend, LinearMode
from bitserve.kernels.packed import Layout, TernaryCodes
from bitserve.kernels.select import available_backends, select_backend

BACKENDS = available_backends()
FAST_BACKENDS = [name for name in BACKENDS if name != "reference"]
SHAPES = [(1, 128), (37, 256), (33, 300), (129, 768), (64, 2560), (17, 6912)]
NUM_TOKENS = [1, 2, 3, 7, 16, 33, 64]


def make_codes(m: int, k: int, seed: int, per_block: bool = False) -> TernaryCodes:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-1, 2, (m, k), generator=gen, dtype=torch.int8)
    if per_block:
        scale = torch.rand(m, k // 256, generator=gen, dtype=torch.float32) + 0.01
    else:
        scale = torch.tensor(0.0371, dtype=torch.float32)
    return TernaryCodes(values=values, scale=scale)


def make_x(t: int, k: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(t, k, generator=gen, dtype=torch.float32) * 2
    x[0, 0] = 40.0  # an outlier, as real activations have
    return x


def fp32_bound(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    k = x.shape[1]
    u = 2.0**-24
    gamma = k * u / (1 - k * u)
    return 2 * gamma * (x.abs().double() @ w.abs().double().t()) + 1e-30


@pytest.fixture(scope="module")
def reference() -> KernelBackend:
    return select_backend("reference")


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(("m", "k"), SHAPES)
def test_bitnet_mode_is_bit_exact(name: str, m: int, k: int, reference: KernelBackend) -> None:
    backend = select_backend(name)
    codes = make_codes(m, k, seed=m * 7 + k)
    fast, oracle = (
        backend.prepare_ternary(codes, mode=LinearMode.BITNET),
        reference.prepare_ternary(codes, mode=LinearMode.BITNET),
    )
    for t in NUM_TOKENS:
        x = make_x(t, k, seed=t)
        assert torch.equal(backend.linear(x, fast), reference.linear(x, oracle)), (m, k, t)


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("mode", [LinearMode.BITNET, LinearMode.LLAMACPP_TQ])
def test_per_block_scales_are_bit_exact(name: str, mode: LinearMode, reference: KernelBackend) -> None:
    backend = select_backend(name)
    codes = make_codes(45, 1024, seed=5, per_block=True)
    fast, oracle = backend.prepare_ternary(codes, mode=mode), reference.prepare_ternary(codes, mode=mode)
    for t in (1, 5, 40):
        x = make_x(t, 1024, seed=t)
        assert torch.equal(backend.linear(x, fast), reference.linear(x, oracle)), t


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize(("m", "k"), [(37, 256), (129, 768), (17, 6912)])
def test_llamacpp_tq_mode_is_bit_exact(name: str, m: int, k: int, reference: KernelBackend) -> None:
    backend = select_backend(name)
    codes = make_codes(m, k, seed=k)
    fast = backend.prepare_ternary(codes, mode=LinearMode.LLAMACPP_TQ)
    oracle = reference.prepare_ternary(codes, mode=LinearMode.LLAMACPP_TQ)
    for t in (1, 3, 33):
        x = make_x(t, k, seed=t + 1)
        assert torch.equal(backend.linear(x, fast), reference.linear(x, oracle)), t


@pytest.mark.parametrize("name", BACKENDS)
@pytest.mark.parametrize("per_block", [False, True])
def test_float_mode_within_fp32_bound(name: str, per_block: bool, reference: KernelBackend) -> None:
    backend = select_backend(name)
    m, k = 65, 768
    codes = make_codes(m, k, seed=2, per_block=per_block)
    fast = backend.prepare_ternary(codes, mode=LinearMode.FLOAT)
    oracle = reference.prepare_ternary(codes, mode=LinearMode.FLOAT)
    scale = codes.scale if not per_block else codes.scale.repeat_interleave(256, dim=1)
    w = codes.values.float() * scale
    for t in (1, 7, 64):
        x = make_x(t, k, seed=t)
        got, want = backend.linear(x, fast), reference.linear(x, oracle)
        assert bool(((got.double() - want.double()).abs() <= fp32_bound(x, w)).all()), t
        assert got.abs().max() > 0


@pytest.mark.parametrize("name", BACKENDS)
def test_dense_linear_within_fp32_bound(name: str, reference: KernelBackend) -> None:
    backend = select_backend(name)
    gen = torch.Generator().manual_seed(0)
    w = torch.randn(70, 300, generator=gen)
    fast, oracle = backend.prepare_dense(w), reference.prepare_dense(w)
    assert fast.layout is Layout.DENSE and fast.mode is None
    for t in (1, 9, 64):
        x = make_x(t, 300, seed=t)
        got, want = backend.linear(x, fast), reference.linear(x, oracle)
        assert got.shape == (t, 70)
        assert bool(((got.double() - want.double()).abs() <= fp32_bound(x, w)).all())


@pytest.mark.parametrize("name", BACKENDS)
def test_batch_invariance_across_kernel_paths(name: str) -> None:
    # T = 64 takes the cpu backend's sgemm path, T = 1 its GEMV kernel: bits must not change.
    backend = select_backend(name)
    weight = backend.prepare_ternary(make_codes(257, 2560, seed=1), mode=LinearMode.BITNET)
    x = make_x(64, 2560, seed=3)
    batched = backend.linear(x, weight)
    for row in (0, 31, 63):
        assert torch.equal(backend.linear(x[row : row + 1].clone(), weight)[0], batched[row])
    assert torch.equal(backend.linear(x[:16].clone(), weight), batched[:16])


@pytest.mark.parametrize("name", BACKENDS)
def test_linear_group_quantizes_once_and_matches(name: str) -> None:
    backend = select_backend(name)
    weights = [
        backend.prepare_ternary(make_codes(m, 512, seed=m), mode=LinearMode.BITNET) for m in (96, 32, 32)
    ]
    weights.append(backend.prepare_dense(torch.randn(8, 512)))
    x = make_x(5, 512, seed=0)
    grouped = backend.linear_group(x, weights)
    assert len(grouped) == 4
    for weight, y in zip(weights, grouped, strict=True):
        assert torch.equal(y, backend.linear(x, weight))


@pytest.mark.parametrize("name", FAST_BACKENDS)
def test_fast_backends_keep_weights_packed(name: str) -> None:
    # 2 bits per weight (+ K padding and the scale): int8-unpacked weights would be 4x larger.
    m, k = 300, 2560
    weight = select_backend(name).prepare_ternary(make_codes(m, k, seed=0), mode=LinearMode.BITNET)
    assert weight.layout is Layout.TERNARY_2BIT
    assert weight.nbytes <= m * k // 4 + 64


@pytest.mark.parametrize("name", FAST_BACKENDS)
def test_fast_backend_rejects_unsupported_block_size(name: str, reference: KernelBackend) -> None:
    values = make_codes(4, 128, seed=0).values
    codes = TernaryCodes(values=values, scale=torch.tensor([[0.5, 0.25]] * 4))  # blocks of 64 columns
    with pytest.raises(UnsupportedModel, match="multiple of 128"):
        select_backend(name).prepare_ternary(codes, mode=LinearMode.BITNET)
    reference.prepare_ternary(codes, mode=LinearMode.BITNET)  # the oracle takes any block size


def test_select_backend_names() -> None:
    assert BACKENDS[0] == "reference"
    assert select_backend("auto").name == ("cpu" if "cpu" in BACKENDS else "reference")
    with pytest.raises(ValueError, match="reference, cpu"):
        select_backend("tpu")


@pytest.mark.parametrize("name", FAST_BACKENDS)
def test_weights_of_another_backend_are_refused(name: str, reference: KernelBackend) -> None:
    weight = reference.prepare_ternary(make_codes(8, 128, seed=0), mode=LinearMode.BITNET)
    with pytest.raises(ValueError, match="prepared by 'reference'"):
        select_backend(name).linear(torch.randn(1, 128), weight)


def test_cpu_thread_count_does_not_change_bits() -> None:
    if "cpu" not in BACKENDS:
        pytest.skip("numba not available")
    import numba

    from bitserve.kernels.cpu.backend import CpuBackend

    codes = make_codes(100, 512, seed=4)
    x = make_x(3, 512, seed=4)
    one, default = CpuBackend(num_threads=1), CpuBackend()
    expected = default.linear(x, default.prepare_ternary(codes, mode=LinearMode.BITNET))
    try:
        y_one = one.linear(x, one.prepare_ternary(codes, mode=LinearMode.BITNET))
        assert numba.get_num_threads() == 1
    finally:  # numba's thread count is per calling thread: restore it for later tests
        numba.set_num_threads(numba.config.NUMBA_NUM_THREADS)
    assert torch.equal(y_one, expected)
    with pytest.raises(ValueError, match="num_threads"):
        CpuBackend(num_threads=0)


def test_cpu_quantizer_matches_reference_on_edge_rows() -> None:
    if "cpu" not in BACKENDS:
        pytest.skip("numba not available")
    from bitserve.kernels.cpu import ternary as cpu_kernels
    from bitserve.kernels.reference import ternary as reference_ternary

    x = make_x(5, 300, seed=8)
    x[1] = 0.0  # all-zero row: the 1e-5 floor
    x[2] *= 1e-7  # every |x| below the floor
    x[3, :7] = torch.tensor([127.0, 2.5, 3.5, -0.5, -1.5, 0.5, 126.5]) / 64  # exact halves
    x[3, 7:] = 0.0
    qp, s_act, q_sum = cpu_kernels.quantize_int16(x.numpy(), cpu_kernels.padded_in_features(300))
    q, s_ref = reference_ternary.quantize_activations(x)
    assert torch.equal(torch.from_numpy(s_act), s_ref)
    expected = cpu_kernels.pad_columns(q.to(torch.int16), cpu_kernels.padded_in_features(300))
    assert torch.equal(torch.from_numpy(qp), expected)
    assert torch.equal(torch.from_numpy(q_sum), q.sum(dim=1, dtype=torch.int32))
    assert q[3, :7].tolist() == [127, 2, 4, 0, -2, 0, 126]


def test_cpu_fma_is_fused() -> None:
    if "cpu" not in BACKENDS:
        pytest.skip("numba not available")
    import numba
    import numpy as np

    from bitserve.kernels.cpu import ternary as cpu_kernels

    fma = numba.njit(lambda a, b, c: cpu_kernels._fma_f32(a, b, c))
    a, b = np.float32(1 + 2.0**-12), np.float32(2.0**-24 * (1 - 2.0**-12 + 2.0**-24))
    assert fma(a, b, np.float32(1.0)) == np.float32(1 + 2.0**-23)  # separate mul + add gives 1.0
    assert np.float32(a * b) + np.float32(1.0) == np.float32(1.0)
