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
from bitserve.kernels.reference.dequant import dense_rows

HEAD_CHUNK_ROWS = 8192  # rows of a half head upcast at a time: 84 MB of f32 at width 2560


class TokenEmbedding(nn.Module):
    def __init__(self, table: PackedWeight) -> None:
        super().__init__()
        self.table = table
        self.vocab_size, self.hidden_size = table.shape

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids [num_tokens] -> [num_tokens, hidden_size] float32
        return dense_rows(self.table, input_ids)


class LMHead(nn.Module):
    """logits = hidden @ W^T, W [vocab_size, hidden_size]: a backend-prepared weight (block-quantized
    heads stay packed), or a float32 / half tensor. Which of the three runs is decided here, once."""

    def __init__(
        self, weight: PreparedLinear | torch.Tensor, backend: KernelBackend, ggml_f16: bool = False
    ) -> None:
        super().__init__()
        self.weight = weight
        self.kernel: Callable[[torch.Tensor], torch.Tensor]
        if isinstance(weight, PreparedLinear):
            backend.check_owner(weight)
            self.kernel = weight
        elif ggml_f16:
            # bitnetcpp numerics for an F16-stored head (float32 copy or kept half): ggml on x86 takes
            # the activations [H, rows] as f32 where llamafile's tinyBLAS runs (>= 2 rows) and rounds a
            # single row to F16 first. Products are exact in f32 either way, so a kept-half head is
            # upcast chunk by chunk (about 1.2 s against 0.12 s per token on the 2B head), never run in
            # half (which also rounds the logits to F16).
            self.kernel = functools.partial(_ggml_f16_linear, weight=weight)
        elif weight.dtype == torch.float32:
            self.kernel = functools.partial(F.linear, weight=weight)
        else:
            self.kernel = functools.partial(_half_linear, weight=weight)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states [num_sampled, hidden_size] -> logits [num_sampled, vocab_size] float32
        return self.kernel(hidden_states)


def _half_linear(hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """F16 / BF16 weight [vocab, hidden]: activations rounded to its dtype, as llama.cpp's dot does."""
    return F.linear(hidden_states.to(weight.dtype), weight).to(torch.float32)


def _ggml_f16_linear(hidden_states: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """bitnet.cpp's F16 head: one row rounded to F16, then an f32 matmul (a half weight upcast
    HEAD_CHUNK_ROWS rows at a time). hidden f32 [T, H], weight [V, H] -> logits f32 [T, V]."""
    if hidden_states.shape[0] == 1:
        hidden_states = hidden_states.to(torch.float16).to(torch.float32)
    if weight.dtype == torch.float32:
        return F.linear(hidden_states, weight)
    chunks = [
        F.linear(hidden_states, weight[start : start + HEAD_CHUNK_ROWS].to(torch.float32))
        for start in range(0, weight.shape[0], HEAD_CHUNK_ROWS)
    ]
    return torch.cat(chunks, dim=1)  # [T, V]
