"""The HOLA cache read, one file per tier: the oracle, the PyTorch reference, the SDPA, Triton, Gluon and
FlashAttention-4 forms, the stages they share, the continuation from a cache and the one-token decode step."""
