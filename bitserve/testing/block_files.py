"""File rows of any block layout for kernel tests: uint8 [M, row bytes] as a GGUF file holds them, from
the independent writers where one exists (gguf-py's quantizers: Q4_0 / Q4_1 / Q5_0 / Q5_1 / Q8_0;
bitserve's Q2_0 / Q1_0 writer, bytes equal to llama.cpp's) and random valid super-blocks for the
K-quants, which gguf-py cannot write: mixed_formats.encode's choice. Needs `gguf` (a test dependency)."""

from __future__ import annotations

import numpy as np

from bitserve.kernels.packed import Layout
from bitserve.testing.mixed_formats import encode


def block_file_rows(layout: Layout, num_rows: int, num_cols: int, seed: int) -> np.ndarray:
    """Seeded weights N(0, 1 / sqrt(K)) in `layout` (random super-blocks for the K-quants); a Q2_0 block
    reaching its code 3 (+2 d) and a zero block (d = 0) in rows 1 and 2 where the shape has them."""
    rng = np.random.default_rng(seed)
    values = rng.normal(0.0, 1.0 / np.sqrt(num_cols), size=(num_rows, num_cols)).astype(np.float32)
    if num_rows > 2 and num_cols >= 128:
        values[1, :64] = np.linspace(-1.0, 2.0, 64, dtype=np.float32)
        values[2, :128] = 0.0
    return np.frombuffer(encode(values, layout.name, seed), dtype=np.uint8).reshape(num_rows, -1).copy()
