"""I2_S read in place by the cpu backend: its bytes are the kernels' runtime layout (Layout.TERNARY_2BIT),
so every ISA variant runs on a view of the file's bytes, bit-exact with the reference backend, and a model
load keeps no anonymous copy of its I2_S weights."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch

from bitserve import LLM
from bitserve.errors import InvalidModelFile
from bitserve.kernels.backend import LinearMode
from bitserve.kernels.cpu import ternary as cpu_ternary
from bitserve.kernels.cpu.backend import CpuBackend
from bitserve.kernels.cpu.isa import Isa, supported_isas
from bitserve.kernels.cpu.prepared import Int8BitnetLinear
from bitserve.kernels.packed import Layout, PackedWeight
from bitserve.kernels.reference.backend import ReferenceBackend
from bitserve.kernels.reference.dequant import SCALE_SLOT_BYTES, unpack_ternary
from bitserve.loader.ternary_pack import quantize_i2s

SUPPORTED = supported_isas()
SHAPES = [(45, 256), (16, 640), (3, 128)]  # (M, K): row tails, several 128-column groups


def ternary_matrix(m: int, k: int, seed: int, scale: float = 0.75) -> np.ndarray:
    gen = np.random.default_rng(seed)
    return gen.integers(-1, 2, size=(m, k)).astype(np.float32) * np.float32(scale)


def i2s_weight(file: torch.Tensor, offset: int, m: int, k: int) -> PackedWeight:
    """The I2_S tensor at byte `offset` of `file` (uint8 [n]) as the loader hands it over: a slice."""
    data = file[offset : offset + m * k // 4 + SCALE_SLOT_BYTES]
    return PackedWeight(data, (m, k), Layout.I2_S, "I2_S", params={"i2s_variant": "A"})


def one_file(*matrices: np.ndarray) -> tuple[torch.Tensor, list[int]]:
    """I2_S tensors written one after another into one buffer, as in a GGUF file (32-byte aligned)."""
    blobs = [quantize_i2s(matrix) for matrix in matrices]
    offsets = list(np.cumsum([0] + [len(blob) for blob in blobs[:-1]]))
    return torch.frombuffer(bytearray(b"".join(blobs)), dtype=torch.uint8), offsets


def x_rows(num_tokens: int, k: int, seed: int) -> torch.Tensor:
    return torch.randn(num_tokens, k, generator=torch.Generator().manual_seed(seed))


def test_runtime_layout_is_i2s_variant_a() -> None:
    values = ternary_matrix(7, 384, seed=1, scale=1.0)
    packed = cpu_ternary.pack_ternary(torch.from_numpy(values).to(torch.int8))
    assert packed.numpy().tobytes() == quantize_i2s(values)[: 7 * 384 // 4]


@pytest.mark.parametrize("isa", list(Isa), ids=lambda isa: isa.value)
@pytest.mark.parametrize(("m", "k"), SHAPES)
def test_in_place_weight_is_bit_exact_with_the_reference(isa: Isa, m: int, k: int) -> None:
    if isa not in SUPPORTED:
        pytest.skip(f"this CPU cannot run the {isa.value} kernels")
    file, (offset,) = one_file(ternary_matrix(m, k, seed=m + k))
    weight = i2s_weight(file, offset, m, k)
    backend, reference = CpuBackend(isa=isa.value), ReferenceBackend()
    for mode in (LinearMode.BITNET, LinearMode.FLOAT):
        fast = backend.prepare_ternary_file(weight, mode=mode)
        assert fast is not None and fast.data.data_ptr() == file.data_ptr() + offset  # a view, no copy
        oracle = reference.prepare_ternary(unpack_ternary(weight), mode=mode)
        for num_tokens in (1, 5):
            x = x_rows(num_tokens, k, seed=num_tokens)
            expected = reference.linear(x, oracle)
            if mode is LinearMode.BITNET:
                assert torch.equal(backend.linear(x, fast), expected)
            else:
                torch.testing.assert_close(backend.linear(x, fast), expected, rtol=1e-5, atol=1e-5)


def test_other_formats_and_llamacpp_tq_are_not_read_in_place() -> None:
    file, (offset,) = one_file(ternary_matrix(4, 256, seed=3))
    backend, weight = CpuBackend(), i2s_weight(file, offset, 4, 256)
    assert backend.prepare_ternary_file(weight, mode=LinearMode.LLAMACPP_TQ) is None
    variant_b = PackedWeight(weight.data, (4, 256), Layout.I2_S, "I2_S", params={"i2s_variant": "B"})
    assert backend.prepare_ternary_file(variant_b, mode=LinearMode.BITNET) is None
    assert ReferenceBackend().prepare_ternary_file(weight, mode=LinearMode.BITNET) is None


def refusal(check: Callable[[PackedWeight], object], weight: PackedWeight) -> InvalidModelFile:
    with pytest.raises(InvalidModelFile) as refused:
        check(weight)
    return refused.value


def test_code_three_and_a_wrong_size_are_refused_as_the_reference_refuses() -> None:
    file, (offset,) = one_file(ternary_matrix(4, 256, seed=4))
    corrupt = file.clone()
    corrupt[offset + 37] = 0b0011_0100  # field 1 (bits 4-5) holds code 3
    short = PackedWeight(file[offset : offset + 4 * 256 // 4], (4, 256), Layout.I2_S, "I2_S")  # no scale
    for weight, reason in ((i2s_weight(corrupt, offset, 4, 256), "I2_S code 3"), (short, "holds 256 bytes")):
        in_place = refusal(lambda w: CpuBackend().prepare_ternary_file(w, mode=LinearMode.BITNET), weight)
        reference = refusal(unpack_ternary, weight)
        assert reason in str(in_place) and (str(in_place), in_place.hint) == (str(reference), reference.hint)


@pytest.mark.parametrize("isa", [isa for isa in Isa if isa is not Isa.GENERIC], ids=lambda isa: isa.value)
def test_stacked_in_place_group_is_not_copied(isa: Isa) -> None:
    """q/k/v read in place from one file stack into one weight over a view spanning them (each row found
    by its offset: the scale slots lie between the tensors), bit-identical to the weights one by one."""
    if isa not in SUPPORTED:
        pytest.skip(f"this CPU cannot run the {isa.value} kernels")
    shapes = [(40, 256), (9, 256), (9, 256)]
    matrices = [ternary_matrix(m, k, seed=i, scale=0.5 + i) for i, (m, k) in enumerate(shapes)]
    file, offsets = one_file(*matrices)
    backend = CpuBackend(isa=isa.value)
    weights = [
        backend.prepare_ternary_file(i2s_weight(file, offset, m, k), mode=LinearMode.BITNET)
        for offset, (m, k) in zip(offsets, shapes, strict=True)
    ]
    fused = backend.fuse_group(weights)
    assert fused is not None
    stacked, row_starts = fused
    assert isinstance(stacked, Int8BitnetLinear) and "row_offsets" in stacked.extras
    assert stacked.data.data_ptr() == file.data_ptr()  # a view of the file's bytes, not a concatenation
    for num_tokens in (1, 6):
        x = x_rows(num_tokens, 256, seed=num_tokens)
        out = backend.linear(x, stacked)
        for weight, start in zip(weights, row_starts, strict=True):
            assert torch.equal(out[:, start : start + weight.out_features], backend.linear(x, weight))


def file_mappings(path: Path) -> list[tuple[int, int]]:
    """Address ranges of this process's mappings of `path` (/proc/self/maps)."""
    ranges = []
    for line in Path("/proc/self/maps").read_text().splitlines():
        fields = line.split(maxsplit=5)
        if len(fields) == 6 and fields[5] == str(path):
            start, end = (int(a, 16) for a in fields[0].split("-"))
            ranges.append((start, end))
    return ranges


@pytest.mark.skipif(not Path("/proc/self/maps").exists(), reason="needs Linux /proc")
def test_model_ternary_weights_are_file_backed(b158_file: Path) -> None:
    llm = LLM(str(b158_file), backend="cpu")
    try:
        mapped = file_mappings(b158_file.resolve())
        modules = llm.instance.loaded.model.modules()
        weights = [w for module in modules for w in getattr(module, "weights", [])]
        ternary = [w for w in weights if w.layout is Layout.TERNARY_2BIT]
        assert len(ternary) == 2 * 4  # 2 layers: qkv, o, gate_up, down (q/k/v and gate/up stacked)
        for weight in ternary:
            start = weight.data.data_ptr()
            assert any(lo <= start and start + weight.data.nbytes <= hi for lo, hi in mapped), weight
    finally:
        llm.close()
