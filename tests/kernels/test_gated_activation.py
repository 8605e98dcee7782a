"""The cpu backend's gated activations (kernels/cpu/decode_glue.py): one rule, is_parallel_gate, picks
the serial or the parallel kernel for the module forward and the lean decode step alike, and the two
give the same bits on either side of it."""

from __future__ import annotations

import pytest
import torch

from bitserve.kernels.cpu import decode_glue
from bitserve.kernels.cpu.backend import CpuBackend

THRESHOLD = decode_glue.PARALLEL_GATE_TOKENS
KERNELS = {"silu": ("silu_mul", "silu_and_mul"), "relu2": ("relu2_mul", "relu2_and_mul")}


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
