"""The server's heap policy (bitserve/heap.py): frozen only in a process that `bitserve serve` owns, and a
model freed after a freeze is still reclaimed (a swap must not leak the old version's reference cycles)."""

from __future__ import annotations

import gc
import weakref

import pytest

from bitserve import heap


class _Node:
    """A stand-in for a model's objects: a reference cycle only the cyclic collector can free."""

    def __init__(self) -> None:
        self.me = self


@pytest.fixture
def managed(monkeypatch: pytest.MonkeyPatch):  # noqa: ANN201
    monkeypatch.setattr(heap, "_managed", True)
    try:
        yield
    finally:
        gc.unfreeze()  # the test process's heap goes back to the collector


def test_unmanaged_process_is_left_alone(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(heap, "_managed", False)
    assert gc.get_freeze_count() == 0
    heap.refreeze("a test")
    assert gc.get_freeze_count() == 0


def test_refreeze_freezes_the_live_heap_and_reclaims_a_freed_cycle(managed: None) -> None:
    model = _Node()
    alive = weakref.ref(model)
    heap.refreeze("after load")
    assert gc.get_freeze_count() > 0
    gc.collect()
    assert alive() is not None
    del model  # unloaded: the cycle sits in the permanent generation, which collections skip
    gc.collect()
    assert alive() is not None
    heap.refreeze("after unload")  # thaws, collects, freezes the survivors
    assert alive() is None and gc.get_freeze_count() > 0
