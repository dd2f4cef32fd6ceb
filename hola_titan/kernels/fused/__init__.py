"""Fused Triton kernels outside attention: the causal short convolution of q, k, v and the row-wise
cross-entropy."""
