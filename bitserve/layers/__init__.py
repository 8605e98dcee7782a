"""Model building blocks (nn.Modules) and the batched sampler;
kernels are reached only through a KernelBackend."""
