"""Host memory a load may take (loader/host_memory.py), and the refusal of a layout whose f32 copies do not
fit (a clear error at load instead of the OOM killer halfway through)."""

from __future__ import annotations

from pathlib import Path

import pytest

from bitserve.errors import UnsupportedModel
from bitserve.kernels.reference.backend import ReferenceBackend
from bitserve.loader import host_memory, model_loader
from bitserve.loader.host_memory import available_host_memory_bytes
from bitserve.loader.model_loader import LoadOptions, load_model


def test_mem_available_is_read_from_meminfo(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemTotal:       24576000 kB\nMemAvailable:   12000000 kB\nBuffers: 1 kB\n")
    monkeypatch.setattr(host_memory, "read_memory_limit_bytes", lambda: None)
    assert available_host_memory_bytes(meminfo, tmp_path / "absent") == 12_000_000 * 1024


def test_a_cgroup_limit_below_mem_available_wins(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    meminfo, current = tmp_path / "meminfo", tmp_path / "memory.current"
    meminfo.write_text("MemAvailable:   12000000 kB\n")
    current.write_text(str(3 * 2**30))
    monkeypatch.setattr(host_memory, "read_memory_limit_bytes", lambda: 4 * 2**30)
    assert available_host_memory_bytes(meminfo, current) == 2**30  # 4 GiB limit less 3 GiB in use
    monkeypatch.setattr(host_memory, "read_memory_limit_bytes", lambda: None)
    assert available_host_memory_bytes(tmp_path / "absent", current) is None  # nothing readable


def test_a_layout_whose_f32_copies_cannot_fit_is_refused_with_the_numbers(
    hf_gguf,  # noqa: ANN001
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _, path = hf_gguf("qwen3", "Q2_0")  # Q2_0: no packed kernel yet, so its projections go f32
    monkeypatch.setattr(model_loader, "available_host_memory_bytes", lambda: 1_000_000)
    with pytest.raises(UnsupportedModel, match=r"Q2_0 projections have no packed kernel.*GB of host memory"):
        load_model(path, LoadOptions(backend=ReferenceBackend()))
    monkeypatch.setattr(model_loader, "available_host_memory_bytes", lambda: 10**12)
    loaded = load_model(path, LoadOptions(backend=ReferenceBackend()))  # fits: loads as before
    loaded.close()
