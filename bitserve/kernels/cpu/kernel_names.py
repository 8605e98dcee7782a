"""Which cpu-backend kernel runs a projection stored in each GGUF type on this machine, in words, for
`bitserve inspect`. It reads the same tables CpuBackend's prepare_* methods branch on (backend.py), so a
type gains its name here when it gains a kernel there."""

from __future__ import annotations

from bitserve.kernels.cpu.backend import BLOCK_TYPE_SIZES, FIVE_BIT_LAYOUTS, K_QUANT_LAYOUTS
from bitserve.kernels.cpu.isa import INT8_BLOCK_ACTIVATIONS, Isa
from bitserve.kernels.packed import LOW_BIT_LAYOUTS, TERNARY_FILE_LAYOUTS, Layout

FLOAT_TYPES = frozenset({"F32", "F16", "BF16"})


def projection_kernel(type_name: str, isa: Isa, block_activations: str) -> str:
    """The kernel of a projection weight of GGUF type `type_name` (the LM head and the embedding table
    take their own paths)."""
    layout = Layout.__members__.get(type_name)
    int8 = isa is not Isa.GENERIC
    if type_name in FLOAT_TYPES:
        return "torch linear (f32); the int8 ternary kernels where every value is ternary (bitnet archs)"
    if layout in TERNARY_FILE_LAYOUTS:
        kernel = f"int8 ternary GEMV/GEMM ({isa.value})" if int8 else "numba ternary kernels (generic)"
        return kernel + (", read in place" if layout is Layout.I2_S else ", repacked at load")
    tile = f"int8 interleaved block tile ({isa.value}, Q8_0-style activations)"
    on_tile = int8 and block_activations in INT8_BLOCK_ACTIVATIONS
    if layout in LOW_BIT_LAYOUTS:
        packed = tile if on_tile else "dequantized to f32 at load (no f32 kernel)"
        return f"{packed}; on bitnet archs with one scale, the int8 ternary kernels"
    if layout in K_QUANT_LAYOUTS or layout in FIVE_BIT_LAYOUTS:
        return tile if on_tile else "dequantized to f32 at load (no f32 kernel)"
    if layout in BLOCK_TYPE_SIZES:
        return tile if on_tile else "f32 block kernels (exact f32 activations)"
    if layout is not None:
        return "dequantized to f32 at load, torch linear (no packed kernel yet)"
    return "not supported: the load refuses this type"
