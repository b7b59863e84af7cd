"""Activation kernels (gated SiLU)."""
