"""The cpu backend's gated activations (kernels/cpu/decode_glue.py): one rule, is_parallel_gate, picks
the serial or the parallel kernel for the module forward and the lean decode step alike, and the two
give the same bits on either side of it."""

from __future__ import annotations

import math

import pytest
import torch

from bitserve.kernels.cpu import decode_glue
from bitserve.kernels.cpu.backend import CpuBackend

THRESHOLD = decode_glue.PARALLEL_GATE_TOKENS
KERNELS = {
    "silu": ("silu_mul", "silu_and_mul"),
    "relu2": ("relu2_mul", "relu2_and_mul"),
    "gelu": ("gelu_mul", "gelu_and_mul"),
}


@pytest.mark.parametrize("activation", KERNELS)
@pytest.mark.parametrize("num_tokens", [1, THRESHOLD - 1, THRESHOLD, 17])
def test_the_rule_picks_the_kernel_and_both_give_the_same_bits(
    activation: str, num_tokens: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    serial_name, method = KERNELS[activation]
    generator = torch.Generator().manual_seed(num_tokens)
    gate, up = (torch.randn(num_tokens, 333, generator=generator) * 8 for _ in range(2))
    serial = torch.empty_like(gate)
    getattr(decode_glue, serial_name)(gate.numpy(), up.numpy(), serial.numpy())
    ran: list[str] = []
    for name in (serial_name, f"{serial_name}_parallel"):
        kernel = getattr(decode_glue, name)
        monkeypatch.setattr(
            decode_glue, name, lambda *arrays, kernel=kernel, name=name: (ran.append(name), kernel(*arrays))
        )
    out = getattr(CpuBackend(), method)(gate, up)
    assert torch.equal(out.view(torch.int32), serial.view(torch.int32))
    parallel = num_tokens >= THRESHOLD
    assert decode_glue.is_parallel_gate(num_tokens) is parallel
    assert ran == [f"{serial_name}_parallel" if parallel else serial_name]


def test_gelu_is_the_tanh_gelu_to_f32_rounding() -> None:
    """decode_glue.gelu_mul is torch's GELU-tanh formula with libm's f32 tanh (torch's vector code has
    Sleef's), so it is not torch's to the bit; both are the f64 formula's value to a few f32 roundings of
    |gate * up| (where tanh nears -1, 1 + tanh keeps only those). The backend hands it out for gelu on
    int8 projections only (elsewhere torch's GELU runs)."""
    from bitserve.layers.activation import gelu_and_mul

    generator = torch.Generator().manual_seed(0)
    gate, up = torch.randn(7, 333, generator=generator) * 4, torch.randn(7, 333, generator=generator)
    g, u = gate.double(), up.double()
    exact = 0.5 * g * (1 + torch.tanh(math.sqrt(2 / math.pi) * (g + 0.044715 * g**3))) * u
    bound = 4 * torch.finfo(torch.float32).eps * (g * u).abs()
    for gelu in (CpuBackend().gelu_and_mul, gelu_and_mul):
        assert ((gelu(gate, up).double() - exact).abs() <= bound).all()
    backend = CpuBackend()
    assert backend.gated_activation("gelu", int8_projections=True) == backend.gelu_and_mul
    assert backend.gated_activation("gelu", int8_projections=False) is None
