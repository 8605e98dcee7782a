"""Stacking one group's prepared CPU weights into one (CpuBackend.fuse_group, once at load): q/k/v or
gate/up of the same strategy and K become a single weight, so a step makes one kernel call over the rows
of all of them. Each output row keeps its own weight's scale: splitting the stacked output is
bit-identical to running the weights one by one.
"""

from __future__ import annotations

from collections.abc import Sequence
from types import MappingProxyType

import torch

from bitserve.kernels.backend import PreparedLinear
from bitserve.kernels.cpu import blockquant, interleaved, mapped
from bitserve.kernels.cpu.prepared import BlockLinear, CpuLinear, CpuTuning, Int8BitnetLinear, row_scales


def stack_rows(
    strategy: type[CpuLinear],
    weights: Sequence[PreparedLinear],
    backend_name: str,
    tuning: CpuTuning,
    *,
    row_scale: bool,
) -> tuple[PreparedLinear, list[int]]:
    """Row-major weights (int8 bitnet: packed rows uint8 [M_i, Kp / 4]; Int8BlockLinear: file blocks
    [M_i, row_bytes]) concatenated, no padding rows; int8 bitnet weights read in place from one file
    are not copied: a view spanning them and each row's offset (mapped.shared_span) stand instead.
    Int8BlockLinear's interleaved records [G_i, nb, record] concatenate the same way (stackable_records).
    Scales: per-tensor ones become f32 [sum M_i], each row's own (row_scale); per-block ones
    f32 [M_i, nb] are concatenated as they are (equal nb).
    Extras every weight has (Q4 mins "m", f32 copies "dense", both [M_i, ...]) are concatenated too."""
    offsets = [0]
    for weight in weights[:-1]:
        offsets.append(offsets[-1] + weight.out_features)
    scales = [w.scale for w in weights if w.scale is not None]
    if row_scale:
        scales = [row_scales(scale, w.out_features) for scale, w in zip(scales, weights, strict=True)]
    first = weights[0]
    shared_extras = [key for key in first.extras if all(key in w.extras for w in weights)]
    extras = {key: torch.cat([w.extras[key] for w in weights]) for key in shared_extras}
    span = mapped.shared_span([w.data for w in weights]) if strategy is Int8BitnetLinear else None
    if span is None:
        data = torch.cat([weight.data for weight in weights])  # [sum M_i, Kp / 4]
    else:
        data, extras["row_offsets"] = span[0], torch.from_numpy(span[1])
    stacked = strategy(
        sum(weight.out_features for weight in weights),
        first.in_features,
        first.layout,
        first.mode,
        data,
        torch.cat(scales),
        backend_name,
        MappingProxyType(extras),
        tuning=tuning,
    )
    return stacked, offsets


def stack_groups(
    strategy: type[BlockLinear], weights: Sequence[PreparedLinear], backend_name: str, tuning: CpuTuning
) -> tuple[PreparedLinear, list[int]]:
    """Block weights: their 64-row groups one after another, padding rows included."""
    offsets, num_padded = [], 0
    for weight in weights:
        offsets.append(num_padded)
        num_padded += weight.data.shape[0] * blockquant.GROUP_ROWS  # each weight's groups, padding included
    data = torch.cat([weight.data for weight in weights])  # [sum G, ...]: the groups one after another
    scale = torch.cat([weight.scale for weight in weights if weight.scale is not None])
    extras: dict[str, torch.Tensor] = {}
    if "m" in weights[0].extras:
        extras["m"] = torch.cat([weight.extras["m"] for weight in weights])
    if all("dense" in weight.extras for weight in weights):
        padded = [_pad_rows(w.extras["dense"], w.data.shape[0] * blockquant.GROUP_ROWS) for w in weights]
        extras["dense"] = torch.cat(padded)  # [num_padded, K]
    first = weights[0]
    stacked = strategy(
        num_padded,
        first.in_features,
        first.layout,
        None,
        data,
        scale,
        backend_name,
        MappingProxyType(extras),
        tuning=tuning,
    )
    return stacked, offsets


def stackable_records(weights: Sequence[PreparedLinear]) -> bool:
    """Whether Int8BlockLinear weights' records can be concatenated: one layout, and every weight but
    the last a whole number of 4-row records (a padded record in the middle would shift the rows after it)."""
    if len({weight.layout for weight in weights}) != 1:
        return False
    return all(weight.out_features % interleaved.GROUP_ROWS == 0 for weight in weights[:-1])


def _pad_rows(dense: torch.Tensor, num_rows: int) -> torch.Tensor:
    if dense.shape[0] == num_rows:
        return dense
    return torch.cat([dense, dense.new_zeros(num_rows - dense.shape[0], dense.shape[1])])
