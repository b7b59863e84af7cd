"""CUDA graphs of a feature drafter (EAGLE, MTP): its greedy draft chain and its catch-up.

Why: a drafter step is one small layer plus an LM head, a few dozen kernel
launches; a chain of k of them plus the catch-up launched eagerly costs
several milliseconds of host time a step, against well under one for the
target's whole verify forward replayed from its graph, so EAGLE and MTP ran
at a fraction of plain decoding's speed at batch size 1. Replaying captured
graphs makes a speculative step a handful of launches.

Two kinds of graphs, sharing one memory pool of their own:

* `propose`, per (row bucket, chain length): the chain of
  `FeatureDrafter.draft` on static buffers (each row's kept feature, start
  position, draft length and page table; padded rows have draft length 0,
  start 0 and the scratch page, so they write only that page). Greedy rows
  only: a step with a sampling row drafts eagerly (its draws read host
  specs). The buckets are the target's verify buckets (`DecodeGraphs`);
* `observe`, per target graph (bucket, tokens a row, split count): the
  drafter's step over the positions the target just computed, reading the
  target graph's own static metadata (positions, slots, sequence lengths,
  page table: the replay just wrote them) and static copies of the target's
  hidden states and the next tokens.

Everything per step is computed on the device (`DraftChain`), so nothing in
a graph reads a device value on the host: before capturing, each kind runs
once with host lists that refuse element access and PyTorch's sync debug
mode set to "error", like the target's graphs; a drafter that fails the
probe stays eager. The off switch is `speculative_config`'s
`draft_cuda_graphs` (or `enforce_eager`, which turns every graph off).
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import torch

from tokenspeed.batch.forward_batch import ForwardBatch, NotCapturable
from tokenspeed.executor.speculator import DraftRows, ProposedDrafts
from tokenspeed.spec.draft_chain import DraftChain, upload

if TYPE_CHECKING:
    from tokenspeed.executor.cuda_graphs import DecodeGraphs
    from tokenspeed.spec.feature_drafter import FeatureDrafter

logger = logging.getLogger("tokenspeed.spec")

_TargetKey = tuple[int, int, int | None]  # a target graph: (row bucket, tokens a row, split count)


class Replayable(Protocol):
    """A recorded computation (`torch.cuda.CUDAGraph`) that rewrites its outputs in place."""

    def replay(self) -> None: ...

    def reset(self) -> None: ...


class DraftGraphs:
    def __init__(self, drafter: FeatureDrafter, target: DecodeGraphs, max_draft_tokens: int) -> None:
        assert drafter.kv is not None, "allocate() first"
        self.drafter = drafter
        self.target = target
        self.max_draft_tokens = max_draft_tokens
        self.sizes = list(target.verify_sizes)  # rows whose verify step is a graph
        device, width = target.device, drafter.states.values.shape[1]
        rows = max(self.sizes, default=0)
        self.features = torch.zeros(rows, width, dtype=drafter.dtype, device=device)
        self.start = torch.zeros(rows, dtype=torch.int64, device=device)
        self.lengths = torch.zeros(rows, dtype=torch.int64, device=device)
        self.page_table = torch.full((rows, target.page_table.shape[1]), drafter.scratch_page, dtype=torch.int32,
                                     device=device)
        tokens = target.input_ids.shape[0]
        self.next_ids = torch.zeros(tokens, dtype=torch.int64, device=device)
        self.hidden = torch.zeros(tokens, width, dtype=drafter.dtype, device=device)
        self._propose: dict[tuple[int, int], tuple[Replayable, torch.Tensor]] = {}
        self._observe: dict[_TargetKey, tuple[Replayable, torch.Tensor]] = {}
        self.pool: Any = None  # the graphs' shared memory pool

    # ---- the captured computations -----------------------------------------------------------------

    def _chain(self, bs: int, steps: int) -> torch.Tensor:
        chain = DraftChain(self.page_table[:bs], self.start[:bs], self.lengths[:bs],
                           page_size=self.target.page_size, scratch_page=self.drafter.scratch_page, host=None,
                           max_seq_len=self.target.max_model_len)
        return self.drafter.draft(chain, self.features[:bs], None, steps).token_ids

    def _catch_up(self, key: _TargetKey) -> torch.Tensor:
        bs, q_len, splits = key
        batch: ForwardBatch = self.target._batch(bs, q_len, splits)
        count = bs * q_len
        assert self.drafter.kv is not None
        return self.drafter.step(batch.positions, self.next_ids[:count], self.hidden[:count], batch.attn,
                                 self.drafter.kv)

    # ---- capture -------------------------------------------------------------------------------------

    def _capturable(self) -> bool:
        previous = torch.cuda.get_sync_debug_mode()
        try:
            torch.cuda.set_sync_debug_mode("error")
            if self.sizes:
                self._chain(self.sizes[-1], self.max_draft_tokens)
            for key in self.target._graphs:
                self._catch_up(key)
        except (NotCapturable, RuntimeError) as exc:
            logger.warning("drafter CUDA graphs off: the drafter cannot run inside a graph (%s)", exc)
            return False
        finally:
            torch.cuda.set_sync_debug_mode(previous)
            torch.cuda.synchronize(self.target.device)
        return True

    @torch.inference_mode()
    def capture(self) -> bool:
        """Capture every propose and observe graph; False (the drafter stays eager) when it cannot be."""
        device = self.target.device
        torch.cuda.synchronize(device)
        if not self._capturable():
            return False
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]

        def record(run: Callable[[], torch.Tensor]) -> tuple[Replayable, torch.Tensor]:
            stream.wait_stream(torch.cuda.current_stream(device))
            with torch.cuda.stream(stream):
                run()  # warm-up on the capture stream
            torch.cuda.current_stream(device).wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                out = run()
            return graph, out

        self.record_all(record)
        torch.cuda.synchronize(device)
        logger.info("captured %d drafter CUDA graphs (propose: row buckets %s, chains of 1..%d; observe: %d)",
                    len(self._propose) + len(self._observe), self.sizes, self.max_draft_tokens, len(self._observe))
        return True

    def record_all(self, record: Callable[[Callable[[], torch.Tensor]], tuple[Replayable, torch.Tensor]]) -> None:
        """Record every graph with `record` (a CUDA capture; tests on the CPU pass a recorder that re-runs)."""
        for bs in sorted(self.sizes, reverse=True):
            for steps in range(self.max_draft_tokens, 0, -1):
                self._propose[(bs, steps)] = record(functools.partial(self._chain, bs, steps))
        for key in sorted(self.target._graphs, key=lambda k: k[0] * k[1], reverse=True):
            self._observe[key] = record(functools.partial(self._catch_up, key))

    def release(self) -> None:
        for graph, _ in [*self._propose.values(), *self._observe.values()]:
            graph.reset()
        self._propose.clear()
        self._observe.clear()
        self.pool = None

    # ---- replay -------------------------------------------------------------------------------------

    def propose(self, batch: ForwardBatch, rows: DraftRows) -> ProposedDrafts | None:
        """The rows' greedy drafts from a replay; None when no graph fits (the caller drafts eagerly)."""
        count = len(rows.num_draft_tokens)
        steps = max(rows.num_draft_tokens)
        if any(not spec.sampling.greedy for spec in rows.specs):
            return None
        bs = next((b for b in self.sizes if b >= count), None)
        table = batch.attn.page_table
        if bs is None or (bs, steps) not in self._propose or table.shape[1] > self.page_table.shape[1]:
            return None
        device = self.target.device
        self.page_table[:count, : table.shape[1]].copy_(table.index_select(0, rows.batch_rows))
        self.page_table[count:bs, :1].fill_(self.drafter.scratch_page)
        self.start[:bs].copy_(upload(rows.start_positions + [0] * (bs - count), device))
        self.lengths[:bs].copy_(upload(rows.num_draft_tokens + [0] * (bs - count), device))
        self.features[:count].copy_(self.drafter.states.read(rows.slots))
        graph, tokens = self._propose[(bs, steps)]
        graph.replay()
        return ProposedDrafts(tokens[:count].clone(), None)

    def observe(self, key: _TargetKey, hidden: torch.Tensor, next_ids: torch.Tensor) -> torch.Tensor | None:
        """The drafter's features over a target graph step (key: that graph); None: no graph (run eagerly)."""
        entry = self._observe.get(key)
        if entry is None:
            return None
        count = hidden.shape[0]
        self.hidden[:count].copy_(hidden)
        self.next_ids[:count].copy_(next_ids)
        graph, features = entry
        graph.replay()
        return features[:count]
