"""Draw keys: one 63-bit key per (stream seed, sample index), on the host or on the device.

A draw's randomness depends only on its key, never on batch composition or
generator state, so a request yields the same tokens however it is batched,
preempted or recomputed. The mix is splitmix64; the tensor form computes it
with wrapping int64 arithmetic so the executor can derive keys on the device
inside a CUDA graph.
"""

from __future__ import annotations

import torch

_MASK64 = (1 << 64) - 1
_SEED_MASK = (1 << 63) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_MUL1 = 0xBF58476D1CE4E5B9
_MUL2 = 0x94D049BB133111EB


def mix_seed(seed: int, sample_index: int) -> int:
    """splitmix64 of (seed, sample_index), truncated to a non-negative int64."""
    z = (seed * _GOLDEN + sample_index + 1) & _MASK64
    z = ((z ^ (z >> 30)) * _MUL1) & _MASK64
    z = ((z ^ (z >> 27)) * _MUL2) & _MASK64
    return (z ^ (z >> 31)) & _SEED_MASK


def _signed(value: int) -> int:
    """The int64 with the same 64 bits as `value` (torch has no uint64 arithmetic)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right_logical(z: torch.Tensor, bits: int) -> torch.Tensor:
    return (z >> bits) & ((1 << (64 - bits)) - 1)


def mix_seeds(seeds: torch.Tensor, sample_indices: torch.Tensor) -> torch.Tensor:
    """`mix_seed` elementwise on int64 tensors (device-side, no host sync); seeds must be < 2**63."""
    z = seeds.to(torch.int64) * _signed(_GOLDEN) + sample_indices.to(torch.int64) + 1
    z = (z ^ _shift_right_logical(z, 30)) * _signed(_MUL1)
    z = (z ^ _shift_right_logical(z, 27)) * _signed(_MUL2)
    return (z ^ _shift_right_logical(z, 31)) & _SEED_MASK
