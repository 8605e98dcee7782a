"""The tables of the lean decode step for Q4_0 / Q4_1 / Q8_0 block weights (kernels/cpu/decode_step.py).

FastCpuDecode (fast_decode.py) hands such a model's decode steps to `BlockStep.run`: one numba call
for every layer, as the ternary models' TernaryStep. Each projection's weights are passed as the tuple of
its layers' record arrays (Int8BlockLinear.kernel_records, no copy): one array type, so the compiled loop
indexes them by layer. One block format for every projection of every layer (as llama.cpp's Q4_0 / Q4_1
/ Q8_0 files write them); a model mixing them takes the module forward.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import numpy as np

from bitserve.kernels.cpu.decode_step import BLOCK_DECODE_LAYERS
from bitserve.kernels.cpu.step_layers import StepLayer, projection_columns, stacked_norms, stacked_qkv_extras

logger = logging.getLogger(__name__)

if TYPE_CHECKING:
    from bitserve.kernels.cpu.prepared import Int8BlockLinear


class BlockStep:
    """Every layer of a Q4_0 / Q4_1 / Q8_0 model's decode step in one numba call of the backend's ISA."""

    @classmethod
    def build(cls, layers: list[StepLayer]) -> BlockStep | None:
        """The step, or None when the projections mix block formats (or a projection's shape changes
        from layer to layer)."""
        weights: list[list[Int8BlockLinear]] = projection_columns(layers)  # type: ignore[assignment]
        formats = {weight.kernel_format for column in weights for weight in column}
        same_shapes = all(len({(w.out_features, w.kernel_records.shape) for w in c}) == 1 for c in weights)
        if len(formats) != 1 or not same_shapes:
            logger.info("block formats %s or shapes mixed: the decode step runs the module forward", formats)
            return None
        return cls(layers, weights, formats.pop())

    def __init__(
        self, layers: list[StepLayer], weights: list[list[Int8BlockLinear]], block_format: str
    ) -> None:
        records = tuple(tuple(w.kernel_records for w in column) for column in weights)
        rows = tuple(column[0].out_features for column in weights)
        norms, sub_norms = stacked_norms(layers)
        self.model = (records, rows, None, None, norms, sub_norms, stacked_qkv_extras(layers))
        self.decode_layers = BLOCK_DECODE_LAYERS[(weights[0][0].tuning.isa, block_format)]

    def run(self, x: np.ndarray, step: tuple) -> None:
        """x f32 [T, hidden] (the embeddings) -> the last layer's output, in place; `step`: the step's
        arguments (decode_step._decode_layers)."""
        self.decode_layers(x, self.model, step)
