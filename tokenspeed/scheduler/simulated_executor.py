"""`SimulatedExecutor`: runs `ExecutionPlan`s on the CPU against a simulated paged KV store.

The scheduler is only correct if every row's block table points at pages that
really hold the row's token history: prefix-cache hits (also on pages an
earlier row of the same step writes), eviction, and recompute after
preemption all have to line up. A fake that returned canned tokens would not
notice when they do not. This one keeps, per page, the token id written at
each slot (standing in for K/V), writes each row's input tokens at their
positions, then reads the row's whole context back through its page ids and
raises `AssertionError` if it differs from `prompt + output`. The sampled token is a
hash of that context read from the "KV" (plus seed and sample index unless
greedy), so a request's output depends only on its history, never on batch
composition, preemption or which pages it got: exactly the property the real
engine must have, and what the scheduler tests compare.

Overlap: `run(plan, previous)` stands in for a device that still holds the
previous step's samples. A `PLACEHOLDER_TOKEN_ID` is only legal as the single
input of a decode row (and, until resolved, as the last output token); it is
replaced by what `previous` sampled for that stream, and anywhere else it
raises, so a placeholder the scheduler computed, copied or hashed is caught.

Plans are incremental (see `plan.py`): like the real executor, this one keeps
each request's page table across steps, applies each row's new pages and
each plan's released tables, and raises if a row extends a table it does not
hold as the row says (a lost or repeated update).

Plans carry a request's token history only where the real executor reads it
(penalties, prompt logprobs), so the history this executor checks against
comes from `history(request_id)` (the scheduler's `token_history`): the truth
as the scheduler holds it, never a copy the plan could get wrong. A row of a
request that is no longer live (aborted after the plan was made) still stores
its inputs (a later row of the step may read those pages) but is not checked.

Pure Python, no torch: usable by the scheduler unit tests, the model checker
and any engine test that wants a device-free executor; it has the engine
core's executor interface (`limits`, `launch`, `collect`: see
`executor/interface.py`). Without `history` it keeps no KV and reads no
history (each row costs O(its new tokens and pages)), so
`benchmarks/scheduler_overhead.py` can drive the scheduler at 128K contexts;
tokens are then a hash of the row's position.
"""

from __future__ import annotations

from array import array
from collections.abc import Callable, Sequence
from hashlib import blake2b

from tokenspeed.scheduler.plan import (
    PLACEHOLDER_TOKEN_ID,
    ExecutionPlan,
    ExecutionResult,
    ExecutorLimits,
    RowOutput,
    ScheduledRow,
    TokenLogprob,
)

# request id -> (prompt, outputs so far) of a live request, None once it is not live.
TokenHistory = Callable[[str], tuple[Sequence[int], Sequence[int]] | None]


