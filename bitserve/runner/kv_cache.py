"""KV cache sizing and allocation: a memory budget -> CacheLayout -> one page tensor per layer."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from bitserve.errors import ModelLoadError
from bitserve.models.spec import ModelSpec

KV_DTYPES: dict[str, torch.dtype] = {
    "float32": torch.float32,
    "float16": torch.float16,
    "bfloat16": torch.bfloat16,
}
# "auto": exact f32 on CPU (the reference's precision); half on a GPU, where decode attention is
# bandwidth-bound and the KV cache is most of the memory of a busy server
AUTO_KV_DTYPE = {"cpu": "float32", "cuda": "float16"}


@dataclass(frozen=True, slots=True)
class CacheLayout:
    num_blocks: int
    block_size: int
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype

    @property
    def bytes_per_block(self) -> int:
        element_size = torch.empty((), dtype=self.dtype).element_size()
        # K and V, every layer
        return 2 * self.num_layers * self.block_size * self.num_kv_heads * self.head_dim * element_size

    @property
    def total_bytes(self) -> int:
        return self.bytes_per_block * self.num_blocks


def plan_cache(
    spec: ModelSpec, *, block_size: int, memory_bytes: int, dtype_name: str, num_blocks: int | None = None
) -> CacheLayout:
    """Blocks that fit `memory_bytes` (or exactly `num_blocks` when given). dtype_name "auto" must be
    resolved by the caller (`resolve_kv_dtype`)."""
    if dtype_name not in KV_DTYPES:
        raise ModelLoadError(
            f"unknown KV cache dtype {dtype_name!r}", hint=f"use one of {', '.join(KV_DTYPES)}"
        )
    layout = CacheLayout(
        0, block_size, spec.num_layers, spec.num_kv_heads, spec.head_dim, KV_DTYPES[dtype_name]
    )
    count = num_blocks if num_blocks is not None else memory_bytes // layout.bytes_per_block
    if count < 2:
        raise ModelLoadError(
            f"KV cache budget of {memory_bytes} bytes holds {count} blocks of {layout.bytes_per_block} bytes",
            hint="raise the KV cache memory (--kv-cache-memory)",
        )
    return CacheLayout(count, block_size, spec.num_layers, spec.num_kv_heads, spec.head_dim, layout.dtype)


def resolve_kv_dtype(name: str, device: torch.device) -> str:
    return AUTO_KV_DTYPE.get(device.type, "float32") if name == "auto" else name


def allocate_kv_caches(layout: CacheLayout) -> list[torch.Tensor]:
    """One tensor per layer: [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim].

    Zeroed lazily (calloc through numpy): untouched pages cost no resident memory, so a cache sized for
    long contexts does not occupy RAM until sequences fill it. Zeros, not garbage, because padded key
    slots are read (then masked) by batched decode attention, and NaN * 0 would poison the output.
    """
    shape = (2, layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    if layout.dtype == torch.bfloat16:  # numpy has no bfloat16
        return [torch.zeros(shape, dtype=layout.dtype) for _ in range(layout.num_layers)]
    numpy_dtype = np.float32 if layout.dtype == torch.float32 else np.float16
    return [torch.from_numpy(np.zeros(shape, dtype=numpy_dtype)) for _ in range(layout.num_layers)]
