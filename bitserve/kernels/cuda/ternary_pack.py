"""2-bit plane packing of ternary weights for the CUDA kernels (pure torch: no triton import here).

Layout (the contract between `pack_ternary_planes` and `ternary_matmul`): each group of GROUP = 128
columns of a row is 32 bytes; byte i of group g holds columns g*128 + i + 32*j at bits 2j..2j+1 for
j = 0..3, as the code w + 1 in {0, 1, 2}. Decoding plane j of one group's 32 bytes thus gives 32
*contiguous* columns, so the activation loads that meet a plane stay contiguous (a [T, 32] int8 tile
for a tensor-core dot, or 4-byte words for dp4a).
"""

from __future__ import annotations

import torch

GROUP = 128  # columns per packed group (32 bytes)
NUM_PLANES = 4  # 2-bit fields per byte
PLANE_WIDTH = GROUP // NUM_PLANES  # 32 contiguous columns per plane, = bytes per group


def _check_width(k: int, what: str) -> None:
    if k <= 0 or k % GROUP != 0:
        raise ValueError(f"{what}: K must be a positive multiple of {GROUP}, got {k}")


def pack_ternary_planes(values: torch.Tensor) -> torch.Tensor:
    """int8 [M, K] in {-1, 0, 1}, K % 128 == 0 -> uint8 [M, K // 4] on the same device (layout above)."""
    if values.dtype != torch.int8 or values.dim() != 2:
        raise ValueError(f"ternary values must be int8 [M, K], got {values.dtype} {tuple(values.shape)}")
    m, k = values.shape
    _check_width(k, "pack_ternary_planes")
    # NOTE: not values.abs() > 1: abs(-128) wraps to -128 in int8
    if bool(((values < -1) | (values > 1)).any()):
        raise ValueError("ternary values must lie in {-1, 0, 1}")
    codes = (values + 1).to(torch.uint8).view(m, k // GROUP, NUM_PLANES, PLANE_WIDTH)  # [M, G, j, i]
    packed = (
        codes[:, :, 0] | (codes[:, :, 1] << 2) | (codes[:, :, 2] << 4) | (codes[:, :, 3] << 6)
    )  # [M, G, 32]
    return packed.reshape(m, k // NUM_PLANES).contiguous()


def unpack_ternary_planes(packed: torch.Tensor, k: int) -> torch.Tensor:
    """uint8 [M, K // 4] (layout above) -> int8 [M, K] in {-1, 0, 1}. For tests and fallbacks."""
    if packed.dtype != torch.uint8 or packed.dim() != 2:
        raise ValueError(f"packed planes must be uint8 [M, K // 4], got {packed.dtype} {tuple(packed.shape)}")
    _check_width(k, "unpack_ternary_planes")
    m = packed.shape[0]
    if packed.shape[1] != k // NUM_PLANES:
        raise ValueError(f"packed planes of width {packed.shape[1]} do not hold K = {k} (need {k // 4})")
    groups = packed.reshape(m, k // GROUP, 1, PLANE_WIDTH)  # [M, G, 1, 32]
    shifts = torch.arange(0, 2 * NUM_PLANES, 2, dtype=torch.uint8, device=packed.device).view(1, 1, -1, 1)
    codes = (groups >> shifts) & 3  # [M, G, j, 32]
    if bool((codes == 3).any()):
        raise ValueError("packed planes hold the unused code 3")
    return (codes.to(torch.int8) - 1).reshape(m, k)
