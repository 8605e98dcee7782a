"""Which x86 integer-dot instructions the ternary kernels may use, decided once per backend.

The int8 kernels (kernels/cpu/int8dot.py) emit LLVM x86 intrinsics through numba `@intrinsic`s. LLVM
cannot lower such an intrinsic for a target that lacks the feature (it aborts the process, no Python
exception), so a variant is only compiled, and only called, where the target numba compiles for has it:
the features are read the way numba sets its target's (host features, or NUMBA_CPU_FEATURES).

Variants, best first:
- VNNI: `vpdpbusd` (u8 x s8 products summed into int32 lanes) on 256-bit vectors: AVX512-VNNI with
  AVX512VL, or AVX-VNNI (the same LLVM intrinsic, VEX-encoded).
- AVX2: `vpmaddubsw` (u8 x s8 pairs summed into int16 lanes) + `vpmaddwd` widening.
- GENERIC: the portable numba kernels of kernels/cpu/ternary.py (int16 decode + auto-vectorized dots).
"""

from __future__ import annotations

import enum
import functools
import logging

import numba

logger = logging.getLogger(__name__)

BLOCK_ACTIVATIONS = ("q8", "ggml", "f32")
# the modes whose block weights run on the int8 tile: "q8" (per-32 f32 scales, fast), "ggml" (llama.cpp's
# own rounding per weight type, kernels/cpu/ggml_activations.py: the exact mode for crossval)
INT8_BLOCK_ACTIVATIONS = frozenset({"q8", "ggml"})


class Isa(enum.Enum):
    """A ternary kernel variant; the value is its name in logs, /health and BITSERVE_CPU_ISA."""

    VNNI = "vnni"
    AVX2 = "avx2"
    GENERIC = "generic"


_REQUIRED_FEATURES: dict[Isa, tuple[frozenset[str], ...]] = {  # any one of these feature sets suffices
    Isa.VNNI: (frozenset({"avx2", "avx512vnni", "avx512vl"}), frozenset({"avx2", "avxvnni"})),
    Isa.AVX2: (frozenset({"avx2"}),),
    Isa.GENERIC: (frozenset(),),
}


@functools.cache
def target_features() -> frozenset[str]:
    """CPU features of the target numba compiles for, without the '+' (e.g. {"avx2", "fma", ...}).

    numba's rule (numba.core.codegen): NUMBA_CPU_FEATURES when set, else the host's features (with the
    avx* ones dropped under NUMBA_ENABLE_AVX=0). An empty NUMBA_CPU_FEATURES leaves the features implied
    by NUMBA_CPU_NAME, which only LLVM knows: trusted for the host, taken as none for a named CPU.
    """
    spec = numba.config.CPU_FEATURES
    if spec is None:
        from numba.core.codegen import get_host_cpu_features  # NOTE: deferred, numba internals

        spec = get_host_cpu_features()
    elif spec == "" and numba.config.CPU_NAME not in (None, "host"):
        return frozenset()
    elif spec == "":
        import llvmlite.binding as llvm  # NOTE: deferred, numba's own dependency

        spec = llvm.get_host_cpu_features().flatten()
    return frozenset(item[1:] for item in spec.split(",") if item.startswith("+"))


def supported_isas(features: frozenset[str] | None = None) -> list[Isa]:
    """The variants the target can run, best first (GENERIC always last)."""
    have = target_features() if features is None else features
    return [isa for isa in Isa if any(need <= have for need in _REQUIRED_FEATURES[isa])]


def resolve_isa(requested: Isa | str | None = None) -> Isa:
    """The variant to use: `requested` (an Isa or its name; None or "auto": the best supported; the
    engine passes KernelTuning.cpu_isa). Raises ValueError for an unknown name or a variant this CPU
    cannot run."""
    if requested is None:
        requested = "auto"
    if isinstance(requested, str):
        requested = requested.strip().lower() or "auto"
    supported = supported_isas()
    if requested == "auto":
        return supported[0]
    try:
        isa = Isa(requested)
    except ValueError:
        names = ", ".join(["auto", *(isa.value for isa in Isa)])
        raise ValueError(f"unknown cpu ISA variant {requested!r}; choose one of: {names}") from None
    if isa not in supported:
        raise ValueError(
            f"cpu ISA variant {isa.value!r} is not supported by this CPU "
            f"(supported: {', '.join(s.value for s in supported)})"
        )
    return isa


def resolve_block_activations(requested: str | None, isa: Isa) -> str:
    """How Q4_* / Q8_0 weights meet activations (CpuBackend): `requested`, else (None) "q8" where the ISA
    variant has integer dots (avx2, vnni), "f32" on generic. ValueError for an unknown name or "q8" on
    the generic variant."""
    if requested is None:
        return "f32" if isa is Isa.GENERIC else "q8"
    if requested not in BLOCK_ACTIVATIONS:
        choices = ", ".join(BLOCK_ACTIVATIONS)
        raise ValueError(f"unknown block activations {requested!r}; choose one of: {choices}")
    if requested in INT8_BLOCK_ACTIVATIONS and isa is Isa.GENERIC:
        raise ValueError(f"block activations {requested!r} need the avx2 or vnni kernel variant, not generic")
    return requested
