"""PinnedPair: two pinned host buffers used in turn, each with the CUDA event of its last copy.

A step launched ahead (runner/cuda_lookahead.py) can still be copying through one buffer while the host
prepares the next copy in the other: the graphs' input and table staging (host -> device,
cuda_graphs.DecodeGraphs) needs exactly that.
"""

from __future__ import annotations

from collections.abc import Callable

import torch


class PinnedPair:
    def __init__(self, make_buffer: Callable[[], torch.Tensor]) -> None:
        """make_buffer: a new host tensor, called twice; each is pinned here."""
        self._buffers = [make_buffer().pin_memory() for _ in range(2)]
        self._copied = [torch.cuda.Event(), torch.cuda.Event()]
        self._turn = 0

    def take(self) -> tuple[torch.Tensor, torch.cuda.Event]:
        """The next buffer, once the copy last recorded on it is done (at once unless very recent), and
        its event: record() it after queueing this copy."""
        turn = self._turn
        self._turn = 1 - turn
        self._copied[turn].synchronize()
        return self._buffers[turn], self._copied[turn]
