"""Backend selection, once at load: the only kernels module that imports the backends.

The backends import the protocol and shared types from `kernels/backend.py`; this module sits above
them, so the import graph has no cycle (backend.py <- {reference,cpu}/backend.py <- select.py).
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from bitserve.kernels.backend import KernelBackend
from bitserve.kernels.reference.backend import ReferenceBackend
from bitserve.kernels.tuning import DEFAULT_TUNING, KernelTuning

logger = logging.getLogger(__name__)

BACKEND_NAMES = ("reference", "cpu", "cuda")


def _numba_works() -> bool:
    """True if the numba CPU backend imports and numba compiles and runs a trivial kernel here."""
    try:  # NOTE: deferred: numba is optional, and importing it costs ~0.5 s
        from bitserve.kernels.cpu import backend as cpu_backend
    except ImportError as exc:
        logger.info("cpu backend unavailable: %s", exc)
        return False
    return cpu_backend.is_available()


def cpu_kernel_choices(type_names: Iterable[str] = ()) -> dict[str, object] | None:
    """What the cpu backend would pick on this machine (for `bitserve inspect`): its ISA variant, block
    activations and the kernel of a projection in each of `type_names`; None without numba."""
    if not _numba_works():
        return None
    from bitserve.kernels.cpu.isa import resolve_block_activations, resolve_isa, supported_isas
    from bitserve.kernels.cpu.kernel_names import projection_kernel

    isa = resolve_isa()
    block_activations = resolve_block_activations(None, isa)
    return {
        "isa": isa.value,
        "supported_isas": [variant.value for variant in supported_isas()],
        "block_activations": block_activations,
        "projection_kernels": {name: projection_kernel(name, isa, block_activations) for name in type_names},
    }


def available_backends() -> list[str]:
    """Names of the backends that work in this process, the reference first."""
    names = ["reference"]
    if _numba_works():
        names.append("cpu")
    return names


def select_backend(
    name: str = "auto",
    *,
    max_dense_weight_bytes: int = 0,
    device: str = "cpu",
    tuning: KernelTuning = DEFAULT_TUNING,
) -> KernelBackend:
    """Pick a backend once, at load, for a model placed on `device` ("cpu", "cuda", "cuda:N").

    On CPU "auto" is "cpu" when numba works, else "reference"; on a CUDA device it is "cuda" (the
    reference backend also runs there, for parity checks). max_dense_weight_bytes: the cpu backend's
    budget of f32 copies of block weights (batched GEMMs). tuning: the kernel knobs (kernels/tuning.py)."""
    on_cuda = device.startswith("cuda")
    if name == "auto":
        name = "cuda" if on_cuda else ("cpu" if _numba_works() else "reference")
    if name == "reference":
        return ReferenceBackend()
    if on_cuda != (name == "cuda"):
        raise ValueError(f"kernel backend {name!r} does not run on device {device!r}")
    if name == "cuda":
        return _cuda_backend(device, tuning)
    if name == "cpu":
        if not _numba_works():
            raise ValueError("kernel backend 'cpu' needs numba, which is not importable or not working")
        from bitserve.kernels.cpu.backend import CpuBackend

        return CpuBackend(
            max_dense_weight_bytes=max_dense_weight_bytes,
            isa=tuning.cpu_isa,
            block_activations=tuning.requested_block_activations(),
        )
    raise ValueError(f"unknown kernel backend {name!r}; choose one of: auto, {', '.join(BACKEND_NAMES)}")


def _cuda_backend(device: str, tuning: KernelTuning) -> KernelBackend:
    from bitserve.kernels.cuda.backend import CudaBackend, cuda_available

    if not cuda_available():
        raise ValueError(
            f"device {device!r} needs CUDA and Triton: install a CUDA build of torch (Triton comes with it)"
        )
    return CudaBackend(device, tuning)
