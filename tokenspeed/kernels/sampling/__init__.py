"""Sampling kernels: temperature, min-p / top-k / top-p filtering and keyed random draws."""
