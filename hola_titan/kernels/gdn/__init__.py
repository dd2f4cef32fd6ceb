"""The GDN state path with the surprise score: fla-core's chunk kernels (``fla_bridge``) and the PyTorch
reference they are tested against (``reference``)."""
