"""Inverse frequencies of RoPE for each context-extension scheme.

Computed here, from the published formulas, rather than by calling
transformers at run time: the engine must not depend on transformers'
internals, and the tests check these against `ROPE_INIT_FUNCTIONS` so a drift
on either side is caught. Each function returns `(inv_freq, attention_factor)`;
the factor scales cos and sin (YaRN's "mscale"), i.e. both q and k.

"dynamic" NTK is refused: its frequencies depend on the current sequence
length, which breaks the "one cos/sin table per model" contract and would make
cached K/V inconsistent across lengths.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from tokenspeed.errors import ModelNotSupported

SUPPORTED_ROPE_TYPES = ("default", "linear", "llama3", "yarn")


@dataclass(frozen=True, slots=True)
class RopeConfig:
    """Rotary embedding parameters of every supported scaling type (parsed by `models/config.py`)."""

    rope_type: str = "default"
    theta: float = 10000.0
    partial_rotary_factor: float = 1.0
    factor: float | None = None
    original_max_position_embeddings: int | None = None
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    attention_factor: float | None = None  # yarn: scales cos/sin (mscale)
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn

    def validate(self) -> None:
        needs = {
            "linear": ("factor",),
            "llama3": ("factor", "low_freq_factor", "high_freq_factor"),
            "yarn": (),
        }
        for key in needs.get(self.rope_type, ()):
            if getattr(self, key) is None:
                raise ModelNotSupported(f"rope type {self.rope_type!r} needs {key!r}")


def rotary_dim_of(rope: RopeConfig, head_dim: int) -> int:
    return int(head_dim * rope.partial_rotary_factor)


def _base_inv_freq(theta: float, dim: int) -> torch.Tensor:
    exponents = torch.arange(0, dim, 2, dtype=torch.int64).to(torch.float32) / dim
    return 1.0 / (theta**exponents)


def _linear(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    assert rope.factor is not None
    return _base_inv_freq(rope.theta, dim) / rope.factor, 1.0


def _llama3(rope: RopeConfig, dim: int) -> tuple[torch.Tensor, float]:
    """Llama 3.1: keep high frequencies, divide low ones by `factor`, blend smoothly in between."""
    assert rope.factor is not None and rope.low_freq_factor is not None and rope.high_freq_factor is not None
    assert rope.original_max_position_embeddings is not None
    inv_freq = _base_inv_freq(rope.theta, dim)
    context = rope.original_max_position_embeddings
    long_wavelen = context / rope.low_freq_factor  # longer than this: fully interpolated
    short_wavelen = context / rope.high_freq_factor  # shorter than this: untouched
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > long_wavelen, inv_freq / rope.factor, inv_freq)
    blend = (context / wavelen - rope.low_freq_factor) / (rope.high_freq_factor - rope.low_freq_factor)
    blended = (1 - blend) * scaled / rope.factor + blend * scaled
    in_between = (wavelen >= short_wavelen) & (wavelen <= long_wavelen)
    return torch.where(in_between, blended, scaled), 1.0


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeConfig, dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """YaRN: interpolate low frequencies, extrapolate high ones, ramp between two rotation counts."""
    original = rope.original_max_position_embeddings or max_position_embeddings
    factor = rope.factor if rope.factor is not None else max_position_embeddings / original
    if rope.attention_factor is not None:
        attention_factor = rope.attention_factor
    elif rope.mscale and rope.mscale_all_dim:
        attention_factor = yarn_mscale(factor, rope.mscale) / yarn_mscale(factor, rope.mscale_all_dim)
    else:
        attention_factor = yarn_mscale(factor)
    beta_fast = rope.beta_fast or 32.0
    beta_slow = rope.beta_slow or 1.0

    def dim_of_rotations(rotations: float) -> float:
        # The channel index whose wavelength completes `rotations` turns over the original context.
        return dim * math.log(original / (rotations * 2 * math.pi)) / (2 * math.log(rope.theta))

    low, high = dim_of_rotations(beta_fast), dim_of_rotations(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoid dividing by zero in the ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolate_weight = 1 - ramp
    powers = rope.theta ** (torch.arange(0, dim, 2).to(torch.float32) / dim)
    extrapolated = 1.0 / powers
    interpolated = 1.0 / (factor * powers)
    inv_freq = interpolated * (1 - extrapolate_weight) + extrapolated * extrapolate_weight
    return inv_freq, float(attention_factor)


def compute_inv_freq(
    rope: RopeConfig, head_dim: int, max_position_embeddings: int
) -> tuple[torch.Tensor, float]:
    """fp32 inverse frequencies `[rotary_dim // 2]` and the cos/sin scale for this rope config."""
    dim = rotary_dim_of(rope, head_dim)
    if rope.rope_type == "default":
        return _base_inv_freq(rope.theta, dim), 1.0
    if rope.rope_type == "linear":
        return _linear(rope, dim)
    if rope.rope_type == "llama3":
        return _llama3(rope, dim)
    if rope.rope_type == "yarn":
        return _yarn(rope, dim, max_position_embeddings)
    raise ModelNotSupported(
        f"rope type {rope.rope_type!r} is unsupported; supported: {', '.join(SUPPORTED_ROPE_TYPES)}"
    )
