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

Pure Python, no torch: usable by the scheduler unit tests, the model checker
and any engine test that wants a device-free executor. With
`check_history=False` it keeps no KV and reads no history (each row costs
O(its new tokens and pages)), so `benchmarks/scheduler_overhead.py` can drive
the scheduler at 128K contexts; tokens are then a hash of the row's position.
"""

from __future__ import annotations

from array import array
from hashlib import blake2b

from tokenspeed.scheduler.plan import (
    PLACEHOLDER_TOKEN_ID,
    ExecutionPlan,
    ExecutionResult,
    RowOutput,
    ScheduledRow,
    TokenLogprob,
)


class SimulatedExecutor:
    __slots__ = ("page_size", "vocab_size", "check_history", "_slots", "_tables", "num_steps", "num_tokens")

    def __init__(self, num_pages: int, page_size: int, vocab_size: int = 32, *, check_history: bool = True) -> None:
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.check_history = check_history
        self._slots: list[list[int | None]] = [[None] * page_size for _ in range(num_pages if check_history else 0)]
        self._tables: dict[str, list[int]] = {}  # request id -> its pages, kept across steps
        self.num_steps = 0
        self.num_tokens = 0

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
            outputs.append(self._run_row(row, pages, sampled) if self.check_history else self._run_blind(row))
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
        """`check_history=False`: a token from the row's position and seed, nothing stored or read."""
        output = RowOutput(request_id=row.request_id)
        if row.sample:
            key = (row.end_position * 1_000_003 + row.seed) & ((1 << 63) - 1)
            output.sampled_token_ids.append(key % self.vocab_size)
        return output

    def _run_row(self, row: ScheduledRow, pages: list[int], sampled: dict[str, int]) -> RowOutput:
        size = self.page_size
        context = row.prompt_token_ids + row.output_token_ids
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
        for position in range(start, end):
            self._slots[pages[position // size]][position % size] = context[position]
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
            last = min(end, len(row.prompt_token_ids) - 1)
            output.prompt_logprobs = [
                _fake_logprob(row.prompt_token_ids[p + 1]) for p in range(row.prompt_logprobs_start, last)
            ]
        return output

    def _sample(self, context_digest: bytes, row: ScheduledRow) -> int:
        key = blake2b(context_digest, digest_size=8)
        if not row.sampling.greedy:
            key.update(row.seed.to_bytes(16, "little", signed=True))
            key.update(row.sample_index.to_bytes(8, "little"))
        return int.from_bytes(key.digest(), "little") % self.vocab_size


def _fake_logprob(token: int) -> TokenLogprob:
    logprob = -float(token % 7) / 2.0
    return TokenLogprob(token_id=token, logprob=logprob, rank=1, top=[(token, logprob)])
