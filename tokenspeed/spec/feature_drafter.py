"""`FeatureDrafter`: drafters that predict from the target's features (EAGLE heads, MTP layers).

Both run a small network over pairs (f_q, t_{q+1}): the target's final
hidden state at position q and the token that follows it, at rope position
q, attending causally over their own K/V; the output stands in for f_{q+1}
and its logits (through an LM head) draft t_{q+2}. Chaining feeds each
output back as the next step's feature.

Catching up (`observe`, after every step): the network runs over every
position the target just computed, with the step's own attention metadata
(same positions, same pages, same slots: the drafter's K/V is a paged
storage of its own on the scheduler's page ids), each position paired with
its next token (the runner's `StepTail`). Rejected draft positions get
wrong pairs, but they are rewritten before anything reads them, like the
target's. The output at each sampling row's last accepted position is kept
per request (`SlotStates`): it drafts the row's first token next step.

Proposing (`propose`, before the verify forward): draft 1 comes from the
kept feature, drafts 2 .. k from a chain of one-token steps at positions
p .. p+k-2 (p: the row's input position), inside the row's verify pages.
On a GPU with CUDA graphs both run as graph replays (`draft_graphs.py`).

Accuracy, not exactness, is what a wrong pair costs: the target verifies
everything, so a pair built on a wrong token (a prompt chunk's last
position, whose next token comes in the next chunk; a prefix-cache hit
whose last cached position was paired by another request) only lowers
acceptance.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from tokenspeed.batch.forward_batch import AttentionMetadata, ForwardBatch
from tokenspeed.batch.kv_storage import PagedKVStorage
from tokenspeed.executor.speculator import DraftRows, ProposedDrafts, StepTail
from tokenspeed.spec.draft_chain import DraftChain, SlotStates, draw_drafts, stack_drafts

if TYPE_CHECKING:
    from tokenspeed.executor.cuda_graphs import DecodeGraphs
    from tokenspeed.executor.sampler import SampleSpec
    from tokenspeed.spec.draft_graphs import DraftGraphs


class FeatureDrafter(ABC):
    def __init__(self, *, hidden_size: int, kv_layout: tuple[int, int, int], page_size: int, dtype: torch.dtype,
                 device: torch.device, kv_dtype: torch.dtype | None = None) -> None:
        self.kv_layout = kv_layout  # (kv heads, key dim, value dim) of the drafter's one attention layer
        self.page_size = page_size
        self.scratch_page = -1  # the pool's last page, known at `allocate`
        self.dtype = dtype
        self.kv_dtype = kv_dtype or dtype  # the target's `kv_cache_dtype` (fp8: its attention passes the scales)
        self.device = device
        self.kv: PagedKVStorage | None = None
        self.states = SlotStates(hidden_size, dtype, device)
        self.graphs: DraftGraphs | None = None  # captured by `capture_graphs` (CUDA, graphs on)

    @abstractmethod
    def step(self, positions: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor, attn: AttentionMetadata,
             kv: PagedKVStorage) -> torch.Tensor:
        """The network on pairs (features[i], tokens[i]) at `positions`; writes their K/V; new features."""

    @abstractmethod
    def logits(self, features: torch.Tensor) -> torch.Tensor:
        """Draft logits `[n, vocab]` (fp32) of the features."""

    def kv_bytes_per_page(self) -> int:
        heads, k_dim, v_dim = self.kv_layout
        return PagedKVStorage.bytes_per_page(num_layers=1, page_size=self.page_size, num_kv_heads=heads,
                                             head_dim=k_dim, v_head_dim=v_dim, dtype=self.kv_dtype)

    def allocate(self, num_pages: int) -> None:
        heads, k_dim, v_dim = self.kv_layout
        self.scratch_page = num_pages - 1
        self.kv = PagedKVStorage(num_layers=1, num_pages=num_pages, page_size=self.page_size, num_kv_heads=heads,
                                 head_dim=k_dim, v_head_dim=v_dim, dtype=self.kv_dtype, device=self.device)

    def capture_graphs(self, target: DecodeGraphs, max_draft_tokens: int) -> None:
        """Capture the chain and the catch-up in CUDA graphs beside the target's (`draft_graphs.py`)."""
        from tokenspeed.spec.draft_graphs import DraftGraphs

        graphs = DraftGraphs(self, target, max_draft_tokens)
        self.graphs = graphs if graphs.capture() else None

    def release_graphs(self) -> None:
        if self.graphs is not None:
            self.graphs.release()
            self.graphs = None

    def observe(self, batch: ForwardBatch, hidden: torch.Tensor, tail: StepTail) -> None:
        assert self.kv is not None, "allocate() first"
        features = None
        if self.graphs is not None and tail.graph is not None:
            features = self.graphs.observe(tail.graph, hidden, tail.next_token_ids)
        if features is None:
            features = self.step(batch.positions, tail.next_token_ids, hidden, batch.attn, self.kv)
        if tail.max_slot >= 0:
            self.states.write(tail.slots, features.index_select(0, tail.last_index), tail.max_slot)

    def propose(self, batch: ForwardBatch, rows: DraftRows) -> ProposedDrafts:
        assert self.kv is not None, "allocate() first"
        if self.graphs is not None:
            replayed = self.graphs.propose(batch, rows)
            if replayed is not None:
                return replayed
        chain = DraftChain.of_rows(batch, rows, self.scratch_page)
        return self.draft(chain, self.states.read(rows.slots), rows.specs, max(rows.num_draft_tokens))

    def draft(self, chain: DraftChain, features: torch.Tensor, specs: Sequence[SampleSpec] | None, steps: int
              ) -> ProposedDrafts:
        """`steps` drafts per row of `chain` from its kept `features` (`specs` None: all greedy, as captured)."""
        assert self.kv is not None, "allocate() first"
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor | None] = []
        for j in range(steps):
            drafted, q = draw_drafts(self.logits(features), specs, j)
            tokens.append(drafted)
            probs.append(q)
            if j + 1 < steps:  # draft j + 2 from (feature, draft j + 1) at position p + j
                step = chain.step(drafted, j, active_below=j + 1)
                features = self.step(step.positions, drafted, features, step.attn, self.kv)
        token_ids, draft_probs = stack_drafts(tokens, probs)
        return ProposedDrafts(token_ids, draft_probs)

