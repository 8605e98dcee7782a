"""CPU kernel backend: numba kernels over packed 2-bit ternary weights (imports numba)."""

from bitserve.kernels.cpu.numba_cache import install as _install_cache_lock

_install_cache_lock()  # before any kernel of the package compiles: see numba_cache.py
