"""q/k/v and gate/up groups stacked for the cpu backend's int8 bitnet kernels (CpuBackend.fuse_group).

A stacked group runs one kernel call over the concatenated rows and quantizes the activations once; each
output row keeps its own weight's scale. Its outputs must be torch.equal to the weights run one by one and
to the reference backend's, for decode (T = 1, the GEMV tile) and prefill (T = 5, the GEMM tile with a
padded token), with weights of different scales and row counts that are not multiples of the row tiles.
"""

from __future__ import annotations

import pytest
import torch

from bitserve.kernels.backend import KernelBackend, LinearMode, PreparedLinear
from bitserve.kernels.packed import TernaryCodes
from bitserve.kernels.select import available_backends, select_backend

pytestmark = pytest.mark.skipif("cpu" not in available_backends(), reason="numba not available")

if "cpu" in available_backends():
    from bitserve.kernels.cpu.backend import CpuBackend
    from bitserve.kernels.cpu.isa import Isa, supported_isas
    from bitserve.kernels.cpu.prepared import Int8BitnetBlockLinear, Int8BitnetLinear

    INT8_ISAS = [isa for isa in supported_isas() if isa is not Isa.GENERIC]
else:  # collected but skipped
    INT8_ISAS = []

K = 1000  # not a multiple of 128: padded columns in every row
ROWS = (37, 11, 21)  # q / k / v-like; none a multiple of the 8- or 4-row tiles or the 16-row task
SCALES = (0.0371, 1.75, 0.002)  # a different per-tensor scale per weight
NUM_TOKENS = (1, 5)  # GEMV; GEMM with one padded token (tile of 2)


def codes(m: int, k: int, seed: int, scale: torch.Tensor) -> TernaryCodes:
    gen = torch.Generator().manual_seed(seed)
    values = torch.randint(-1, 2, (m, k), generator=gen, dtype=torch.int8)
    return TernaryCodes(values=values, scale=scale)


def per_tensor_group() -> list[TernaryCodes]:
    return [
        codes(m, K, seed=m, scale=torch.tensor(s, dtype=torch.float32))
        for m, s in zip(ROWS, SCALES, strict=True)
    ]


def per_block_group() -> list[TernaryCodes]:
    """Scales f32 [M, 4]: blocks of 256 columns (the kernels need a multiple of 128), so K = 1024."""
    gen = torch.Generator().manual_seed(7)
    return [codes(m, 1024, seed=m, scale=torch.rand(m, 4, generator=gen) + 0.01) for m in ROWS]


def x_for(num_tokens: int, k: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(num_tokens)
    x = torch.randn(num_tokens, k, generator=gen) * 2
    x[0, 3] = 40.0  # an outlier, as real activations have
    return x


def assert_group_exact(isa: Isa, group_codes: list[TernaryCodes], strategy: type) -> None:
    """The group stacks into one weight of `strategy`; its split outputs equal the one-by-one outputs
    and the reference backend's, bit for bit."""
    from bitserve.layers.linear import LinearGroup

    backend = CpuBackend(isa=isa)
    reference: KernelBackend = select_backend("reference")
    weights: list[PreparedLinear] = [backend.prepare_ternary(c, mode=LinearMode.BITNET) for c in group_codes]
    oracles = [reference.prepare_ternary(c, mode=LinearMode.BITNET) for c in group_codes]
    group = LinearGroup(backend, weights)
    assert len(group.weights) == 1 and type(group.weights[0]) is strategy
    assert group.row_offsets == [0, ROWS[0], ROWS[0] + ROWS[1]]
    k = weights[0].in_features
    for num_tokens in NUM_TOKENS:
        x = x_for(num_tokens, k)
        outputs = group(x)
        for out, weight, oracle in zip(outputs, weights, oracles, strict=True):
            assert out.shape == (num_tokens, weight.out_features)
            assert torch.equal(out, backend.linear(x, weight)), (num_tokens, weight)
            assert torch.equal(out, reference.linear(x, oracle)), (num_tokens, weight)


@pytest.mark.parametrize("isa", INT8_ISAS, ids=lambda isa: isa.value)
def test_a_stacked_per_tensor_group_is_bit_exact(isa: Isa) -> None:
    assert_group_exact(isa, per_tensor_group(), Int8BitnetLinear)


@pytest.mark.parametrize("isa", INT8_ISAS, ids=lambda isa: isa.value)
def test_a_stacked_per_block_group_is_bit_exact(isa: Isa) -> None:
    assert_group_exact(isa, per_block_group(), Int8BitnetBlockLinear)


@pytest.mark.parametrize("isa", INT8_ISAS, ids=lambda isa: isa.value)
def test_groups_that_cannot_stack_are_left_alone(isa: Isa) -> None:
    """Different K, or a per-tensor weight beside a per-block one: run one by one."""
    backend = CpuBackend(isa=isa)
    tensor_scale = torch.tensor(0.5, dtype=torch.float32)
    other_k = backend.prepare_ternary(codes(9, 640, seed=1, scale=tensor_scale), mode=LinearMode.BITNET)
    first = backend.prepare_ternary(per_tensor_group()[0], mode=LinearMode.BITNET)
    assert backend.fuse_group([first, other_k]) is None
    block = backend.prepare_ternary(per_block_group()[0], mode=LinearMode.BITNET)
    assert backend.fuse_group([first, block]) is None
