"""Attention kernels over the paged KV cache."""
