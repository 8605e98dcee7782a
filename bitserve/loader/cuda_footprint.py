"""Device bytes a GGUF file's weights take under CudaBackend's layouts, from its tensor table alone.

`--device auto` places a model on a GPU when its weights and KV budget fit the free memory. The file size
is a poor estimate there: ternary weights shrink to 2-bit planes (I2_S stays ~ its size), but Q4/Q8
projections grow ~6x (the packed blocks plus the f32 copy cuBLAS runs for long steps) and float
projections become f32. Per tensor (n values, M rows), as kernels/cuda/backend.py and
kernels/cuda/decoder.py lay them out:
- ternary (I2_S, TQ1_0, TQ2_0, TL1, TL2): n / 4 bytes of planes + an f32 scale per row;
- block matrices (Q4_*, Q5_*, Q8_0, Q2_0 / Q1_0, the K-quants): kernels/cuda/block_layout.py's packed
  forms (codes, f32 d and m per 32 or 16 values) + the f32 copy;
- other matrices: f32 (dequantized at load);
- the token table: as stored when F16 / BF16 / F32, else f32; a tied head reuses a float table and adds
  a block weight for a Q4 / Q8 one; a separate F16 / BF16 head stays half;
- vectors (norms): f32;
- a head the CUDA decoder keeps as a float matrix (any but the block types above, separate or the
  tied table) adds its greedy-head copy (kernels/cuda/greedy_head.py) where that takes its width (a
  multiple of 128 up to 4,096: greedy_head.supports_hidden): one int8 per value, an f32 scale per row, and
  the two passes' scratch (an f32 approximate logit and an int32 candidate slot per row and launch row;
  the few KB of per-program maxima and list padding left out).
  Counted even where the copy is not made (no CUDA graphs, no lookahead, BITSERVE_CUDA_GREEDY_HEAD=0,
  `--lm-head q8_0`): an estimate errs high.
No Triton or torch import: the lifecycle calls it before it loads anything. It lives in the loader (it
reads the tensor table; kernels may not import the loader), and repeats the layouts' byte counts rather
than importing the CUDA modules, which pull torch.
"""

from __future__ import annotations

from collections.abc import Iterable
from math import prod

from bitserve.loader.gguf_reader import TensorInfo
from bitserve.loader.gguf_types import GGMLType

TERNARY_TYPES = frozenset({GGMLType.I2_S, GGMLType.TQ1_0, GGMLType.TQ2_0, GGMLType.TL1, GGMLType.TL2})
HALF_TYPES = frozenset({GGMLType.F16, GGMLType.BF16})
GREEDY_HEAD_MAX_WIDTH = 4096  # kernels/cuda/greedy_head.MAX_HIDDEN
# per head row: its f32 scale, and per launch row (greedy_head.MAX_ROWS, 2) an f32 approximate logit and
# an int32 slot of the rescoring pass's candidate list
GREEDY_HEAD_ROW_BYTES = 4 + 2 * (4 + 4)
# packed bytes per value in block_layout.py's forms: nibble codes 0.5 + f32 d and m per 32 values (Q4_*,
# Q2_0, Q1_0, Q4_K) or per 16 (Q2_K, Q3_K); int8 codes 1 + d per 32 (Q8_0, Q5_0), + m (Q5_1, Q5_K), d per
# 16 (Q6_K)
BLOCK_PACKED_BYTES = {
    **dict.fromkeys((GGMLType.Q4_0, GGMLType.Q4_1, GGMLType.Q2_0, GGMLType.Q1_0, GGMLType.Q4_K), 0.75),
    **dict.fromkeys((GGMLType.Q2_K, GGMLType.Q3_K), 1.0),
    **dict.fromkeys((GGMLType.Q8_0, GGMLType.Q5_0), 1.125),
    **dict.fromkeys((GGMLType.Q5_1, GGMLType.Q5_K, GGMLType.Q6_K), 1.25),
}
F32_BYTES = 4
TOKEN_TABLE = "token_embd.weight"
HEAD = "output.weight"


def cuda_weight_bytes(tensors: Iterable[TensorInfo]) -> int:
    """Estimated device bytes of every tensor of a file once CudaBackend has loaded it."""
    by_name = {tensor.name: tensor for tensor in tensors}
    total = sum(_tensor_bytes(tensor) for tensor in by_name.values())
    table = by_name.get(TOKEN_TABLE)
    if table is not None and HEAD not in by_name and table.ggml_type in BLOCK_PACKED_BYTES:
        total += _matrix_bytes(table)  # a tied quantized head: its block weight beside the f32 table
    head = by_name.get(HEAD, table)
    if head is not None and _has_greedy_copy(head):
        total += prod(head.shape) + head.shape[1] * GREEDY_HEAD_ROW_BYTES  # the greedy head's int8 copy
    return total


def _has_greedy_copy(head: TensorInfo) -> bool:
    """A head kept as a float matrix whose width (ne[0]) the greedy head takes."""
    if len(head.shape) != 2 or head.ggml_type in BLOCK_PACKED_BYTES:
        return False
    width = head.shape[0]
    return 0 < width <= GREEDY_HEAD_MAX_WIDTH and width % 128 == 0


def _tensor_bytes(tensor: TensorInfo) -> int:
    values = prod(tensor.shape)
    if tensor.name == TOKEN_TABLE:
        if tensor.ggml_type in HALF_TYPES or tensor.ggml_type is GGMLType.F32:
            return tensor.nbytes
        return values * F32_BYTES
    if tensor.name == HEAD and tensor.ggml_type in HALF_TYPES:
        return tensor.nbytes
    if len(tensor.shape) < 2:
        return values * F32_BYTES
    return _matrix_bytes(tensor)


def _matrix_bytes(tensor: TensorInfo) -> int:
    values = prod(tensor.shape)
    rows = tensor.shape[1]  # ggml order: ne[0] is K, ne[1] is M
    if tensor.ggml_type in TERNARY_TYPES:
        return values // 4 + rows * F32_BYTES
    packed = BLOCK_PACKED_BYTES.get(tensor.ggml_type)
    if packed is not None:
        return int(values * packed) + values * F32_BYTES
    return values * F32_BYTES