class SimulatedExecutor:
    __slots__ = ("num_pages", "page_size", "vocab_size", "history", "_slots", "_tables", "num_steps", "num_tokens")

    def __init__(
        self, num_pages: int, page_size: int, vocab_size: int = 32, *, history: TokenHistory | None = None
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.history = history
        self._slots: list[list[int | None]] = [[None] * page_size for _ in range(num_pages if history else 0)]
        self._tables: dict[str, list[int]] = {}  # request id -> its pages, kept across steps
        self.num_steps = 0
        self.num_tokens = 0

    # ---- the engine core's executor interface (`executor/interface.py`) -------------------

    @property
    def limits(self) -> ExecutorLimits:
        return ExecutorLimits(
            vocab_size=self.vocab_size,
            max_model_len=self.num_pages * self.page_size,
            num_pages=self.num_pages,
            page_size=self.page_size,
            device="simulated",
            dtype="token ids",
        )

    def launch(self, plan: ExecutionPlan, previous: ExecutionResult | None = None) -> ExecutionResult:
        """The step runs at once: its handle is its result."""
        return self.run(plan, previous)

    def collect(self, handle: ExecutionResult) -> ExecutionResult:
        return handle

    def run(self, plan: ExecutionPlan, previous: ExecutionResult | None = None) -> ExecutionResult:
        """Run `plan`; `previous` is the step whose samples placeholder inputs stand for."""
        sampled = {
            out.request_id: out.sampled_token_ids[0]
            for out in (previous.rows if previous is not None else [])
            if out.sampled_token_ids
        }
        for request_id in plan.released_request_ids:
            if self._tables.pop(request_id, None) is None:
                raise AssertionError(f"{request_id}: released a page table the executor does not hold")
        outputs = []
        for row in plan.rows:
            pages = self._update_table(row)
            if row.sample and row.sampling.needs_penalties and row.output_token_ids is None:
                raise AssertionError(f"{row.request_id}: penalties read the history, but the row carries none")
            if self.history is None:
                outputs.append(self._run_blind(row))
                continue
            history = self.history(row.request_id)
            if history is None:  # no longer live: its K/V is still written (a later row may read it)
                self._write(row, pages, [sampled.get(row.request_id, t) if t == PLACEHOLDER_TOKEN_ID else t for t in row.input_token_ids])
                outputs.append(self._run_blind(row))
                continue
            outputs.append(self._run_row(row, pages, sampled, history))
        self.num_steps += 1
        self.num_tokens += plan.num_tokens
        return ExecutionResult(step_id=plan.step_id, rows=outputs)

    def _update_table(self, row: ScheduledRow) -> list[int]:
        """The row's page table after its update (fresh when `first_new_page == 0`)."""
        table = self._tables.get(row.request_id)
        if row.first_new_page == 0:
            if table is not None:
                raise AssertionError(f"{row.request_id}: a fresh page table, but the old one was never released")
            table = self._tables[row.request_id] = []
        elif table is None or len(table) != row.first_new_page:
            held = None if table is None else len(table)
            raise AssertionError(f"{row.request_id}: adds pages at {row.first_new_page}, the executor holds {held}")
        table.extend(row.new_page_ids)
        if len(table) * self.page_size < row.end_position:
            raise AssertionError(f"{row.request_id}: {len(table)} pages cannot hold {row.end_position} positions")
        return table

    def _run_blind(self, row: ScheduledRow) -> RowOutput:
        """No history to check against: a token from the row's position and seed, nothing stored or read."""
        output = RowOutput(request_id=row.request_id)
        if row.sample:
            key = (row.end_position * 1_000_003 + row.seed) & ((1 << 63) - 1)
            output.sampled_token_ids.append(key % self.vocab_size)
        return output

    def _run_row(
        self,
        row: ScheduledRow,
        pages: list[int],
        sampled: dict[str, int],
        history: tuple[Sequence[int], Sequence[int]],
    ) -> RowOutput:
        size = self.page_size
        prompt, outputs = history
        context = [*prompt, *outputs]
        start, end = row.start_position, row.end_position
        inputs = row.input_token_ids
        if PLACEHOLDER_TOKEN_ID in inputs:
            if inputs != [PLACEHOLDER_TOKEN_ID] or end != len(context) or row.request_id not in sampled:
                raise AssertionError(f"{row.request_id}: a placeholder is fed other than as its decode input")
            inputs = [sampled[row.request_id]]
            if context[-1] == PLACEHOLDER_TOKEN_ID:  # not resolved on the host yet
                context[-1] = inputs[0]
        if PLACEHOLDER_TOKEN_ID in context[:end]:
            raise AssertionError(f"{row.request_id}: the history it computes holds a placeholder")
        if not row.input_token_ids:
            raise AssertionError(f"{row.request_id}: a row without input tokens has no logits to sample")
        if context[start:end] != inputs:
            raise AssertionError(f"{row.request_id}: input tokens are not the history at {start}..{end}")
        self._write(row, pages, inputs)
        seen = [self._slots[pages[p // size]][p % size] for p in range(end)]
        if seen != context[:end]:
            bad = next(p for p in range(end) if seen[p] != context[p])
            raise AssertionError(
                f"{row.request_id}: KV at position {bad} (page {pages[bad // size]}) holds "
                f"{seen[bad]}, expected token {context[bad]}"
            )
        digest = blake2b(array("q", context[:end]).tobytes(), digest_size=8).digest()
        output = RowOutput(request_id=row.request_id)
        if row.sample:
            output.sampled_token_ids.append(self._sample(digest, row))
            if row.sampling.logprobs is not None:
                output.logprobs = [_fake_logprob(t) for t in output.sampled_token_ids]
        if row.prompt_logprobs_start is not None:
            if row.prompt_token_ids is None:
                raise AssertionError(f"{row.request_id}: prompt logprobs read the prompt, but the row carries none")
            last = min(end, len(prompt) - 1)
            output.prompt_logprobs = [_fake_logprob(prompt[p + 1]) for p in range(row.prompt_logprobs_start, last)]
        return output

    def _write(self, row: ScheduledRow, pages: list[int], tokens: Sequence[int]) -> None:
        """Store `tokens` (the row's resolved inputs) at the row's positions, as a device stores K/V."""
        size = self.page_size
        for position, token in zip(range(row.start_position, row.end_position), tokens, strict=True):
            self._slots[pages[position // size]][position % size] = token

    def _sample(self, context_digest: bytes, row: ScheduledRow) -> int:
        key = blake2b(context_digest, digest_size=8)
        if not row.sampling.greedy:
            key.update(row.seed.to_bytes(16, "little", signed=True))
            key.update(row.sample_index.to_bytes(8, "little"))
        return int.from_bytes(key.digest(), "little") % self.vocab_size


def _fake_logprob(token: int) -> TokenLogprob:
    logprob = -float(token % 7) / 2.0
    return TokenLogprob(token_id=token, logprob=logprob, rank=1, top=[(token, logprob)])
