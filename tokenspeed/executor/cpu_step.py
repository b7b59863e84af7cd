"""The records of one CPU forward step (`cpu_decode.CPUDecodeForward`): what every layer of a step
shares, built once per step by `prepare` and read by each layer's attention."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenspeed.kernels.attention import decode_paged_cpu, prefill_paged_cpu


@dataclass(slots=True)
class PromptRow:
    """A row with several new tokens (a prompt chunk) in a step: what its attention needs, built once."""

    start: int  # its first token in the batch
    end: int
    seq_len: int  # KV length after this step
    pages: torch.Tensor | None  # int64 pages of positions 0..seq_len-1; None: no cached prefix, attend the new K/V
    visible: torch.Tensor | None  # [q_len, seq_len] bool; None: plain causal (`is_causal`) or in blocks
    blocks: list[tuple[int, int, torch.Tensor]] | None = None  # causal query blocks (`causal_blocks`)
    plan: prefill_paged_cpu.PagedPrefillRow | None = None  # the native kernel on its pages (all else unused)


@dataclass(slots=True)
class DecodeRows:
    """The one-token (decode) rows of a step, as their attention reads them: for the gather + SDPA path
    (`pages`, `mask`, `span`) or for the native paged kernel (`plan`)."""

    pages: torch.Tensor | None = None  # [rows * span_pages] int64: each row's pages, 0 past its end
    mask: torch.Tensor | None = None  # [rows, 1, 1, span] fp32: 0 where visible, -inf past the row's end
    span: int = 0  # positions gathered per row (span_pages * page_size)
    plan: decode_paged_cpu.PagedDecodePlan | None = None  # page tables and lengths, checked once a step


@dataclass(slots=True)
class DecodeStep:
    """What every layer of one step shares, built once per step."""

    cos: torch.Tensor | None  # [tokens, 1, 2, head_dim // 2]: (cos, cos) of each token's position (None: fused ops)
    sin: torch.Tensor | None  # [tokens, 1, 2, head_dim // 2]: (-sin, sin)
    slots: torch.Tensor  # [tokens] int64
    decode: DecodeRows | None  # the one-token rows (None: none)
    decode_tokens: torch.Tensor | None = None  # mixed steps: the decode rows' tokens (None: all rows decode)
    prompts: tuple[PromptRow, ...] = ()  # the rows with several new tokens, in batch order
