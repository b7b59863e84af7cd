"""`ForwardBatch`: one step's inputs, laid out as flat tensors for the model.

All rows (prefill chunks and decodes alike) are concatenated along one token
axis, so one model call serves a mixed batch. Attention finds each row's
history through its page table: K/V live only in the paged pool
(`executor/kv_storage.py`), never in per-request contiguous caches.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Where each row's queries sit, and where its keys/values live.

    Row i owns query tokens `query_start[i]:query_start[i+1]` of the flat batch;
    those tokens are at positions `seq_lens[i] - q_len_i ... seq_lens[i] - 1`,
    and attend to every position `0 .. seq_lens[i]-1` (causally), found at
    `page_table[i, pos // page_size]`, slot `pos % page_size`.
    """

    page_size: int
    query_start: list[int]  # len rows + 1, cumulative
    seq_lens: list[int]  # len rows: KV length after this step
    page_table: torch.Tensor  # [rows, max_pages] int64, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat slot (page * page_size + offset) of each new token
    max_query_len: int
    max_seq_len: int

    @property
    def num_rows(self) -> int:
        return len(self.seq_lens)

    @property
    def is_pure_decode(self) -> bool:
        return self.max_query_len == 1


@dataclass(slots=True)
class ForwardBatch:
    input_ids: torch.Tensor  # [num_tokens] int64
    positions: torch.Tensor  # [num_tokens] int64
    attn: AttentionMetadata
    # Flat token indices whose hidden states become logits (sampling and prompt logprobs).
    logits_indices: torch.Tensor  # [num_logits] int64

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])


@dataclass(slots=True)
class RowSpec:
    """The minimum a batch row needs: new tokens, where they start, and the row's pages."""

    input_token_ids: Sequence[int]
    start_position: int
    page_ids: Sequence[int]


def build_forward_batch(
    rows: Sequence[RowSpec],
    page_size: int,
    logits_indices: Sequence[int],
    device: torch.device | str = "cpu",
) -> ForwardBatch:
    """Flatten rows into a ForwardBatch. Pure index arithmetic, done once per step on the host."""
    input_ids: list[int] = []
    positions: list[int] = []
    slots: list[int] = []
    query_start = [0]
    seq_lens: list[int] = []
    max_pages = max((len(r.page_ids) for r in rows), default=1) or 1
    table = [[0] * max_pages for _ in rows]
    for i, row in enumerate(rows):
        n = len(row.input_token_ids)
        end = row.start_position + n
        needed_pages = -(-end // page_size)
        if needed_pages > len(row.page_ids):
            raise ValueError(f"row {i} covers {end} positions but has only {len(row.page_ids)} pages")
        input_ids.extend(row.input_token_ids)
        positions.extend(range(row.start_position, end))
        for pos in range(row.start_position, end):
            slots.append(row.page_ids[pos // page_size] * page_size + pos % page_size)
        table[i][: len(row.page_ids)] = row.page_ids
        query_start.append(query_start[-1] + n)
        seq_lens.append(end)

    def as_tensor(values: Sequence[int] | list[list[int]]) -> torch.Tensor:
        return torch.tensor(values, dtype=torch.int64, device=device)

    attn = AttentionMetadata(
        page_size=page_size,
        query_start=query_start,
        seq_lens=seq_lens,
        page_table=as_tensor(table),
        slot_mapping=as_tensor(slots),
        max_query_len=max((len(r.input_token_ids) for r in rows), default=0),
        max_seq_len=max(seq_lens, default=0),
    )
    return ForwardBatch(
        input_ids=as_tensor(input_ids),
        positions=as_tensor(positions),
        attn=attn,
        logits_indices=as_tensor(list(logits_indices)),
    )
