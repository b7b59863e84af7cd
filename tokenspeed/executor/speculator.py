"""`Speculator`: what the model runner asks of speculative decoding, which `spec/` implements.

The runner owns everything about a verify row that is batch layout: its
k+1 input tokens `[last, d1 .. dk]` at positions p .. p+k, their K/V, logits
at all k+1 positions, rolled-back page tables, the emitted tokens in the
result. What is *decided* about drafts is not the executor's: which drafted
tokens are accepted (greedy, point-mass or rejection sampling, `spec/verify.py`)
and, for device drafters (EAGLE, MTP, a draft model), what is drafted. The
runner hands those decisions to a `Speculator` through the records below;
`spec/speculator.py` builds one from `speculative_config` (the import order
puts `spec/` above the executor, so the executor only names the protocol).

One step, in order:

1. `propose(batch, rows)` for verify rows without host drafts, before the
   target's forward: the drafter reads the step's batch (its positions, page
   tables, the rows' input tokens, already resolved from the previous step)
   and returns k drafts per row on the device; the runner writes them into
   the batch's input ids;
2. the target's forward and logits;
3. `verify(logits, batch, sampler)`: the emitted tokens of every verify row,
   from the verified positions' logits after the sampler's own processing
   (penalties, min-tokens) with one `SampleSpec` per position;
4. `observe(batch, hidden, tail)`: a drafter that keeps state of its own
   (its KV in its own paged storage on the same page ids, the features it
   drafts from) catches up on the positions the target just computed.

The executor builds its speculator (a factory from `spec/`) right after the
target's weights, so a drafter's own weights are loaded before the KV pool is
sized from the memory left, and the pool's pages are sized for the target's
K/V and the drafter's together (`kv_bytes_per_page`, `allocate`).

Records hold device tensors where the values are only known on the device
(device drafts, emitted tokens), host lists where the runner knows them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

if TYPE_CHECKING:
    from tokenspeed.batch.forward_batch import ForwardBatch
    from tokenspeed.executor.cuda_graphs import DecodeGraphs
    from tokenspeed.executor.sampler import Sampler, SampleSpec


@dataclass(slots=True)
class VerifyBatch:
    """The verify rows of one step, in plan order."""

    plan_rows: list[int]  # the plan row of each verify row
    num_draft_tokens: list[int]  # k of each row
    offsets: list[int]  # row i's k_i + 1 positions are rows offsets[i] .. of the verified logits
    draft_token_ids: torch.Tensor  # [rows, max k] int64 on the logits' device, 0 past a row's k
    draft_probs: torch.Tensor | None  # [rows, max k, vocab]: the distributions a sampling drafter drew from
    position_specs: list[SampleSpec]  # per verified position (row 0's k_0 + 1, then row 1's, ...)
    # Every row plain greedy (`verify_step.plain_greedy`) and the speculator's `fast_greedy_verify` on: the
    # emitted tokens are the argmaxes of the raw logits, no per-position processing; `position_specs` then
    # repeats each row's own spec for its k + 1 positions (no draw reads a position's key or history).
    greedy: bool = False

    @property
    def max_draft_tokens(self) -> int:
        return max(self.num_draft_tokens)


@dataclass(slots=True)
class VerifyOutcome:
    token_ids: torch.Tensor  # [rows, max k + 1] int64: the emitted tokens, -1 past num_emitted
    num_emitted: torch.Tensor  # [rows] int64, 1 .. k + 1


@dataclass(slots=True)
class DraftRows:
    """The rows a device drafter drafts for, before the step's forward."""

    batch_rows: torch.Tensor  # [rows] int64: each row's index in the step's batch (its page table row)
    token_index: torch.Tensor  # [rows] int64: flat index of each row's input token in the batch
    slots: torch.Tensor  # [rows] int64: the requests' page-table slots, where a drafter keeps per-request state
    start_positions: list[int]  # position of each row's input token (the last emitted one)
    num_draft_tokens: list[int]  # k of each row
    specs: list[SampleSpec]  # each row's sampling, keyed at its sample index (drafts are keyed + i)


@dataclass(slots=True)
class ProposedDrafts:
    token_ids: torch.Tensor  # [rows, max k] int64 on the device (past a row's k: unused)
    probs: torch.Tensor | None  # [rows, max k, vocab] when some row sampled its drafts, else None


@dataclass(slots=True)
class StepTail:
    """What the target computed this step, for a drafter catching up (`Speculator.observe`)."""

    next_token_ids: torch.Tensor  # [tokens]: the token that follows each position (see the runner)
    last_index: torch.Tensor  # [n] flat index of each sampling row's last accepted position
    slots: torch.Tensor  # [n] the page-table slot of each sampling row
    max_slot: int  # the largest of them (-1: none), known on the host
    graph: tuple[int, int, int | None] | None = None  # the target graph the step replayed (bucket, q_len, splits)


class Speculator(Protocol):
    @property
    def max_draft_tokens(self) -> int:
        """k: the most drafts a row carries (`num_speculative_tokens`); verify graphs hold k+1 tokens a row."""
        ...

    def kv_bytes_per_page(self) -> int:
        """Bytes of the drafter's own KV per page (0 without one): the pool is sized for both."""
        ...

    def allocate(self, num_pages: int) -> None:
        """Allocate the drafter's paged KV: `num_pages` pages of the target's page size (scratch included)."""
        ...

    @property
    def observes(self) -> bool:
        """Whether `observe` must run after every step (a device drafter with state of its own)."""
        ...

    @property
    def fast_greedy_verify(self) -> bool:
        """Whether a step whose verify rows are all plain greedy skips the sampler's per-position processing
        (`VerifyBatch.greedy`): argmax, compare, first mismatch per row, as batched tensor ops."""
        ...

    def propose(self, batch: ForwardBatch, rows: DraftRows) -> ProposedDrafts:
        """k drafts per row (device drafters; host drafters never get here)."""
        ...

    def verify(self, logits: torch.Tensor, batch: VerifyBatch, sampler: Sampler) -> VerifyOutcome:
        """The emitted tokens of each verify row from its k+1 rows of `logits` `[positions, vocab]`, processed
        per position as the sampler would (`Sampler.process` with `batch.position_specs`)."""
        ...

    def observe(self, batch: ForwardBatch, hidden: torch.Tensor, tail: StepTail) -> None:
        """Catch up on the step's positions (hidden `[tokens, hidden]`: the target's final hidden states)."""
        ...

    def capture_graphs(self, graphs: DecodeGraphs) -> None:
        """Capture the drafter's own CUDA graphs beside the target's `graphs` (no-op without a device drafter)."""
        ...

    def release_graphs(self) -> None:
        """Destroy what `capture_graphs` captured."""
        ...
