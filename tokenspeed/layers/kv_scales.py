"""`KVScales`: the static scales of one attention layer's FP8 KV cache (`kv_cache_dtype="fp8"`).

Scales are per tensor and 1.0: bf16 K/V values of the models we serve lie
well inside e4m3's range (+-448), and e4m3 keeps ~2^-4 relative precision
at any magnitude down to 2^-6, so a unit scale costs no accuracy that a
calibrated one would recover on these models (measured: tests/test_fp8_kv.py,
greedy top-1 agreement with the fp32 cache). Checkpoint `k_scale` /
`v_scale` tensors (calibrated per-tensor scales) are not read yet. The
kernels take per-head scales too (`kernels/quant/fp8.kv_scale_layout`).

Held as buffers (moved with the layer, never loaded) and handed to the kernels
only when the cache is fp8: a cache in the model dtype takes no scale.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenspeed.kernels.quant.fp8 import FP8_DTYPE


class KVScales(nn.Module):
    k_scale: torch.Tensor
    v_scale: torch.Tensor

    def __init__(self, *, device: torch.device | str) -> None:
        super().__init__()
        self.register_buffer("k_scale", torch.ones(1, dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("v_scale", torch.ones(1, dtype=torch.float32, device=device), persistent=False)

    def for_cache(self, cache: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(k_scale, v_scale) for an fp8 `cache`, (None, None) for any other (a host-side dtype check)."""
        if cache.dtype == FP8_DTYPE:
            return self.k_scale, self.v_scale
        return None, None
