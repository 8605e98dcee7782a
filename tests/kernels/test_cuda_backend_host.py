"""The CUDA backend's host-side logic, in CI without a GPU or Triton: weight preparation, group stacking,
the reference fallback, backend/device selection and the CUDA defaults. (Kernel numerics: the `gpu`
tests in tests/kernels/test_cuda_*.py and tests/gpu/.)"""

from __future__ import annotations

import pytest
import torch

from bitserve.batch_limits import CUDA_BATCH_LIMITS, resolve_batch_limits
from bitserve.config import SchedulerConfig
from bitserve.errors import InvalidRequest
from bitserve.kernels.backend import LinearMode
from bitserve.kernels.cuda.backend import CudaBackend
from bitserve.kernels.cuda.linears import CudaDenseLinear, CudaTernaryLinear
from bitserve.kernels.cuda.ternary_pack import unpack_ternary_planes
from bitserve.kernels.packed import Layout, TernaryCodes
from bitserve.kernels.reference.ternary import bitnet_linear
from bitserve.kernels.select import select_backend
from bitserve.runner.kv_cache import resolve_kv_dtype


def codes(m: int, k: int, scale: float, seed: int = 0) -> TernaryCodes:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-1, 2, (m, k), generator=gen, dtype=torch.int8)
    return TernaryCodes(values=values, scale=torch.tensor(scale, dtype=torch.float32))


def test_bitnet_weights_are_packed_planes_with_row_scales() -> None:
    backend = CudaBackend("cpu")
    weight_codes = codes(64, 256, 0.25)
    weight = backend.prepare_ternary(weight_codes, mode=LinearMode.BITNET)
    assert isinstance(weight, CudaTernaryLinear) and weight.layout is Layout.TERNARY_2BIT
    assert weight.data.dtype == torch.uint8 and weight.data.shape == (64, 64)
    assert torch.equal(unpack_ternary_planes(weight.data, 256), weight_codes.values)
    assert torch.equal(weight.scale, torch.full((64,), 0.25))


def test_groups_stack_rows_and_keep_each_weight_scale() -> None:
    backend = CudaBackend("cpu")
    parts = [backend.prepare_ternary(codes(m, 256, s, i), mode=LinearMode.BITNET) for i, (m, s) in
             enumerate([(64, 0.5), (32, 0.25), (32, 2.0)])]  # fmt: skip
    stacked, offsets = backend.fuse_group(parts)
    assert offsets == [0, 64, 96] and stacked.out_features == 128
    assert torch.equal(
        stacked.scale, torch.cat([torch.full((64,), 0.5), torch.full((32,), 0.25), torch.full((32,), 2.0)])
    )
    dense = [backend.prepare_dense(torch.randn(m, 16)) for m in (8, 4)]
    stacked_dense, dense_offsets = backend.fuse_group(dense)
    assert isinstance(stacked_dense, CudaDenseLinear) and dense_offsets == [0, 8]
    assert backend.fuse_group([parts[0], dense[0]]) is None  # mixed strategies do not stack


@pytest.mark.parametrize("mode", [LinearMode.FLOAT, LinearMode.LLAMACPP_TQ])
def test_other_modes_fall_back_to_the_reference_code_on_the_device(mode: LinearMode) -> None:
    backend = CudaBackend("cpu")
    weight = backend.prepare_ternary(codes(16, 256, 0.5), mode=mode)
    assert weight.backend == "cuda" and not isinstance(weight, CudaTernaryLinear)
    x = torch.randn(3, 256)
    reference = select_backend("reference").prepare_ternary(codes(16, 256, 0.5), mode=mode)
    assert torch.equal(weight(x), reference(x))


def test_odd_widths_fall_back_and_stay_exact() -> None:
    backend = CudaBackend("cpu")
    weight = backend.prepare_ternary(codes(8, 96, 0.5), mode=LinearMode.BITNET)  # 96 % 128 != 0
    assert not isinstance(weight, CudaTernaryLinear)
    x = torch.randn(2, 96)
    assert torch.equal(weight(x), bitnet_linear(x, codes(8, 96, 0.5).values, torch.tensor(0.5)))


def test_backend_and_device_must_agree() -> None:
    with pytest.raises(ValueError, match="does not run on device"):
        select_backend("cuda", device="cpu")
    with pytest.raises(ValueError, match="does not run on device"):
        select_backend("cpu", device="cuda:0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="needs CUDA and Triton"):
            select_backend("auto", device="cuda")


def test_cuda_defaults() -> None:
    assert resolve_kv_dtype("auto", torch.device("cuda", 0)) == "float16"
    assert resolve_kv_dtype("auto", torch.device("cpu")) == "float32"
    assert resolve_kv_dtype("bfloat16", torch.device("cuda")) == "bfloat16"
    limits = resolve_batch_limits(SchedulerConfig(), "Q4_1", "cuda")
    assert limits.max_num_seqs == CUDA_BATCH_LIMITS.max_num_seqs
    assert limits.max_num_batched_tokens == CUDA_BATCH_LIMITS.max_num_batched_tokens
    assert resolve_batch_limits(SchedulerConfig(), "Q4_1").max_num_seqs != CUDA_BATCH_LIMITS.max_num_seqs


def test_load_device_refuses_unresolved_auto() -> None:
    from bitserve.engine.instance import load_device

    assert load_device("cuda:1") == torch.device("cuda", 1)
    with pytest.raises(InvalidRequest, match="resolved before a load"):
        load_device("auto")
