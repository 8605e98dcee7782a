"""ternary_step.address_span: one view over the weights' address range, refused when far apart."""

from __future__ import annotations

import numpy as np
import pytest

from bitserve.kernels.cpu import ternary_step
from bitserve.kernels.cpu.ternary_step import address_span


def test_span_over_slices_of_one_buffer_reaches_each_array() -> None:
    buffer = np.arange(4096, dtype=np.uint8)
    parts = [buffer[1000:1500], buffer[100:300], buffer[3000:4096]]
    span = address_span(parts)
    assert span is not None
    view, offsets = span
    assert view.nbytes == 4096 - 100  # from the lowest start to the highest end, nothing more
    for part, offset in zip(parts, offsets, strict=True):
        assert np.array_equal(view[offset : offset + part.nbytes], part)


def test_span_refuses_arrays_far_apart(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(ternary_step, "MAX_SPAN_SLACK", 0)
    buffer = np.zeros(1 << 20, dtype=np.uint8)
    near = [buffer[:1024], buffer[2048:3072]]
    far = [buffer[:1024], buffer[-1024:]]  # a gap of ~1 MiB between 2 KiB of arrays
    assert address_span(near) is not None
    assert address_span(far) is None
