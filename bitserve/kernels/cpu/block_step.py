"""The tables of the lean decode step for block weights (kernels/cpu/decode_step.py): Q4_0 / Q4_1 / Q8_0,
Q5_0 / Q5_1, Q2_0 / Q1_0, Q4_K / Q6_K, the formats of the int8 tile (kernels/cpu/interleaved.py).

FastCpuDecode (fast_decode.py) hands such a model's decode steps to `BlockStep.run` (or
`MixedBlockStep.run`): one numba call for every layer, as the ternary models' TernaryStep. The weights are
passed as their record arrays (Int8BlockLinear.kernel_records, no copy), all uint8 [G, nb, record]: one
array type, so the compiled loop indexes them by layer.

- One block format for every projection of every layer, each projection one stacked weight (as
  llama.cpp's Q4_0 / Q4_1 / Q8_0 / Q2_0 files write them): BlockStep, each projection's records a tuple
  of its layers', the format's own kernels compiled in.
- Formats mixed (llama.cpp's K-quant mixes: SmolLM2's Q4_K_M has Q5_0 q/k, Q8_0 or Q5_0 v, Q4_K or Q6_K
  down by layer; q/k/v of two formats run side by side, group_stacking.stackable_records):
  MixedBlockStep, every record array in one flat tuple and a table of each projection's parts, whose
  kernel is chosen per call (blockdot.ANY_KIND: one compiled branch per format).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

import numpy as np

from bitserve.kernels.cpu.decode_step import BLOCK_DECODE_LAYERS, MIXED_DECODE_LAYERS
from bitserve.kernels.cpu.interleaved import KINDS
from bitserve.kernels.cpu.step_layers import StepLayer, projection_columns, shared_tables

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from bitserve.kernels.cpu.prepared import Int8BlockLinear

PART_FIELDS = 4  # a part's row in MixedBlockStep's table: record index, kind, first output row, rows


class _OneCall:
    """A compiled layer loop (decode_step) and the model tables it reads."""

    model: tuple
    decode_layers: Callable[..., None]

    def run(self, x: np.ndarray, step: tuple) -> None:
        """x f32 [T, hidden] (the embeddings) -> the last layer's output, in place; `step`: the step's
        arguments (decode_step._decode_layers)."""
        self.decode_layers(x, self.model, step)


class BlockStep(_OneCall):
    """Every layer of a model of one block format in one numba call of the backend's ISA."""

    @classmethod
    def build(cls, layers: list[StepLayer]) -> BlockStep | MixedBlockStep | None:
        """The step of one format; the mixed step where formats (or a projection's parts) differ; None
        when a projection's rows change from layer to layer, or the record arrays are not of one type."""
        columns = projection_columns(layers)
        formats = {weight.kernel_format for column in columns for parts in column for weight in parts}
        if any(len({sum(w.out_features for w in parts) for parts in column}) != 1 for column in columns):
            logger.info(
                "a projection's rows change from layer to layer: the decode step runs the module forward"
            )
            return None
        single = all(len(parts) == 1 for column in columns for parts in column)
        same_records = all(
            len({parts[0].kernel_records.shape for parts in column}) == 1 for column in columns
        )
        if len(formats) == 1 and single and same_records:
            weights: list[list[Int8BlockLinear]] = [[parts[0] for parts in column] for column in columns]  # type: ignore[misc]
            return cls(layers, weights, formats.pop())
        return MixedBlockStep.build(layers)

    def __init__(
        self, layers: list[StepLayer], weights: list[list[Int8BlockLinear]], block_format: str
    ) -> None:
        records = tuple(tuple(w.kernel_records for w in column) for column in weights)
        rows = tuple(column[0].out_features for column in weights)
        self.model = (records, rows, None, None, *shared_tables(layers))
        self.decode_layers = BLOCK_DECODE_LAYERS[(weights[0][0].tuning.isa, block_format)]


class MixedBlockStep(_OneCall):
    """Every layer of a model mixing block formats in one numba call: each projection's weights run side
    by side as in the module forward, each on its format's kernel (decode_step._project_mixed_blocks)."""

    @classmethod
    def build(cls, layers: list[StepLayer]) -> MixedBlockStep | None:
        """The step, or None when the record arrays are not one numba type (a read-only or
        non-contiguous one among them): the compiled loop indexes them as one tuple."""
        arrays = [w.kernel_records for col in projection_columns(layers) for parts in col for w in parts]
        kinds = {(a.dtype, a.ndim, a.flags.c_contiguous, a.flags.writeable) for a in arrays}
        if len(kinds) != 1 or kinds.pop()[:3] != (np.dtype(np.uint8), 3, True):
            logger.info("record arrays of several types: the decode step runs the module forward")
            return None
        return cls(layers)

    def __init__(self, layers: list[StepLayer]) -> None:
        columns = projection_columns(layers)
        max_parts = max(len(parts) for column in columns for parts in column)
        table = np.zeros((len(columns), len(layers), max_parts, PART_FIELDS), dtype=np.int64)
        records: list[np.ndarray] = []
        for which, column in enumerate(columns):
            for layer, parts in enumerate(column):
                start = 0
                for index, weight in enumerate(parts):
                    kind = KINDS[weight.kernel_format]
                    table[which, layer, index] = (len(records), kind, start, weight.out_features)
                    records.append(weight.kernel_records)
                    start += weight.out_features
        rows = tuple(sum(w.out_features for w in column[0]) for column in columns)
        self.model = (tuple(records), table, rows, None, *shared_tables(layers))
        isa = layers[0].qkv[0].tuning.isa
        self.decode_layers = MIXED_DECODE_LAYERS[isa]
        self.formats = sorted({w.kernel_format for column in columns for parts in column for w in parts})
        logger.info(
            "block formats %s mixed: one-call decode step, each part on its format's kernel", self.formats
        )
