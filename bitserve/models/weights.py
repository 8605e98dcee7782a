"""The seam between model code and the loader: models ask for weights by GGUF tensor name.

Model code never sees a storage format: a `WeightSource` hands back prepared linears (ternary or
dense, decided by the loader from the stored type), float vectors, and raw embedding tables.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

import torch

from bitserve.kernels.backend import KernelBackend, LinearMode, PreparedLinear
from bitserve.kernels.packed import PackedWeight


class WeightSource(Protocol):
    backend: KernelBackend
    linear_mode: LinearMode

    def has(self, name: str) -> bool:
        """True if the file holds a tensor of this name."""

    def linear(self, name: str, *, may_be_ternary: bool) -> PreparedLinear:
        """A projection matrix prepared for the backend. `may_be_ternary` lets float-stored weights
        whose values are {-s, 0, +s} run as BitLinear (bitnet-family projections)."""

    def vector(self, name: str) -> torch.Tensor:
        """A 1-D float32 tensor (norm weights, scales)."""

    def packed(self, name: str) -> PackedWeight:
        """The tensor in its file layout (embedding tables)."""

    def head(self, name: str) -> PreparedLinear | torch.Tensor:
        """The LM head: a backend-prepared packed weight, or a float matrix as dense() gives."""

    def file_rows(self, name: str) -> Callable[[torch.Tensor], torch.Tensor] | None:
        """Row ids [T] -> uint8 [T, row bytes] read from the file, for a table whose mapped pages the
        source released (head() under --lm-head q8_0); None while the table is read in place."""

    def dense(self, name: str) -> torch.Tensor:
        """A float matrix [M, K] for the LM head: float32, or F16/BF16 kept as stored when large."""

    def mark_used(self, name: str) -> None:
        """Record that a tensor was consumed without being read through this source."""
