"""The tables of the ternary lean decode step (kernels/cpu/decode_step.py), stacked once at load.

FastCpuDecode (cpu_fast_decode.py) hands a ternary model's decode steps to `TernaryStep.run`: one numba
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

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from bitserve.kernels.cpu.prepared import Int8BitnetLinear
    from bitserve.models.cpu_fast_decode import _FastLayer


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


def _projection_columns(layers: list[_FastLayer]) -> list[list[Int8BitnetLinear]]:
    """The layers' weights, one list [L] per projection, in the step's order: qkv, o, gate/up, down."""
    return [
        [layer.qkv for layer in layers],
        [layer.o_proj for layer in layers],
        [layer.gate_up for layer in layers],
        [layer.down for layer in layers],
    ]


class ScatteredWeights(Exception):
    """The weights lie too far apart in memory for one view (address_span)."""


def pooled_layers(kv_caches: list[torch.Tensor]) -> torch.Tensor | None:
    """The per-layer caches as one [L, ...] tensor when they are consecutive views of one storage (as
    runner/kv_cache.allocate_kv_caches makes them), without a copy; None otherwise."""
    first = kv_caches[0]
    layer_elements = first.numel()
    storage = first.untyped_storage().data_ptr()
    for index, cache in enumerate(kv_caches):
        same_storage = cache.untyped_storage().data_ptr() == storage and cache.is_contiguous()
        if not same_storage or cache.storage_offset() != first.storage_offset() + index * layer_elements:
            return None
    shape = (len(kv_caches), *first.shape)
    return torch.as_strided(first, shape, (layer_elements, *first.stride()), first.storage_offset())


def _stack(vectors: list[np.ndarray], dtype: type = np.float32) -> np.ndarray:
    """Per-layer vectors of one length -> C-contiguous [L, n] of `dtype`."""
    return np.ascontiguousarray(np.stack(vectors), dtype=dtype)


def stacked_norms(layers: list[_FastLayer]) -> tuple[tuple, tuple | None]:
    """The layers' norm weights as the step reads them: (attn, ffn) f32 [L, hidden], and the sub-norms
    (attn f32 [L, H D], ffn f32 [L, I]) or None for a model without them."""
    norms = (_stack([lay.attn_norm for lay in layers]), _stack([lay.ffn_norm for lay in layers]))
    if layers[0].attn_sub_norm is None:
        return norms, None
    return norms, (
        _stack([lay.attn_sub_norm for lay in layers]),
        _stack([lay.ffn_sub_norm for lay in layers]),
    )


class TernaryStep:
    """Every layer of a ternary model's decode step in one numba call of the backend's ISA."""

    @classmethod
    def build(cls, layers: list[_FastLayer]) -> TernaryStep | None:
        """The step; weights lying far apart (address_span) are first consolidated into one buffer. None
        when they lie apart and some are read in place from the file (they cannot move)."""
        try:
            return cls(layers)
        except ScatteredWeights:
            pass
        moved = consolidate([weight for column in _projection_columns(layers) for weight in column])
        if moved is None:
            logger.info("ternary weights lie far apart in memory: the lean decode step runs layer by layer")
            return None
        logger.info("ternary weights lay far apart in memory: %.1f MB copied into one buffer", moved / 1e6)
        return cls(layers)

    def __init__(self, layers: list[_FastLayer]) -> None:
        projections = _projection_columns(layers)
        weights = [[weight.kernel_weight for weight in column] for column in projections]
        span = address_span([w for column in weights for w, _ in column])
        if span is None:
            raise ScatteredWeights
        self.base, starts = span
        starts_per_projection = np.reshape(starts, (len(projections), len(layers)))
        self.offsets = tuple(
            _stack(
                [row_off + start for (_, row_off), start in zip(column, column_starts, strict=True)], np.int64
            )
            for column, column_starts in zip(weights, starts_per_projection, strict=True)
        )
        self.row_scales = tuple(_stack([w.kernel_row_scale for w in column]) for column in projections)
        out_scales = tuple(_stack([lay.output_scales[i] for lay in layers]) for i in range(len(projections)))
        # a model without `.scale` tensors skips the products (all 1.0: they would change nothing)
        self.out_scales = out_scales if any((s != 1.0).any() for s in out_scales) else None
        self.norms, self.sub_norms = stacked_norms(layers)
        self.keep_alive = weights  # the arrays `base` views
        self.model = (self.base, self.offsets, self.row_scales, self.out_scales, self.norms, self.sub_norms)
        self.decode_layers = DECODE_LAYERS[layers[0].qkv.tuning.isa]

    def run(self, x: np.ndarray, step: tuple) -> None:
        """x f32 [T, hidden] (the embeddings) -> the last layer's output, in place; `step`: the step's
        arguments (decode_step._decode_layers)."""
        self.decode_layers(x, self.model, step)
