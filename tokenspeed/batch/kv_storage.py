"""Device storage of the paged KV cache: one K and (unless the model stores K only) one V tensor per layer.

Layout `[num_pages, page_size, num_kv_heads, head_dim]`: a page is the unit the
scheduler's `kvcache/` hands out, and the slot index `page * page_size + offset`
addresses one token's K/V in the flattened view used for writes.

The per-token shape comes from `ModelConfig.kv_cache_layout`: dense models
store K and V per kv head; MLA stores one "head" holding the latent and the
rope key (`v_head_dim == 0`: no V tensor, attention reads V out of the latent).
Page bookkeeping is the same for both, which is why only this file knows.
"""

from __future__ import annotations

import torch


class PagedKVStorage:
    def __init__(
        self,
        *,
        num_layers: int,
        num_pages: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        device: torch.device | str,
        v_head_dim: int | None = None,
    ) -> None:
        v_dim = head_dim if v_head_dim is None else v_head_dim
        self.num_pages = num_pages
        self.page_size = page_size
        self.k = [
            torch.zeros((num_pages, page_size, num_kv_heads, head_dim), dtype=dtype, device=device)
            for _ in range(num_layers)
        ]
        self.v = [
            torch.zeros((num_pages, page_size, num_kv_heads, v_dim), dtype=dtype, device=device)
            for _ in range(num_layers if v_dim else 0)
        ]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(K cache, V cache) of one layer; V is None for a K-only (latent) layout."""
        return self.k[index], self.v[index] if self.v else None

    @staticmethod
    def bytes_per_page(
        *,
        num_layers: int,
        page_size: int,
        num_kv_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        v_head_dim: int | None = None,
    ) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        per_head = head_dim + (head_dim if v_head_dim is None else v_head_dim)
        return num_layers * page_size * num_kv_heads * per_head * element
