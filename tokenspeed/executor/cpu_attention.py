"""The attention of one CPU forward step: decode rows and prompt chunks over the paged KV pool.

Why its own piece: `CPUDecodeForward` (`cpu_decode.py`) builds a step's rows once and runs every layer;
how those rows attend is a choice of its own, made once per model and switched as a whole
(`--disable-cpu-paged-attention`): in place through the native kernels (`decode_paged_cpu`,
`prefill_paged_cpu`: no gathers, no masks), or by gathering the rows' pages for torch's SDPA with
masks made once a step (the reference path, bit-equal to the eager layers).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from tokenspeed.executor.cpu_step import DecodeRows, DecodeStep, PromptRow
from tokenspeed.kernels.attention import decode_paged_cpu, prefill_paged_cpu
from tokenspeed.kernels.attention.extend_torch_sdpa import attend_causal_blocks, causal_blocks

if TYPE_CHECKING:
    from tokenspeed.executor.cpu_decode import LayerWeights


class CPUStepAttention:
    """A model's attention shapes and which kernels serve them (`paged`: the decode rows' native kernel,
    `prefill_kernel`: the prompt chunks' one, on only with `paged`)."""

    def __init__(self, *, heads: int, kv_heads: int, head_dim: int, page_size: int, scale: float, paged: bool,
                 prefill_kernel: bool) -> None:
        self.num_heads, self.num_kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.page_size, self.scale = page_size, scale
        self.paged, self.prefill_kernel = paged, prefill_kernel and paged

    def decode_rows(self, page_table: torch.Tensor, lens: torch.Tensor, max_seq_len: int) -> DecodeRows:
        """One-token rows (int64 lens `[rows]` or `[rows, 1]`): what their attention reads."""
        rows = page_table.shape[0]
        if self.paged:
            return DecodeRows(plan=decode_paged_cpu.PagedDecodePlan(
                page_table, lens.reshape(rows), max_seq_len, heads=self.num_heads, kv_heads=self.num_kv_heads,
                head_dim=self.head_dim, page_size=self.page_size))
        lens = lens.view(rows, 1)
        span_pages = -(-max_seq_len // self.page_size)
        span = span_pages * self.page_size
        owned = torch.arange(0, span, self.page_size) < lens  # [rows, span_pages]
        pages = page_table[:, :span_pages].long().masked_fill_(~owned, 0).reshape(-1)
        # SDPA turns a boolean mask into this additive one in every call; here it is made once a step.
        hidden = (torch.arange(span) >= lens).view(rows, 1, 1, span)
        mask = torch.zeros(hidden.shape, dtype=torch.float32).masked_fill_(hidden, float("-inf"))
        return DecodeRows(pages=pages, mask=mask, span=span)

    def prompt_row(self, page_table_row: torch.Tensor, start: int, end: int, seq_len: int) -> PromptRow:
        """A prompt chunk's row, as `extend_attention_torch_sdpa` attends it."""
        q_len = end - start
        if q_len > seq_len:
            raise ValueError(f"a row has {q_len} new tokens but only {seq_len} cached positions")
        if self.prefill_kernel:  # its pages in place, causal from its own positions: no masks or gathers
            plan = prefill_paged_cpu.PagedPrefillRow(
                page_table_row[: -(-seq_len // self.page_size)], seq_len - q_len, q_len, heads=self.num_heads,
                kv_heads=self.num_kv_heads, head_dim=self.head_dim, page_size=self.page_size)
            return PromptRow(start, end, seq_len, None, None, plan=plan)
        blocks = causal_blocks(q_len, seq_len, torch.device("cpu"))  # their masks made once, for every layer
        pages = None if q_len == seq_len else page_table_row[: -(-seq_len // self.page_size)].long()
        if blocks is not None or pages is None:  # no cached prefix: its keys are this step's, causally
            return PromptRow(start, end, seq_len, pages, None, blocks)
        q_pos = torch.arange(seq_len - q_len, seq_len)[:, None]
        visible = torch.arange(seq_len)[None, :] <= q_pos
        return PromptRow(start, end, seq_len, pages, visible)

    def attend(
        self, w: LayerWeights, step: DecodeStep, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None
    ) -> torch.Tensor:
        """Attention of every token of the step, `[tokens, heads, head_dim]` (or a view of that shape); k and v
        (this step's, `[tokens, kv_heads, head_dim]`) are read for prompt rows without a native plan only."""
        if not step.prompts:
            return self.attend_decode(w, step, q)
        out = torch.empty(q.shape, dtype=q.dtype)
        if step.decode_tokens is not None:
            decoded = self.attend_decode(w, step, q.index_select(0, step.decode_tokens))
            out[step.decode_tokens] = decoded.reshape(-1, self.num_heads, self.head_dim)
        group = self.num_heads // self.num_kv_heads
        for row in step.prompts:
            start, end = row.start, row.end
            if row.plan is not None:  # the native kernel (the step's K/V are in the pool already)
                row.plan(q[start:end], w.k_cache, w.v_cache, self.scale, out[start:end])
                continue
            if row.pages is None:  # this step's keys and values, no gather
                assert k is not None and v is not None
                keys, values = k[start:end].transpose(0, 1), v[start:end].transpose(0, 1)
            else:
                shape = (-1, self.num_kv_heads, self.head_dim)
                keys = w.k_pages.index_select(0, row.pages).view(shape)[: row.seq_len].transpose(0, 1)
                values = w.v_pages.index_select(0, row.pages).view(shape)[: row.seq_len].transpose(0, 1)
            if group > 1:  # the fused (flash) CPU kernel takes MHA only (see extend_torch_sdpa)
                keys, values = keys.repeat_interleave(group, dim=0), values.repeat_interleave(group, dim=0)
            queries = q[start:end].transpose(0, 1)[None]
            if row.blocks is not None:
                out[start:end] = attend_causal_blocks(queries, keys[None], values[None], row.blocks, self.scale)
                continue
            if row.visible is None:
                res = F.scaled_dot_product_attention(queries, keys[None], values[None], is_causal=True,
                                                     scale=self.scale)
            else:
                res = F.scaled_dot_product_attention(queries, keys[None], values[None], attn_mask=row.visible,
                                                     scale=self.scale)
            out[start:end] = res[0].transpose(0, 1)
        return out

    def attend_decode(self, w: LayerWeights, step: DecodeStep, q: torch.Tensor) -> torch.Tensor:
        """The one-token rows' attention: over their pages in place (native kernel), or over their gathered
        pages with GQA folded into SDPA's query length. Either reshapes to `[rows, heads, head_dim]`."""
        rows = step.decode
        assert rows is not None
        if rows.plan is not None:
            return rows.plan(q, w.k_cache, w.v_cache, self.scale)
        assert rows.pages is not None and rows.mask is not None
        count = q.shape[0]
        kv_heads, head_dim = self.num_kv_heads, self.head_dim
        keys = w.k_pages.index_select(0, rows.pages).view(count, rows.span, kv_heads, head_dim)
        values = w.v_pages.index_select(0, rows.pages).view(count, rows.span, kv_heads, head_dim)
        return F.scaled_dot_product_attention(
            q.view(count, kv_heads, self.num_heads // kv_heads, head_dim),
            keys.transpose(1, 2),
            values.transpose(1, 2),
            attn_mask=rows.mask,
            scale=self.scale,
        )
