"""Normalisation kernels (RMSNorm, optionally fused with the residual add)."""
