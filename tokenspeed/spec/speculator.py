"""`SpeculativeDecoder`: the executor's `Speculator` (`executor/speculator.py`), built from `speculative_config`.

It decides what the runner cannot: which drafts are accepted, and (with a
device drafter) what is drafted.

Verification, per verify row, on the logits of its k+1 positions after the
sampler's own processing of each position (penalties with the history plus
the drafts before it, the min-tokens mask at `sample_index + i`):

* rows whose drafts are deterministic (host drafters; a device drafter's
  greedy drafts; every greedy row): each position's token is drawn by the
  engine's sampler itself (`Sampler.draw`, keyed by (seed, sample_index + i):
  the very draw plain decoding makes there) and drafts are accepted while
  they equal it (`verify.accept_drafts`). Greedy rows get plain greedy
  decoding; sampled rows get point-mass rejection sampling, whose tokens are
  the non-speculative ones token for token (`spec/verify.py`);
* rows whose drafts a model *sampled* from distributions q (a device drafter
  at temperature > 0): `verify.rejection_sample` on the target's filtered
  probabilities (`verify.filtered_probs`), which emits the target
  distribution exactly with higher acceptance than point-mass verification
  of sampled drafts would have.

A step whose verify rows are all plain greedy (`VerifyBatch.greedy`, behind
`fast_greedy_verify`) takes none of the per-position paths above: one argmax
over every verified position, a `[rows, k+1]` gather, the comparison with
the drafts and the first mismatch per row (`verify.accept_drafts`), all
batched: the tokens plain greedy decoding emits, with host work independent
of k.

All of it stays on the device; the runner's one host synchronisation per
step fetches the emitted tokens.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

import torch

from tokenspeed.executor.speculator import DraftRows, ProposedDrafts, StepTail, VerifyBatch, VerifyOutcome
from tokenspeed.spec.verify import accept_drafts, filtered_probs, rejection_sample

if TYPE_CHECKING:
    from tokenspeed.batch.forward_batch import ForwardBatch
    from tokenspeed.executor.cuda_graphs import DecodeGraphs
    from tokenspeed.executor.sampler import Sampler


class DeviceDrafter(Protocol):
    """A drafter that runs on the device (EAGLE, MTP, a draft model): `spec/eagle.py`, `mtp.py`, `draft_model.py`."""

    def kv_bytes_per_page(self) -> int: ...

    def allocate(self, num_pages: int) -> None: ...

    def propose(self, batch: ForwardBatch, rows: DraftRows) -> ProposedDrafts: ...

    def observe(self, batch: ForwardBatch, hidden: torch.Tensor, tail: StepTail) -> None: ...


class SpeculativeDecoder:
    def __init__(self, max_draft_tokens: int, drafter: DeviceDrafter | None = None, *,
                 draft_cuda_graphs: bool = True, fast_greedy_verify: bool = True) -> None:
        """`drafter`: the device drafter; None for host drafters (their drafts come in the plan).
        `draft_cuda_graphs`: capture the drafter's forwards in CUDA graphs when the target has graphs.
        `fast_greedy_verify`: verify an all-plain-greedy step with batched tensor ops (module docstring)."""
        self.max_draft_tokens = max_draft_tokens
        self.drafter = drafter
        self.draft_cuda_graphs = draft_cuda_graphs
        self._fast_greedy_verify = fast_greedy_verify

    @property
    def fast_greedy_verify(self) -> bool:
        return self._fast_greedy_verify

    @property
    def observes(self) -> bool:
        return self.drafter is not None

    def kv_bytes_per_page(self) -> int:
        return 0 if self.drafter is None else self.drafter.kv_bytes_per_page()

    def allocate(self, num_pages: int) -> None:
        if self.drafter is not None:
            self.drafter.allocate(num_pages)

    def propose(self, batch: ForwardBatch, rows: DraftRows) -> ProposedDrafts:
        if self.drafter is None:
            raise RuntimeError("a plan asked for device drafts, but the speculative method drafts on the host")
        return self.drafter.propose(batch, rows)

    def observe(self, batch: ForwardBatch, hidden: torch.Tensor, tail: StepTail) -> None:
        if self.drafter is not None:
            self.drafter.observe(batch, hidden, tail)

    def capture_graphs(self, graphs: DecodeGraphs) -> None:
        capture = getattr(self.drafter, "capture_graphs", None)  # feature drafters (EAGLE, MTP) have graphs
        if self.draft_cuda_graphs and capture is not None:
            capture(graphs, self.max_draft_tokens)

    def release_graphs(self) -> None:
        release = getattr(self.drafter, "release_graphs", None)
        if release is not None:
            release()

    def verify(self, logits: torch.Tensor, batch: VerifyBatch, sampler: Sampler) -> VerifyOutcome:
        if batch.greedy:
            return self._greedy(logits, batch, sampler)
        device = logits.device
        counts = batch.num_draft_tokens
        width = batch.max_draft_tokens + 1
        specs = batch.position_specs
        # Drafts a model sampled (rows at temperature > 0 with the drafter's distributions) go to rejection.
        sampled = batch.draft_probs is not None
        by_rejection = [j for j, offset in enumerate(batch.offsets) if sampled and not specs[offset].sampling.greedy]
        by_point_mass = sorted(set(range(len(counts))) - set(by_rejection))
        tokens = torch.empty(len(counts), width, dtype=torch.int64, device=device)
        emitted = torch.empty(len(counts), dtype=torch.int64, device=device)
        for rows, decide in ((by_point_mass, self._point_mass), (by_rejection, self._rejection)):
            if rows:
                outcome = decide(logits, batch, rows, width, sampler)
                index = _values(rows, torch.int64, device)
                tokens.index_copy_(0, index, outcome.token_ids)
                emitted.index_copy_(0, index, outcome.num_emitted)
        return VerifyOutcome(tokens, emitted)

    @staticmethod
    def _greedy(logits: torch.Tensor, batch: VerifyBatch, sampler: Sampler) -> VerifyOutcome:
        """Every row plain greedy: the argmax of each position (as `Sampler.draw` takes it), drafts accepted
        while equal (`verify.accept_drafts`, in fewer ops). Host work: two small uploads, whatever k."""
        device = logits.device
        rows, width = len(batch.num_draft_tokens), batch.max_draft_tokens + 1
        drawn = sampler.argmax(logits.float())
        meta = _values(batch.offsets + batch.num_draft_tokens, torch.int64, device).view(2, rows, 1)  # one upload
        offsets, counts = meta[0], meta[1]
        cells = torch.arange(width, device=device)
        # row j's cell i: position offsets[j] + min(i, k_j) (cells past k repeat the last position)
        target = drawn[offsets + torch.minimum(cells, counts)]
        # drafts are accepted while equal; a run of equal cells past k (padding) is cut at k
        accepted = (target[:, :-1] == batch.draft_token_ids).cumprod(dim=1).sum(dim=1, keepdim=True)
        num_emitted = torch.minimum(accepted, counts) + 1
        return VerifyOutcome(target.masked_fill(cells >= num_emitted, -1), num_emitted.view(rows))

    @staticmethod
    def _point_mass(logits: torch.Tensor, batch: VerifyBatch, rows: list[int], width: int, sampler: Sampler
                    ) -> VerifyOutcome:
        """Each position drawn by the engine's sampler as plain decoding draws it; drafts accepted while equal."""
        positions, grid = _positions(batch, rows, width)
        specs = [batch.position_specs[p] for p in positions]
        device = logits.device
        drawn = sampler.draw(logits.index_select(0, _values(positions, torch.int64, device)), specs)
        index = _values(rows, torch.int64, device)
        verified = accept_drafts(drawn[_values(grid, torch.int64, device)], batch.draft_token_ids.index_select(0, index),
                                 _values([batch.num_draft_tokens[j] for j in rows], torch.int64, device))
        return VerifyOutcome(verified.token_ids, verified.num_emitted)

    @staticmethod
    def _rejection(logits: torch.Tensor, batch: VerifyBatch, rows: list[int], width: int, sampler: Sampler
                   ) -> VerifyOutcome:
        """Rejection sampling of drafts a model sampled from its distributions (`batch.draft_probs`)."""
        del sampler
        assert batch.draft_probs is not None
        device = logits.device
        positions, grid = _positions(batch, rows, width)
        padded = [positions[i] for line in grid for i in line]
        heads = [batch.position_specs[batch.offsets[j]] for j in rows]
        params = [s.sampling for s in heads for _ in range(width)]
        probs = filtered_probs(
            logits.index_select(0, _values(padded, torch.int64, device)),
            _values([p.temperature for p in params], torch.float32, device),
            _values([p.top_k for p in params], torch.int64, device),
            _values([p.top_p for p in params], torch.float32, device),
            _values([p.min_p for p in params], torch.float32, device),
        ).view(len(rows), width, -1)
        index = _values(rows, torch.int64, device)
        verified = rejection_sample(
            probs,
            batch.draft_token_ids.index_select(0, index),
            _values([batch.num_draft_tokens[j] for j in rows], torch.int64, device),
            _values([s.seed for s in heads], torch.int64, device),
            _values([s.sample_index for s in heads], torch.int64, device),
            draft_probs=batch.draft_probs.index_select(0, index),
        )
        return VerifyOutcome(verified.token_ids, verified.num_emitted)


def _positions(batch: VerifyBatch, rows: list[int], width: int) -> tuple[list[int], list[list[int]]]:
    """The verified positions of `rows` (rows of the verify logits, in order) and a `[len(rows), width]`
    grid into that list; a row's cells past its k repeat its last position (never accepted)."""
    positions: list[int] = []
    grid: list[list[int]] = []
    for j in rows:
        k, first = batch.num_draft_tokens[j], len(positions)
        positions.extend(range(batch.offsets[j], batch.offsets[j] + k + 1))
        grid.append([first + min(i, k) for i in range(width)])
    return positions, grid


def _values(values: Sequence[object], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    tensor = torch.tensor(values, dtype=dtype)
    return tensor.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else tensor
