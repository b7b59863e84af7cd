"""What every device drafter shares: per-request state, the batches of a draft chain, the draws.

A device drafter proposes k tokens per row as a chain of one-token steps
(each step's token is the next step's input). Step j of a row runs at a
position inside the pages the scheduler allocated for the row's verify
positions (p .. p+k), so the drafter's K/V writes land on pages the request
owns; they hold drafts, and are rewritten when the drafter catches up on the
verified positions (`observe`). Rows whose chain is already long enough (a
smaller k than the step's longest) keep running for shape's sake, with their
writes sent to the scratch page.

Draws: a greedy row drafts the argmax (verified by point mass: greedy
decoding's tokens exactly). A sampled row drafts from the drafter's own
filtered distribution q with a key of its own stream (`verify.DRAFT_STREAM`,
at (seed, sample_index + i) for draft i) and hands q to rejection sampling,
which then emits the target's distribution exactly.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenspeed.batch.forward_batch import AttentionMetadata, ForwardBatch, GraphGuardList
from tokenspeed.executor.sampler import SampleSpec
from tokenspeed.executor.speculator import DraftRows
from tokenspeed.spec.verify import DRAFT_STREAM, filtered_probs, keyed_categorical


class SlotStates:
    """One `[width]` vector per request, on the device, indexed by the request's page-table slot.

    Slots are reused after a request leaves; a new request writes its state (at its first sampling
    row) before any row of it reads it (its first decode row), so stale rows are never read.
    """

    def __init__(self, width: int, dtype: torch.dtype, device: torch.device) -> None:
        self.values = torch.zeros(16, width, dtype=dtype, device=device)

    def write(self, slots: torch.Tensor, values: torch.Tensor, max_slot: int) -> None:
        if max_slot >= self.values.shape[0]:
            grown = torch.zeros(2 * (max_slot + 1), self.values.shape[1], dtype=self.values.dtype,
                                device=self.values.device)
            grown[: self.values.shape[0]] = self.values
            self.values = grown
        self.values.index_copy_(0, slots, values.to(self.values.dtype))

    def read(self, slots: torch.Tensor) -> torch.Tensor:
        return self.values.index_select(0, slots)


class DraftChain:
    """The one-token batches of a chain over `rows` of the step's `batch`.

    Every per-step value (positions, K/V slots, sequence lengths) is computed on the device from
    the rows' start positions and draft lengths, so a chain runs inside a CUDA graph
    (`draft_graphs.py`) as well as eagerly. Eagerly it also fills the metadata's host lists (the
    torch reference attention reads them); in a graph they are `GraphGuardList`s."""

    def __init__(self, page_table: torch.Tensor, start: torch.Tensor, num_draft_tokens: torch.Tensor, *,
                 page_size: int, scratch_page: int, host: tuple[list[int], list[int]] | None,
                 max_seq_len: int) -> None:
        """`page_table` `[rows, pages]`, `start` / `num_draft_tokens` `[rows]` int64 on the device; `host`:
        the same start positions and draft lengths as lists (None inside a graph); `max_seq_len`: a bound
        of the rows' lengths (used only when `host` is None)."""
        self.page_table = page_table
        self.start = start
        self.num_draft_tokens = num_draft_tokens
        self.page_size = page_size
        self.scratch_slot = scratch_page * page_size
        self.host = host
        self.max_seq_len = max_seq_len
        self.device = page_table.device

    @classmethod
    def of_rows(cls, batch: ForwardBatch, rows: DraftRows, scratch_page: int) -> DraftChain:
        """The chain of `rows` of an eager step."""
        device = batch.input_ids.device
        page_table = batch.attn.page_table.index_select(0, rows.batch_rows.to(batch.attn.page_table.device))
        return cls(page_table, upload(rows.start_positions, device), upload(rows.num_draft_tokens, device),
                   page_size=batch.attn.page_size, scratch_page=scratch_page,
                   host=(rows.start_positions, rows.num_draft_tokens), max_seq_len=0)

    def step(self, tokens: torch.Tensor, offset: int, active_below: int) -> ForwardBatch:
        """`tokens` `[rows]`, one per row at position `start + offset`. A row with
        k <= `active_below` has drafted enough: it runs at its start position, writing to the scratch page."""
        count = tokens.shape[0]
        active = self.num_draft_tokens > active_below
        pos = torch.where(active, self.start + offset, self.start)
        pages = self.page_table.gather(1, (pos // self.page_size)[:, None]).squeeze(1).to(torch.int64)
        slots = torch.where(active, pages * self.page_size + pos % self.page_size, self.scratch_slot)
        if self.host is not None:
            starts, lengths = self.host
            seq_lens: list[int] = [(s + offset if k > active_below else s) + 1 for s, k in zip(starts, lengths)]
            query_start: list[int] = list(range(count + 1))
            max_seq_len = max(seq_lens)
        else:
            seq_lens, query_start = GraphGuardList([0] * count), GraphGuardList([0] * (count + 1))
            max_seq_len = self.max_seq_len
        attn = AttentionMetadata(
            page_size=self.page_size,
            query_start=query_start,
            seq_lens=seq_lens,
            page_table=self.page_table,
            slot_mapping=slots,
            max_query_len=1,
            max_seq_len=max_seq_len,
            seq_lens_tensor=(pos + 1).to(torch.int32),
            query_start_tensor=torch.arange(count + 1, dtype=torch.int32, device=self.device),
        )
        return ForwardBatch(input_ids=tokens, positions=pos, attn=attn,
                            logits_indices=torch.arange(count, device=self.device))


def draw_drafts(logits: torch.Tensor, specs: Sequence[SampleSpec] | None, draft_index: int
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(draft tokens `[rows]`, the distributions sampled rows drew from `[rows, vocab]` or None);
    `specs` None: every row is greedy (a captured chain)."""
    greedy = torch.argmax(logits, dim=-1)
    if specs is None or all(s.sampling.greedy for s in specs):
        return greedy, None
    device = logits.device
    params = [s.sampling for s in specs]
    probs = filtered_probs(
        logits,
        upload([p.temperature for p in params], device, torch.float32),
        upload([p.top_k for p in params], device),
        upload([p.top_p for p in params], device, torch.float32),
        upload([p.min_p for p in params], device, torch.float32),
    )
    drawn = keyed_categorical(
        probs[:, None, :],
        upload([s.seed for s in specs], device),
        upload([s.sample_index + draft_index for s in specs], device)[:, None],
        DRAFT_STREAM,
    )[:, 0]
    sampled = upload([not p.greedy for p in params], device, torch.bool)
    return torch.where(sampled, drawn, greedy), probs


def stack_drafts(tokens: list[torch.Tensor], probs: list[torch.Tensor | None]) -> tuple[torch.Tensor, torch.Tensor | None]:
    stacked = torch.stack(tokens, dim=1)
    if any(p is None for p in probs):
        return stacked, None
    return stacked, torch.stack([p for p in probs if p is not None], dim=1)


def upload(values: Sequence[int] | Sequence[float] | Sequence[bool], device: torch.device,
           dtype: torch.dtype = torch.int64) -> torch.Tensor:
    """Host values on the device without a synchronisation (pinned, non-blocking on CUDA)."""
    tensor = torch.tensor(list(values), dtype=dtype)
    return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor
