"""CPU kernel backend: numba kernels over packed 2-bit ternary weights (imports numba)."""
