"""CUDA kernels (Triton) of the bitnet linear mode; imports nothing heavy (modules load on the CUDA path)."""
