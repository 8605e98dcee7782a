"""The tables of the ternary lean decode step (kernels/cpu/decode_step.py), stacked once at load.

FastCpuDecode (fast_decode.py) hands a ternary model's decode steps to `TernaryStep.run`: one numba
call for every layer. Its weights stay where the loader put them (no copy): each layer's stacked
Int8BitnetLinear is (w uint8 [n], row_off int64 [M]), and every w of a model lies in one address range
(the file mapping for I2_S; for repacked formats, the arrays the loader allocated), so one uint8 view of
that range and row offsets relative to it, stacked [L, M] per projection, reach every row. Repacked arrays
are not always near each other: the allocator's choice between its heap and fresh mappings depends on
what the process freed before (seen once in a full test run: a TQ2_0 model's arrays terabytes apart, so
the model silently fell back to the layer-by-layer forward). Then they are copied into one buffer, each
linear moved onto its slice (consolidate), and the step is built over that.
"""

from __future__ import annotations

import ctypes
import logging
from typing import TYPE_CHECKING

import numpy as np
import torch

from bitserve.kernels.cpu.decode_step import DECODE_LAYERS
from bitserve.kernels.cpu.step_layers import StepLayer, projection_columns, shared_tables, stack

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from bitserve.kernels.cpu.prepared import Int8BitnetLinear


# how far one view may reach past the bytes it is for: separate large allocations sit close together in
# the process's mapping area; a span much wider than them means the arrays lie far apart
MAX_SPAN_SLACK = 1 << 30
ARENA_ALIGN = 64  # bytes: each weight's start in a consolidated buffer (a cache line)


def address_span(arrays: list[np.ndarray]) -> tuple[np.ndarray, list[int]] | None:
    """One uint8 view from the lowest start to the highest end of `arrays` (C-contiguous), and each one's
    byte offset in it. The kernels read only the offsets handed to them, each inside one of `arrays`;
    where the arrays are separate allocations the view also spans memory between them that nothing
    reads (a view, not a copy: nothing is touched or allocated). None when that gap would pass
    MAX_SPAN_SLACK plus the arrays' own size (the caller then keeps the per-layer path). The caller
    keeps `arrays` alive."""
    starts = [a.ctypes.data for a in arrays]
    low = min(starts)
    high = max(start + a.nbytes for start, a in zip(starts, arrays, strict=True))
    if high - low > 2 * sum(a.nbytes for a in arrays) + MAX_SPAN_SLACK:
        return None
    view = np.ctypeslib.as_array((ctypes.c_uint8 * (high - low)).from_address(low))
    return view, [start - low for start in starts]


def consolidate(linears: list[Int8BitnetLinear]) -> int | None:
    """Copy the weights' packed rows into one buffer (each start ARENA_ALIGN-aligned) and move each linear
    onto its slice (Int8BitnetLinear.move_data: the separate arrays are released as they are replaced), so
    that one view spans them all. Returns the bytes copied; None, changing nothing, where a weight reads
    its rows in place from the file."""
    unique = list({id(linear): linear for linear in linears}.values())
    if any("row_offsets" in linear.extras for linear in unique):
        return None
    starts, total = [], 0
    for linear in unique:
        starts.append(total)
        total += -(-linear.data.nbytes // ARENA_ALIGN) * ARENA_ALIGN
    arena = torch.empty(total, dtype=torch.uint8)  # pages are touched only as the copies fill them
    for linear, start in zip(unique, starts, strict=True):
        part = arena[start : start + linear.data.nbytes].view(linear.data.shape)
        part.copy_(linear.data)
        linear.move_data(part)
    return total


class ScatteredWeights(Exception):
    """The weights lie too far apart in memory for one view (address_span)."""


class TernaryStep:
    """Every layer of a ternary model's decode step in one numba call of the backend's ISA."""

    @classmethod
    def build(cls, layers: list[StepLayer]) -> TernaryStep | None:
        """The step; weights lying far apart (address_span) are first consolidated into one buffer. None
        when they lie apart and some are read in place from the file (they cannot move)."""
        try:
            return cls(layers)
        except ScatteredWeights:
            pass
        moved = consolidate([parts[0] for column in projection_columns(layers) for parts in column])
        if moved is None:
            logger.info("ternary weights lie far apart in memory: the lean decode step runs layer by layer")
            return None
        logger.info("ternary weights lay far apart in memory: %.1f MB copied into one buffer", moved / 1e6)
        return cls(layers)

    def __init__(self, layers: list[StepLayer]) -> None:
        # one stacked weight a projection (step_layers.step_layer holds ternary layers to that)
        projections = [[parts[0] for parts in column] for column in projection_columns(layers)]
        weights = [[weight.kernel_weight for weight in column] for column in projections]
        span = address_span([w for column in weights for w, _ in column])
        if span is None:
            raise ScatteredWeights
        self.base, starts = span
        starts_per_projection = np.reshape(starts, (len(projections), len(layers)))
        self.offsets = tuple(
            stack(
                [row_off + start for (_, row_off), start in zip(column, column_starts, strict=True)], np.int64
            )
            for column, column_starts in zip(weights, starts_per_projection, strict=True)
        )
        self.row_scales = tuple(stack([w.kernel_row_scale for w in column]) for column in projections)
        out_scales = tuple(stack([lay.output_scales[i] for lay in layers]) for i in range(len(projections)))
        # a model without `.scale` tensors skips the products (all 1.0: they would change nothing)
        self.out_scales = out_scales if any((s != 1.0).any() for s in out_scales) else None
        self.keep_alive = weights  # the arrays `base` views
        self.model = (self.base, self.offsets, self.row_scales, self.out_scales, *shared_tables(layers))
        self.decode_layers = DECODE_LAYERS[layers[0].qkv[0].tuning.isa]

    def run(self, x: np.ndarray, step: tuple) -> None:
        """x f32 [T, hidden] (the embeddings) -> the last layer's output, in place; `step`: the step's
        arguments (decode_step._decode_layers)."""
        self.decode_layers(x, self.model, step)
