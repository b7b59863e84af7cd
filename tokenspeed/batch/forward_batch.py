"""The records one model step runs on: `ForwardBatch` (with its `AttentionMetadata`) and `HostBatch`.

They sit below every package that reads them: the executor builds them
(`executor/batch_builder.py`), attention kernels and layers read the metadata,
models take a `ForwardBatch`. Keeping them here, with no logic beyond their
own fields, is what lets those packages import only downward.

All rows of a step (prefill chunks and decodes alike) are concatenated along
one token axis, so one model call serves a mixed batch. Attention finds each
row's history through its page table: K/V live only in the paged pool
(`batch/kv_storage.py`), never in per-request contiguous caches.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass(slots=True)
class AttentionMetadata:
    """Where each row's queries sit, and where its keys/values live.

    Row i owns query tokens `query_start[i]:query_start[i+1]` of the flat batch;
    those tokens are at positions `seq_lens[i] - q_len_i ... seq_lens[i] - 1`,
    and attend to every position `0 .. seq_lens[i]-1` (causally), found at
    `page_table[i, pos // page_size]`, slot `pos % page_size`.

    The host lists (`query_start`, `seq_lens`) and the device tensors carry the
    same numbers. Code that must run inside a CUDA graph (decode attention)
    reads only the tensors: while a decode graph is captured the lists are
    `GraphGuardList`s that raise on any element access, `max_seq_len` is the
    engine's `max_model_len` (an upper bound), the page table is as wide as a
    `max_model_len` request needs, and padded rows point at a scratch page with
    `seq_len` 1.
    """

    page_size: int
    query_start: list[int]  # len rows + 1, cumulative
    seq_lens: list[int]  # len rows: KV length after this step
    page_table: torch.Tensor  # [rows, max_pages] int32, padded with 0
    slot_mapping: torch.Tensor  # [num_tokens] int64: flat slot (page * page_size + offset) of each new token
    max_query_len: int
    max_seq_len: int
    seq_lens_tensor: torch.Tensor | None = None  # [rows] int32, on the page table's device
    query_start_tensor: torch.Tensor | None = None  # [rows + 1] int32
    num_kv_splits: int | None = None  # split-KV partitions for decode (None: the kernel chooses)

    def __post_init__(self) -> None:
        device = self.page_table.device
        if self.seq_lens_tensor is None:
            self.seq_lens_tensor = torch.tensor(list(self.seq_lens), dtype=torch.int32, device=device)
        if self.query_start_tensor is None:
            self.query_start_tensor = torch.tensor(list(self.query_start), dtype=torch.int32, device=device)


class GraphGuardList(list[int]):
    """A list whose length is known but whose elements must not be read (CUDA-graph capture)."""

    def _refuse(self, *_: object) -> None:
        raise NotCapturable(
            "attention read per-row host metadata while a CUDA graph was being captured; "
            "decode kernels must read attn.seq_lens_tensor / attn.page_table instead"
        )

    __getitem__ = _refuse  # type: ignore[assignment]
    __iter__ = _refuse  # type: ignore[assignment]


class NotCapturable(RuntimeError):
    """The model (usually its attention kernel) cannot run inside a CUDA graph."""


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
class HostBatch:
    """A step's index arrays on the host (int64), before they are sent to the device."""

    input_ids: np.ndarray
    positions: np.ndarray
    slot_mapping: np.ndarray
    logits_indices: np.ndarray
    seq_lens: np.ndarray
    query_start: np.ndarray
    # Either the page table itself, or the rows' slots in the runner's `RequestPageTables`
    # (the device gathers the table; `table_updates` are the entries its copy lacks).
    page_table: np.ndarray | None  # [rows, max_pages]
    placeholder_sources: np.ndarray | None  # [num_tokens]: index into the previous step's samples, -1 if none
    max_query_len: int
    table_slots: np.ndarray | None = None  # [rows]
    table_width: int = 0
    table_updates: tuple[np.ndarray, np.ndarray] | None = None  # (flat indices, page ids)

    def arrays(self) -> list[np.ndarray]:
        """What goes to the device, in this order (`to_forward_batch` splits it back)."""
        out = [self.input_ids, self.positions, self.slot_mapping, self.logits_indices, self.seq_lens, self.query_start]
        if self.page_table is not None:
            out.append(self.page_table.reshape(-1))
        else:
            assert self.table_slots is not None
            out.append(self.table_slots)
        if self.placeholder_sources is not None:
            out.append(self.placeholder_sources)
        if self.table_updates is not None:
            out.extend(self.table_updates)
        return out
