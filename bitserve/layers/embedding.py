"""Token embedding lookups and the LM head (tied to the embedding or separate).

The embedding table stays in its file layout (a zero-copy view over the mmap); a lookup decodes only
the rows it needs. The LM head is a dense float matmul: big F16 heads (2B-4T: 128256 x 2560) stay F16
and are upcast in row chunks so that resident memory holds no float32 copy.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from bitserve.kernels.packed import PackedWeight
from bitserve.kernels.reference.dequant import dense_rows

# rows of a half-precision head upcast at once: bounds the temporary to ~84 MB at width 2560
HEAD_CHUNK_ROWS = 8192


class TokenEmbedding(nn.Module):
    def __init__(self, table: PackedWeight) -> None:
        super().__init__()
        self.table = table
        self.vocab_size, self.hidden_size = table.shape

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        # input_ids [num_tokens] -> [num_tokens, hidden_size] float32
        return dense_rows(self.table, input_ids)


class LMHead(nn.Module):
    """logits = hidden @ W^T, W [vocab_size, hidden_size] in float32 or a half type."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = weight

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        # hidden_states [num_sampled, hidden_size] -> logits [num_sampled, vocab_size] float32
        if self.weight.dtype == torch.float32:
            return F.linear(hidden_states, self.weight)
        chunks = [
            F.linear(hidden_states, self.weight[start : start + HEAD_CHUNK_ROWS].to(torch.float32))
            for start in range(0, self.weight.shape[0], HEAD_CHUNK_ROWS)
        ]
        return torch.cat(chunks, dim=-1)
