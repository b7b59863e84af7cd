"""Device storage of the paged KV cache: one K and one V tensor per layer.

Layout `[num_pages, page_size, num_kv_heads, head_dim]`: a page is the unit the
scheduler's `kvcache/` hands out, and the slot index `page * page_size + offset`
addresses one token's K/V in the flattened view used for writes.
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
    ) -> None:
        shape = (num_pages, page_size, num_kv_heads, head_dim)
        self.num_pages = num_pages
        self.page_size = page_size
        self.k = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    def layer(self, index: int) -> tuple[torch.Tensor, torch.Tensor]:
        return self.k[index], self.v[index]

    def copy_pages(self, copies: list[tuple[int, int]]) -> None:
        """Copy whole pages src -> dst in every layer (copy-on-write when a request forks)."""
        if not copies:
            return
        src = torch.tensor([s for s, _ in copies], dtype=torch.int64, device=self.k[0].device)
        dst = torch.tensor([d for _, d in copies], dtype=torch.int64, device=self.k[0].device)
        for cache in (*self.k, *self.v):
            cache.index_copy_(0, dst, cache.index_select(0, src))

    @staticmethod
    def bytes_per_page(
        *, num_layers: int, page_size: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype
    ) -> int:
        element = torch.empty((), dtype=dtype).element_size()
        return 2 * num_layers * page_size * num_kv_heads * head_dim * element
