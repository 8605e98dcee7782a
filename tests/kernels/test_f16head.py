"""The cpu backend's F16 LM head (kernels/cpu/f16head.py) gives torch's logits to the bit, for one row or
several, where torch runs its AVX2 or its AVX-512 kernels."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from bitserve.kernels.cpu.backend import CpuBackend
from bitserve.kernels.cpu.f16head import TORCH_CAPABILITIES, f16_head_rows, supports
from bitserve.kernels.reference.backend import ReferenceBackend
from bitserve.layers.embedding import LMHead

# the kernel repeats the summation order of torch's F16 GEMV, which its AVX2 and AVX-512 builds share; the
# parity tests run on the capability torch runs here (ATEN_CPU_CAPABILITY=avx2 tries the other)
CAPABILITY = torch.backends.cpu.get_cpu_capability()
needs_torch_vectors = pytest.mark.skipif(
    CAPABILITY not in TORCH_CAPABILITIES,
    reason=f"torch runs its {CAPABILITY} kernels here: the head stays torch's",
)


def torch_logits(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """What the head computed before this kernel (layers/embedding._half_linear)."""
    return torch.nn.functional.linear(hidden.to(weight.dtype), weight).to(torch.float32)


def torch_rows(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """torch's single-token GEMV on each row: the plain decode step's logits, which a speculative verify's
    rows must repeat. (torch's own multi-row GEMM is not that everywhere: on an Intel Xeon with AVX-512
    VNNI its 2-row F16 product differed from its 1-row one in the last bits, 2026-12-08; on Zen 4 they
    agreed.)"""
    return torch.cat([torch_logits(hidden[i : i + 1], weight) for i in range(hidden.shape[0])])


def random_head(vocab: int, width: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(vocab, width, generator=generator) * 0.05).to(torch.float16)
    hidden = torch.randn(1, width, generator=generator) * 3
    return weight, hidden


def same_bits(a: torch.Tensor, b: torch.Tensor) -> bool:
    return torch.equal(a.view(torch.int32), b.view(torch.int32))


@needs_torch_vectors
@pytest.mark.parametrize(("vocab", "width"), [(1000, 2560), (333, 576), (17, 64), (4099, 128)])
def test_gemv_equals_torch_bit_for_bit(vocab: int, width: int) -> None:
    weight, hidden = random_head(vocab, width, seed=vocab)
    out = np.empty((1, vocab), dtype=np.float32)
    x = hidden.to(torch.float16).to(torch.float32).numpy()
    f16_head_rows(weight.view(torch.int16).numpy().view(np.uint16), x, out)
    assert same_bits(torch.from_numpy(out), torch_logits(hidden, weight))


@needs_torch_vectors
@pytest.mark.parametrize(("vocab", "width"), [(1000, 2560), (333, 640), (4099, 128)])
def test_rows_equal_torch_bit_for_bit_on_its_lanes(vocab: int, width: int) -> None:
    """Every row count (a 5-row verify among them) gives torch's bits, on the lanes torch runs here."""
    weight, _ = random_head(vocab, width, seed=vocab + 1)
    generator = torch.Generator().manual_seed(width)
    for num_rows in (1, 2, 5, 9):
        hidden = torch.randn(num_rows, width, generator=generator) * 3
        x = hidden.to(torch.float16).to(torch.float32).numpy()
        out = np.empty((num_rows, vocab), dtype=np.float32)
        f16_head_rows(weight.view(torch.int16).numpy().view(np.uint16), x, out)
        assert same_bits(torch.from_numpy(out), torch_rows(hidden, weight)), num_rows


@needs_torch_vectors
def test_overflow_and_f16_rounding_match_torch() -> None:
    """Sums past the F16 range store as inf; tiny ones round to F16 subnormals or zero, as torch's do."""
    weight, hidden = random_head(256, 128, seed=7)
    weight[0] = 60000.0  # 128 * 60000 * |x| overflows F16
    weight[1] = 1e-4
    hidden = hidden.abs()
    head = LMHead(weight, CpuBackend(num_threads=2))
    logits = head(hidden)
    assert torch.isinf(logits[0, 0])
    assert same_bits(logits, torch_logits(hidden, weight))


@needs_torch_vectors
def test_lm_head_uses_it_for_every_row_count() -> None:
    weight, _ = random_head(520, 256, seed=3)
    cpu_head, reference_head = LMHead(weight, CpuBackend(num_threads=2)), LMHead(weight, ReferenceBackend())
    assert cpu_head.gemv is not None and reference_head.gemv is None
    hidden = torch.randn(5, 256, generator=torch.Generator().manual_seed(5))
    for rows in (hidden[:1], hidden[:3], hidden):  # the numba kernel; torch's GEMV on each row
        assert same_bits(cpu_head(rows), torch.cat([reference_head(row[None]) for row in rows]))
    # and a row's logits do not depend on the rows beside it (a verify equals the plain steps)
    assert same_bits(cpu_head(hidden)[4:], cpu_head(hidden[4:]))


def test_widths_outside_whole_blocks_stay_on_torch() -> None:
    assert not supports(100) and supports(2560)
    weight, hidden = random_head(64, 100, seed=11)
    head = LMHead(weight, CpuBackend(num_threads=2))
    assert head.gemv is None
    assert same_bits(head(hidden), torch_logits(hidden, weight))


def test_generic_isa_keeps_torch() -> None:
    """The portable variant's CPUs may lack F16C, which the kernel's IR relies on."""
    weight, _ = random_head(64, 128, seed=13)
    assert LMHead(weight, CpuBackend(num_threads=2, isa="generic")).gemv is None


def test_torch_without_vector_kernels_keeps_torch(monkeypatch: pytest.MonkeyPatch) -> None:
    """Where torch runs neither its AVX2 nor its AVX-512 kernels the sums' order may differ: torch keeps
    the head."""
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "DEFAULT")
    weight, _ = random_head(64, 128, seed=17)
    assert LMHead(weight, CpuBackend(num_threads=2)).gemv is None
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    assert LMHead(weight, CpuBackend(num_threads=2)).gemv is not None
