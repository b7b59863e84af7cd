"""Reference rotary position embedding (rotate-half / NeoX layout, as HF Llama and Qwen).

The cos/sin tables are precomputed per position by `layers/rotary_embedding.py`
(where the scaling variants live); the kernel only indexes them by each
token's position and rotates, so every scaling type shares one kernel.
Only the first `rotary_dim` channels of a head rotate (partial rotary).
"""

from __future__ import annotations

import torch

from tokenspeed.kernels.registry import Band, register_kernel


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = cos.shape[-1]
    rot = x[..., : 2 * half].float()
    x1, x2 = rot[..., :half], rot[..., half:]
    rotated = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).to(x.dtype)
    if rotated.shape[-1] == x.shape[-1]:
        return rotated
    return torch.cat((rotated, x[..., 2 * half :]), dim=-1)


@register_kernel("rope", "apply", name="reference", band=Band.REFERENCE, platforms=("cpu", "cuda"))
def apply_rope_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Rotate q `[tokens, heads, head_dim]` and k `[tokens, kv_heads, head_dim]` by their positions.

    cos_cache/sin_cache: `[max_positions, rotary_dim // 2]` (fp32, any attention scaling folded in).
    Returns new tensors in the inputs' dtypes.
    """
    cos = cos_cache[positions].unsqueeze(1)  # [tokens, 1, rotary_dim // 2]
    sin = sin_cache[positions].unsqueeze(1)
    return _rotate(q, cos, sin), _rotate(k, cos, sin)
