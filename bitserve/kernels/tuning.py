"""KernelTuning: every kernel knob of one loaded model, in one frozen object chosen at load.

The values come from ModelConfig (set by the CLI, BITSERVE_* environment variables or a TOML profile in
server/settings.py, the one module that reads the environment, or by LLM(...) keywords); the engine
hands this object to the backend it selects (kernels/select.py) and to the runner. Kernels read their
knobs from it, never from the environment. Defaults are the measured best (benchmarks/RESULTS.md).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

AUTO = "auto"
GemvTile = tuple[int, int, int, int, int, int]  # (M, K, T) of a GEMV -> (block_m, block_w, num_warps)
GemvOverrides = Mapping[tuple[int, int, int], tuple[int, int, int]]  # the same, keyed by (M, K, T)


@dataclass(frozen=True, slots=True)
class KernelTuning:
    # cpu backend: the ternary kernel variant (auto, vnni, avx2, generic: kernels/cpu/isa.py) and how
    # Q4_* / Q8_0 weights meet activations (auto, q8, f32: q8 where the ISA has integer dots)
    cpu_isa: str = AUTO
    block_activations: str = AUTO
    # cuda backend: programmatic dependent launch (kernels/cuda/pdl.py), the greedy head's int8 copy of a
    # float LM head (kernels/cuda/greedy_head.py), the plain greedy step launched ahead and its reserved
    # KV slot (runner/cuda_lookahead.py)
    cuda_pdl: bool = True
    cuda_greedy_head: bool = True
    cuda_lookahead: bool = True
    cuda_lookahead_slot: bool = True
    # tile overrides for sweeps inside the decode chain (benchmarks/ab_gpu_decode.py), empty in use: ternary
    # GEMV tiles by shape (kernels/cuda/ternary_matmul.gemv_config), and the f16 / bf16 decode-attention
    # tile (BLOCK_N, num_warps, num_stages: kernels/cuda/paged_attention._decode_config)
    cuda_gemv_tiles: tuple[GemvTile, ...] = ()
    cuda_decode_tile: tuple[int, int, int] | None = None

    def gemv_overrides(self) -> GemvOverrides:
        """cuda_gemv_tiles as gemv_config takes them: (M, K, T) -> (block_m, block_w, num_warps)."""
        return {tile[:3]: tile[3:] for tile in self.cuda_gemv_tiles}

    def requested_block_activations(self) -> str | None:
        """block_activations as CpuBackend takes it: None for auto (the ISA decides)."""
        return None if self.block_activations == AUTO else self.block_activations


def parse_gemv_tiles(text: str) -> tuple[GemvTile, ...]:
    """ "MxKxT=block_m,block_w,num_warps;..." (ModelConfig.cuda_gemv_tiles) -> tiles; "" -> none. ValueError
    for a malformed entry or a size that is not a positive power of two."""
    tiles = []
    for entry in filter(None, (part.strip() for part in text.split(";"))):
        shape, _, tile = entry.partition("=")
        numbers = [*_positive_ints(shape, "x", 3, entry), *_positive_ints(tile, ",", 3, entry)]
        if any(n & (n - 1) for n in numbers[3:]):
            raise ValueError(f"GEMV tile {entry!r}: block_m, block_w and num_warps must be powers of two")
        tiles.append(tuple(numbers))
    return tuple(tiles)  # type: ignore[return-value]


def parse_decode_tile(text: str) -> tuple[int, int, int] | None:
    """ "BLOCK_N,num_warps,num_stages" (ModelConfig.cuda_decode_tile) -> the tile; "" -> None."""
    if not text.strip():
        return None
    block_n, num_warps, num_stages = _positive_ints(text, ",", 3, text)
    if block_n & (block_n - 1) or num_warps & (num_warps - 1):
        raise ValueError(f"decode tile {text!r}: BLOCK_N and num_warps must be powers of two")
    return block_n, num_warps, num_stages


def _positive_ints(text: str, separator: str, count: int, entry: str) -> list[int]:
    parts = text.split(separator)
    if len(parts) != count or not all(part.strip().isdigit() and int(part) > 0 for part in parts):
        raise ValueError(f"tile {entry!r}: expected {count} positive integers separated by {separator!r}")
    return [int(part) for part in parts]


DEFAULT_TUNING = KernelTuning()  # the measured defaults, for callers that set no knob
