"""Token embedding lookups and the LM head (tied to the embedding or separate).

The embedding table stays in its file layout (a zero-copy view over the mmap); a lookup decodes only
the rows it needs. The LM head is a dense float matmul: big F16 heads (2B-4T: 128256 x 2560) stay F16
(a zero-copy view too) and multiply F16-rounded activations, as llama.cpp's F16 dot product does:
upcasting the weight instead costs 1.3 GB of fresh float32 per step (measured 1.2 s against 0.12 s
per token on the 2B head, benchmarks/RESULTS.md).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn

from bitserve.kernels.backend import KernelBackend, PreparedLinear
from bitserve.kernels.packed import PackedWeight
from bitserve.kernels.reference.dequant import decode_row_bytes, dense_rows
from bitserve.layers import ggml_ops


class TokenEmbedding(nn.Module):
    def __init__(self, table: PackedWeight) -> None:
        super().__init__()
        self.table = table
        self.vocab_size, self.hidden_size = table.shape
        # ids [T] -> the rows' bytes [T, row bytes], read from the file: set (read_from_file) when the
        # table's mapped pages were released, so that lookups do not fault them back in
        self.read_rows: Callable[[torch.Tensor], torch.Tensor] | None = None

    def read_from_file(self, read_rows: Callable[[torch.Tensor], torch.Tensor]) -> None:
        self.read_rows = read_rows

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids [num_tokens] -> [num_tokens, hidden_size] float32
        if self.read_rows is None:
            return dense_rows(self.table, input_ids)
        return decode_row_bytes(self.table, self.read_rows(input_ids))


class LMHead(nn.Module):
    """logits = hidden @ W^T, W [vocab_size, hidden_size]: a backend-prepared weight (block-quantized
    heads stay packed), or a float32 / half tensor. Which of the three runs is decided here, once."""

    def __init__(
        self, weight: PreparedLinear | torch.Tensor, backend: KernelBackend, ggml_f16: bool = False
    ) -> None:
        super().__init__()
        self.weight = weight
        self.kernel: Callable[[torch.Tensor], torch.Tensor]
        # bitnetcpp numerics for an F16-stored head (float32 copy or kept half), bit for bit
        # (layers/ggml_ops.py): ggml on x86 rounds a single row to F16 and runs ggml_vec_dot_f16;
        # llamafile's tinyBLAS takes two or more rows as f32 (FMA lanes, slow to emulate: ~1.5 s per
        # row on a 49152 x 512 head, so only batches that need it pay it)
        self.ggml_f16 = ggml_f16 and not isinstance(weight, PreparedLinear)
        # a half head's logits by the backend's kernel where it has one (same bits as torch's)
        self.gemv: Callable[[torch.Tensor], torch.Tensor] | None = None
        if isinstance(weight, PreparedLinear):
            backend.check_owner(weight)
            self.kernel = weight
        elif weight.dtype == torch.float32:
            self.kernel = functools.partial(F.linear, weight=weight)
        else:
            self.kernel = functools.partial(_half_linear, weight=weight)
            self.gemv = backend.half_head_gemv(weight)

    def forward(self, hidden_states: torch.Tensor, ggml_batch_rows: int | None = None) -> torch.Tensor:
        """hidden_states [num_sampled, hidden_size] -> logits [num_sampled, vocab_size] float32.

        ggml_batch_rows: the rows of the ggml batch these come from (ggml numerics pick the kernel by
        it; default num_sampled): a caller may ask for the logits of a few rows of a larger batch."""
        if self.ggml_f16:
            rows = ggml_batch_rows if ggml_batch_rows is not None else hidden_states.shape[0]
            if rows == 1:
                return ggml_ops.f16_head_one_row(hidden_states, self.weight)
            return ggml_ops.f16_head_tinyblas(hidden_states, self.weight)
        if self.gemv is not None:
            return self.gemv(hidden_states)
        return self.kernel(hidden_states)


def _half_linear(hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F16 / BF16 weight [vocab, hidden]: activations rounded to its dtype, as llama.cpp's dot does."""
    return F.linear(hidden_states.to(weight.dtype), weight).to(torch.float32)
