"""CUDA kernels (Triton): imported only on the CUDA path."""
