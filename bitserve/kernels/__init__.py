"""Device compute: PackedWeight layouts, the KernelBackend protocol and its backends;
no nn.Module, no scheduling."""
