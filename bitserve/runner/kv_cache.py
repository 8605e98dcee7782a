"""KV cache sizing and allocation: a memory budget -> CacheLayout -> one page tensor per layer."""

from __future__ import annotations

import dataclasses
import math
import mmap
from dataclasses import dataclass

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

    @property
    def bytes_per_token(self) -> int:
        return self.bytes_per_block // self.block_size

    @property
    def num_usable_tokens(self) -> int:
        """Token slots requests can hold: every block but the reserved null block (core/block_pool.py)."""
        return (self.num_blocks - 1) * self.block_size

    def describe(self) -> dict[str, int | str]:
        """What /health and /v1/models show of the pool."""
        return {
            "num_tokens": self.num_usable_tokens,
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "memory_bytes": self.total_bytes,
            "bytes_per_token": self.bytes_per_token,
            "dtype": str(self.dtype).removeprefix("torch."),
        }


def _empty_layout(spec: ModelSpec, block_size: int, dtype_name: str) -> CacheLayout:
    if dtype_name not in KV_DTYPES:
        raise ModelLoadError(
            f"unknown KV cache dtype {dtype_name!r}", hint=f"use one of {', '.join(KV_DTYPES)}"
        )
    return CacheLayout(
        0, block_size, spec.num_layers, spec.num_kv_heads, spec.head_dim, KV_DTYPES[dtype_name]
    )


def kv_bytes_per_token(spec: ModelSpec, dtype_name: str) -> int:
    """K and V of one token over every layer, in `dtype_name` (resolved, not "auto")."""
    return _empty_layout(spec, 1, dtype_name).bytes_per_token


def plan_cache(
    spec: ModelSpec, *, block_size: int, memory_bytes: int, dtype_name: str, num_blocks: int | None = None
) -> CacheLayout:
    """Blocks that fit `memory_bytes` (or exactly `num_blocks` when given). dtype_name "auto" must be
    resolved by the caller (`resolve_kv_dtype`)."""
    layout = _empty_layout(spec, block_size, dtype_name)
    count = num_blocks if num_blocks is not None else memory_bytes // layout.bytes_per_block
    if count < 2:
        raise ModelLoadError(
            f"KV cache budget of {memory_bytes} bytes holds {count} blocks of {layout.bytes_per_block} bytes",
            hint="raise the KV cache memory (--kv-cache-memory-bytes)",
        )
    return dataclasses.replace(layout, num_blocks=count)


def num_blocks_for_tokens(num_tokens: int, block_size: int) -> int:
    """Blocks whose usable slots hold `num_tokens`: whole blocks, plus the reserved null block."""
    return -(-num_tokens // block_size) + 1


def resolve_kv_dtype(name: str, device: torch.device) -> str:
    return AUTO_KV_DTYPE.get(device.type, "float32") if name == "auto" else name


def allocate_kv_caches(layout: CacheLayout) -> list[torch.Tensor]:
    """One tensor per layer: [2 (K, V), num_blocks, block_size, num_kv_heads, head_dim].

    The layers share one anonymous private mapping: zero pages the kernel hands out on first write, so
    untouched blocks cost no resident memory and a pool sized for long contexts occupies RAM only as sequences
    fill it (core/block_pool.py reuses touched blocks first). Zeros, not garbage, because padded key
    slots are read (then masked) by batched decode attention, and NaN * 0 would poison the output.
    NOTE: transparent huge pages off for these mappings. NumPy asks for them on every large array
    (madvise(MADV_HUGEPAGE), its default on Linux), and then the first write into each 2 MiB of a layer's
    K or V half faulted in the whole 2 MiB: measured 84 MiB resident for ~16 blocks in use on SmolLM2
    (30 layers x 2 halves), where 4 KiB pages hold them in ~12 MiB. Hence a plain mapping, not np.zeros.
    """
    shape = (2, layout.num_blocks, layout.block_size, layout.num_kv_heads, layout.head_dim)
    # one mapping, viewed per layer: the cpu backend's ternary decode step passes the whole pool in one
    # argument (kernels/cpu/step_layers.pooled_layers)
    return list(_zeroed_pages((layout.num_layers, *shape), layout.dtype).unbind(0))


def _zeroed_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A CPU tensor over a fresh anonymous mapping (lazily zeroed pages, no huge pages)."""
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    pages = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_NOHUGEPAGE"):  # Linux; elsewhere there is nothing to turn off
        pages.madvise(mmap.MADV_NOHUGEPAGE)
    # the tensor keeps `pages` alive through the buffer it views
    return torch.frombuffer(pages, dtype=dtype).view(shape)
