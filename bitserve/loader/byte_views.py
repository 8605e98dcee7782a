"""Torch views of mapped file bytes: one helper for the GGUF reader, the decoder and the checkpoint reader."""

from __future__ import annotations

import warnings

import numpy as np
import torch


def as_uint8_tensor(raw: np.ndarray) -> torch.Tensor:
    """uint8 [n] torch view of `raw` without copying.

    A view of a read-only mmap stays read-only memory (writing to it would fault): nothing in bitserve writes
    to file-layout data, the decoders only read it, so torch's "not writable" warning is silenced for exactly
    this call (`catch_warnings` swaps the process-wide filters for its duration; loads tolerate that). A
    reader that maps the file copy-on-write (mmap ACCESS_COPY) hands over writable views and skips this.
    """
    if raw.dtype != np.uint8 or raw.ndim != 1:
        raise ValueError(f"raw tensor bytes must be a 1-D uint8 array, got {raw.dtype} {raw.shape}")
    if raw.flags.writeable:
        return torch.from_numpy(raw)
    with warnings.catch_warnings():
        warnings.filterwarnings(
            "ignore", message="The given NumPy array is not writable", category=UserWarning
        )
        return torch.from_numpy(raw)
