"""Rotary position embedding kernels."""
