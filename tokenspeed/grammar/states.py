"""`RequestGrammars`: each constrained request's matcher, the masks of a step, the tokens it accepted.

The engine core (`engine/core.py`) drives it around every step:

1. `add(request_id, sampling)` when a constrained request arrives: its
   grammar starts compiling (`GrammarCompiler`); the scheduler holds the
   request (`ready=False`).
2. `poll()` at the top of each step: requests whose grammar is ready get a
   matcher and are released to the scheduler; those whose grammar failed
   to compile fail (HTTP 400).
3. `masks(plan)` before a plan that samples constrained rows is launched:
   one bitmask per constrained sample (`ExecutionPlan.grammar_masks`). A
   verify row (speculative decoding) gets one per position 0..k: the
   matcher takes the drafts one by one, the mask after each is recorded,
   then it is rolled back to where it was.
4. `accept(plan, result)` after the step: each constrained row's emitted
   tokens advance its matcher (for a verify row: the accepted drafts and
   the model's token).

Why steps with constrained rows run synchronously (no overlap): the mask of
step N+1 depends on the token of step N, which overlap scheduling would leave
on the device when step N+1 is launched. The host fills the masks (about
10-50 us per row with xgrammar's precomputed token masks) between collecting
step N and launching step N+1; other requests in the step lose the overlap
for that step only, and steps with no constrained sample overlap as before.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass

import torch
import xgrammar

from tokenspeed.errors import InvalidRequest, TokenSpeedError
from tokenspeed.grammar.compiler import GrammarCompiler
from tokenspeed.scheduler.plan import ExecutionPlan, ExecutionResult, GrammarMasks
from tokenspeed.scheduler.sampling_params import SamplingParams

logger = logging.getLogger("tokenspeed.grammar")


@dataclass(slots=True)
class _Entry:
    future: Future[xgrammar.CompiledGrammar]
    stop_token_ids: list[int]
    matcher: xgrammar.GrammarMatcher | None = None


class GrammarViolation(TokenSpeedError):
    """A sampled token the request's grammar does not allow (a masking bug, never the client's fault)."""


class RequestGrammars:
    def __init__(self, compiler: GrammarCompiler, fill_threads: int = 4) -> None:
        self.compiler = compiler
        self._entries: dict[str, _Entry] = {}
        self._batch = xgrammar.BatchGrammarMatcher(fill_threads)  # fills many rows' masks at once

    def __contains__(self, request_id: str) -> bool:
        return request_id in self._entries

    @property
    def num_compiling(self) -> int:
        return sum(1 for e in self._entries.values() if e.matcher is None)

    def add(self, request_id: str, sampling: SamplingParams) -> None:
        spec = sampling.structured_outputs
        if spec is None:
            raise ValueError(f"request {request_id!r} has no structured output to compile")
        self._entries[request_id] = _Entry(self.compiler.compile(spec), sorted(sampling.stop_ids()))

    def release(self, request_id: str) -> None:
        """Forget a request (finished, aborted, failed); idempotent."""
        self._entries.pop(request_id, None)

    def prune(self, is_live: Callable[[str], bool]) -> None:
        """Forget every request that `is_live` says ended (a stop token, a length limit, an abort)."""
        for request_id in [r for r in self._entries if not is_live(r)]:
            del self._entries[request_id]

    def poll(self) -> tuple[list[str], list[tuple[str, TokenSpeedError]]]:
        """(requests whose grammar just became ready, requests whose grammar failed: forgotten here)."""
        ready: list[str] = []
        failed: list[tuple[str, TokenSpeedError]] = []
        for request_id, entry in list(self._entries.items()):
            if entry.matcher is not None or not entry.future.done():
                continue
            error = entry.future.exception()
            if error is None:
                # The request's own stop ids end the grammar; a request that cannot stop (ignore_eos, no
                # stop_token_ids) completes its grammar without one and is unconstrained from then on.
                stops = entry.stop_token_ids
                entry.matcher = xgrammar.GrammarMatcher(
                    entry.future.result(), override_stop_tokens=stops or None, terminate_without_stop_token=not stops
                )
                ready.append(request_id)
                continue
            del self._entries[request_id]
            if not isinstance(error, TokenSpeedError):
                logger.error("compiling the grammar of %s failed", request_id, exc_info=error)
                error = InvalidRequest(f"The request's grammar could not be compiled: {error}")
            failed.append((request_id, error))
        return ready, failed

    def wait(self, timeout: float) -> None:
        """Block up to `timeout` seconds for some compilation to finish (the engine has nothing else to do)."""
        pending = [e.future for e in self._entries.values() if e.matcher is None]
        if pending:
            from concurrent.futures import FIRST_COMPLETED
            from concurrent.futures import wait as wait_futures

            wait_futures(pending, timeout=timeout, return_when=FIRST_COMPLETED)

    def constrains(self, plan: ExecutionPlan) -> bool:
        """Whether `plan` samples a constrained row (then it needs masks, and runs synchronously)."""
        return any(r.sample and self._active(r.request_id) for r in plan.rows)

    def _active(self, request_id: str) -> bool:
        entry = self._entries.get(request_id)
        return entry is not None and entry.matcher is not None and not entry.matcher.is_terminated()

    def masks(self, plan: ExecutionPlan) -> GrammarMasks | None:
        """The bitmasks of every constrained sample of `plan` (None if it has none)."""
        positions: list[tuple[int, int]] = []
        matchers: list[tuple[xgrammar.GrammarMatcher, list[int]]] = []  # per row: matcher, drafts to walk
        for i, row in enumerate(plan.rows):
            entry = self._entries.get(row.request_id)
            if not row.sample or entry is None or entry.matcher is None or entry.matcher.is_terminated():
                continue  # not constrained, or its grammar is complete (see `poll`)
            # Host drafts only: the host cannot mask the positions of drafts it never sees (device
            # drafters), so those rows get position 0 only (spec/EXECUTOR_INTEGRATION.md).
            drafts = list(row.draft_token_ids) if row.num_draft_tokens else []
            positions.extend((i, p) for p in range(len(drafts) + 1))
            matchers.append((entry.matcher, drafts))
        if not positions:
            return None
        bitmask = xgrammar.allocate_token_bitmask(len(positions), self.compiler.vocab_size)
        plain: list[xgrammar.GrammarMatcher] = []  # rows without drafts: filled in parallel threads
        plain_rows: list[int] = []
        at = 0
        for matcher, drafts in matchers:
            if drafts:
                at = _fill_positions(matcher, drafts, bitmask, at)
            else:
                plain.append(matcher)
                plain_rows.append(at)
                at += 1
        if len(plain) > 1:
            self._batch.batch_fill_next_token_bitmask(plain, bitmask, plain_rows)
        elif plain:
            plain[0].fill_next_token_bitmask(bitmask, plain_rows[0])
        return GrammarMasks(positions, bitmask.shape[1], bitmask.numpy().tobytes())

    def accept(self, plan: ExecutionPlan, result: ExecutionResult) -> list[tuple[str, TokenSpeedError]]:
        """Advance each constrained row's matcher by the tokens it emitted; the requests whose token the
        grammar refused (forgotten here: the caller fails them)."""
        violations: list[tuple[str, TokenSpeedError]] = []
        for row, output in zip(plan.rows, result.rows):
            entry = self._entries.get(row.request_id)
            if not row.sample or entry is None or entry.matcher is None:
                continue
            for token in output.sampled_token_ids:
                if entry.matcher.is_terminated():
                    break  # the stop token ended it; the scheduler finishes the request
                if not entry.matcher.accept_token(token):
                    del self._entries[row.request_id]
                    violations.append((row.request_id, GrammarViolation(
                        f"token {token} sampled for {row.request_id} breaks its grammar")))
                    break
        return violations


def _fill_positions(matcher: xgrammar.GrammarMatcher, drafts: list[int], bitmask: torch.Tensor, at: int) -> int:
    """Masks of positions 0..len(drafts) into rows `at..` of `bitmask`: position i is the state after
    drafts 1..i (a draft the grammar refuses leaves the later positions at its state: the verifier
    rejects that draft, so they are never used). The matcher ends where it began."""
    taken = 0
    for position in range(len(drafts) + 1):
        matcher.fill_next_token_bitmask(bitmask, at + position)
        if position < len(drafts) and taken == position and not matcher.is_terminated() \
                and matcher.accept_token(drafts[position]):
            taken += 1
    if taken:
        matcher.rollback(taken)
    return at + len(drafts) + 1
