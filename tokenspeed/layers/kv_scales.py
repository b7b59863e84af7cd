"""`KVScales`: the static scales of one attention layer's FP8 KV cache (`kv_cache_dtype="fp8"`).

Scales are 1.0 unless the checkpoint has its own: bf16 K/V
values of the models we serve lie well inside e4m3's range (+-448), and e4m3
keeps ~2^-4 relative precision at any magnitude down to 2^-6, so a unit scale
costs no accuracy that a calibrated one would recover on these models
(measured: tests/test_fp8_kv.py, greedy top-1 agreement with the fp32 cache).
Checkpoints calibrated for an FP8 KV cache carry scales per attention
layer, as vLLM reads them: `self_attn.k_scale` and
`self_attn.v_scale` (stored value times scale = the real one), or one
`self_attn.kv_scale` for both in older exports; the loader hands them to
`load` (`models/loader.py`). A scale is per tensor (one element) or per KV
head (`[num_kv_heads]`, as llm-compressor's `attn_head` strategy writes them:
one head with outliers then does not push the others' small values under
e4m3's smallest). Both are held per KV head (a per-tensor scale fills every
head; the kernels take either layout, `kernels/quant/fp8.kv_scale_layout`),
in buffers allocated once: CUDA graphs, captured before the start-up
calibration below sets them, read them in place.
Without such scales, `calculate_kv_scales` measures them at start-up
(`executor/kv_scale_calibration.py`): each layer records each head's largest
|K| and |V| it stores (`observe`) and takes, per head, the power of two that
maps them to at most `CALIBRATED_PEAK` (`set_calibrated`).

Held as buffers (moved with the layer) and handed to the kernels only when the
cache is fp8: a cache in the model dtype takes no scale, and a checkpoint's
scales are then read and unused, as in vLLM.
"""

from __future__ import annotations

import torch
from torch import nn

from tokenspeed.kernels.quant.fp8 import FP8_DTYPE
from tokenspeed.layers.fp8_weights import per_tensor_scale

# A checkpoint tensor's last name -> the scales it sets.
CHECKPOINT_SCALES: dict[str, tuple[str, ...]] = {"k_scale": ("k_scale",), "v_scale": ("v_scale",),
                                                 "kv_scale": ("k_scale", "v_scale")}


# A calibrated scale maps the calibration prompt's largest |K| (|V|) of its head to at most half of e4m3's 448,
# so that values up to twice those of random tokens still fit; vLLM's calculate_kv_scales (one scale for all
# heads) leaves 2.2x (K) and 4.5x (V).
CALIBRATED_PEAK = 224.0


class KVScales(nn.Module):
    k_scale: torch.Tensor
    v_scale: torch.Tensor

    def __init__(self, *, device: torch.device | str, num_kv_heads: int = 1) -> None:
        """`num_kv_heads`: the heads this layer's cache holds (on a rank, its own)."""
        super().__init__()
        self.num_kv_heads = num_kv_heads
        self.register_buffer("k_scale", torch.ones(num_kv_heads, dtype=torch.float32, device=device), persistent=False)
        self.register_buffer("v_scale", torch.ones(num_kv_heads, dtype=torch.float32, device=device), persistent=False)
        self._peaks: torch.Tensor | None = None  # [2, heads]: each head's largest |K| and |V| while calibrating

    @property
    def calibrating(self) -> bool:
        """Whether the layer reports what its cache is given (`observe`): only during start-up calibration."""
        return self._peaks is not None

    def start_calibration(self) -> None:
        self._peaks = torch.zeros(2, self.num_kv_heads, dtype=torch.float64)

    def observe(self, k: torch.Tensor, v: torch.Tensor | None = None) -> None:
        """Record each head's largest magnitudes of K (and V) as the cache stores them, `[tokens, heads, dim]`
        (a one-head cache: `[tokens, dim]`). Non-finite peaks are left out: a scale must stay finite (such
        values are lost whatever the scale)."""
        assert self._peaks is not None, "observe outside calibration"
        for i, values in enumerate((k, v)):
            if values is not None and values.numel():
                heads = values.detach().abs().reshape(values.shape[0], self.num_kv_heads, -1).amax(dim=(0, 2))
                heads = heads.double().cpu()
                self._peaks[i] = torch.maximum(self._peaks[i], torch.where(heads.isfinite(), heads, 0.0))

    def finish_calibration(self) -> torch.Tensor:
        """End calibration; the peaks recorded, `[2, num_kv_heads]` (K's, then V's; 0: nothing seen)."""
        assert self._peaks is not None, "no calibration to finish"
        peaks, self._peaks = self._peaks, None
        return peaks

    def set_calibrated(self, peaks: torch.Tensor) -> None:
        """Per-head scales from measured `peaks` (`finish_calibration`'s): for each head the power of two that
        brings its peak to at most `CALIBRATED_PEAK` (a power of two, so that scaling a value is exact). K or V
        with nothing seen (MLA's V, which it never stores, or a layer the forward never ran) keeps its scales;
        a head with nothing seen beside others gets 1."""
        for attr, head_peaks in zip(("k_scale", "v_scale"), peaks, strict=True):
            if bool((head_peaks > 0).any()):
                powers = torch.exp2(torch.ceil(torch.log2(head_peaks / CALIBRATED_PEAK)))
                self._set((attr,), torch.where(head_peaks > 0, powers, 1.0))

    def load(self, name: str, tensor: torch.Tensor) -> None:
        """Set the scale(s) checkpoint tensor `...self_attn.<name>` gives (`CHECKPOINT_SCALES`): one for all
        heads, or one per KV head.

        Raises ValueError for anything but one, or `num_kv_heads`, positive finite numbers.
        """
        if tensor.numel() not in (1, self.num_kv_heads):
            raise ValueError(f"a KV cache scale has one element, or one per KV head ({self.num_kv_heads}), "
                             f"got shape {tuple(tensor.shape)}")
        if tensor.numel() == 1:
            values = torch.tensor([per_tensor_scale(tensor)], dtype=torch.float32)
        else:
            values = tensor.detach().float().reshape(-1).cpu()
            if not bool(((values > 0) & values.isfinite()).all()):
                raise ValueError(f"every per-head scale must be positive and finite, got {values.tolist()}")
        self._set(CHECKPOINT_SCALES[name], values)

    def _set(self, attrs: tuple[str, ...], values: torch.Tensor) -> None:
        """`values` (one for every head, or one per head) into the scales `attrs`, in place."""
        for attr in attrs:
            scale = getattr(self, attr)
            scale.copy_(values.to(device=scale.device, dtype=scale.dtype).expand_as(scale))

    def for_cache(self, cache: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:
        """(k_scale, v_scale) for an fp8 `cache`, (None, None) for any other (a host-side dtype check)."""
        if cache.dtype == FP8_DTYPE:
            return self.k_scale, self.v_scale
        return None, None
