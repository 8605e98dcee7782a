"""TQ2_0 weights transcoded to the cpu kernels' layout at load (kernels/cpu/mapped.py), at the speed of a
copy instead of the unpack-to-int8 path: the rows and scale equal what that path packs, bit for bit;
what it alone can carry (several live d, codes under d = 0) still goes to it; code 3 is refused; and the
prepared linear gives the reference backend's outputs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bitserve.errors import InvalidModelFile
from bitserve.kernels.backend import LinearMode
from bitserve.kernels.cpu import mapped
from bitserve.kernels.cpu.backend import CpuBackend
from bitserve.kernels.cpu.isa import Isa, supported_isas
from bitserve.kernels.cpu.ternary import pack_ternary
from bitserve.kernels.packed import Layout, PackedWeight
from bitserve.kernels.reference.backend import ReferenceBackend
from bitserve.kernels.reference.dequant import unpack_ternary
from bitserve.loader.ternary_pack import tq2_0_from_codes

BLOCK_BYTES = 66


def tq2_0_weight(codes: np.ndarray, scale: float = 0.0371) -> PackedWeight:
    data = torch.frombuffer(bytearray(tq2_0_from_codes(codes, scale)), dtype=torch.uint8)
    return PackedWeight(data, codes.shape, Layout.TQ2_0, "TQ2_0")


def random_codes(m: int, k: int, seed: int) -> np.ndarray:
    return np.random.default_rng(seed).integers(-1, 2, size=(m, k)).astype(np.int8)


@pytest.mark.parametrize(("m", "k"), [(64, 512), (3, 256), (17, 2560)])
def test_transcoded_rows_equal_the_unpack_paths(m: int, k: int) -> None:
    codes = random_codes(m, k, seed=m)
    codes[1, :256] = 0  # an all-zero block: ggml writes d = 0 there, which must not split the scale
    weight = tq2_0_weight(codes)
    found = mapped.tq2_0_rows(weight)
    assert found is not None
    rows, scale = found
    unpacked = unpack_ternary(weight)
    assert torch.equal(rows, pack_ternary(unpacked.values)) and rows.shape == (m, k // 4)
    assert scale.dim() == 0 and scale.item() == unpacked.scale.item() == np.float16(0.0371)


def test_an_all_zero_tensor_has_scale_zero() -> None:
    rows, scale = mapped.tq2_0_rows(tq2_0_weight(np.zeros((4, 256), dtype=np.int8)))
    assert scale.item() == 0.0 and bool((rows == 0x55).all())  # code 1 everywhere: value 0


def test_what_needs_per_block_scales_goes_to_the_unpack_path() -> None:
    codes = random_codes(4, 512, seed=3)
    data = bytearray(tq2_0_from_codes(codes, 0.5))
    data[BLOCK_BYTES + 64 : BLOCK_BYTES + 66] = np.float16(0.25).tobytes()  # block 1 with another d
    two_scales = PackedWeight(torch.frombuffer(data, dtype=torch.uint8), codes.shape, Layout.TQ2_0, "TQ2_0")
    assert mapped.tq2_0_rows(two_scales) is None
    data = bytearray(tq2_0_from_codes(codes, 0.5))
    data[64:66] = np.float16(0.0).tobytes()  # codes under d = 0: they decode to zeros
    dead = PackedWeight(torch.frombuffer(data, dtype=torch.uint8), codes.shape, Layout.TQ2_0, "TQ2_0")
    assert mapped.tq2_0_rows(dead) is None


def test_code_three_is_refused() -> None:
    data = bytearray(tq2_0_from_codes(random_codes(2, 256, seed=4), 0.5))
    data[BLOCK_BYTES + 5] |= 0b11  # a field of code 3 in row 1
    weight = PackedWeight(torch.frombuffer(data, dtype=torch.uint8), (2, 256), Layout.TQ2_0, "TQ2_0")
    with pytest.raises(InvalidModelFile, match="code 3"):
        mapped.tq2_0_rows(weight)


@pytest.mark.parametrize("isa", list(Isa), ids=lambda isa: isa.value)
def test_the_prepared_linear_is_bit_exact_with_the_reference_backend(isa: Isa) -> None:
    if isa not in supported_isas():
        pytest.skip(f"this CPU cannot run the {isa.value} kernels")
    weight = tq2_0_weight(random_codes(48, 768, seed=5))
    backend, reference = CpuBackend(isa=isa.value), ReferenceBackend()
    prepared = backend.prepare_ternary_file(weight, mode=LinearMode.BITNET)
    assert prepared is not None  # the transcode path, not the unpack one
    assert backend.prepare_ternary_file(weight, mode=LinearMode.LLAMACPP_TQ) is None  # ggml's lane order
    oracle = reference.prepare_ternary(unpack_ternary(weight), mode=LinearMode.BITNET)
    for num_tokens in (1, 5):
        x = torch.randn(num_tokens, 768, generator=torch.Generator().manual_seed(num_tokens))
        assert torch.equal(backend.linear(x, prepared), reference.linear(x, oracle))
