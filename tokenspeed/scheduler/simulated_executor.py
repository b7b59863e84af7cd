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

Speculative decoding: a verify row's drafts (the row's host drafts, or for
`num_draft_tokens` without them, drafts of this executor's own "device
drafter": the model's token, made wrong at about one position in three) are
written into the KV at their positions and verified exactly as a real
verifier does: the model's token at each position given the history and the
drafts before it (keyed by `sample_index + i`), accepting drafts while they
equal it, then emitting the model's token. Because the hash "model" is a
function of the history and the key, the emitted tokens are the very tokens
of the non-speculative run. After a verify row the executor expects the
request's next row to cut its table to the pages of the accepted positions
(and raises if pages that held only rejected drafts were kept or if more were
cut), so rollback is checked like every other table update.

KV tiers: a plan's copies run before its rows, device -> host first, then
host -> device, on a simulated host pool (a dict of slot contents), and the
result confirms them all. So a retracted request restored from the host, or
a prefix loaded from a host hit, is read back and checked like any other KV.
Disk copies are not simulated (the kvcache tier model checker covers them).

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

from tokenspeed.kvcache import CopyKind
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
    __slots__ = ("num_pages", "page_size", "vocab_size", "history", "_slots", "_tables", "_rolled_back",
                 "_host", "num_steps", "num_tokens", "num_copies")

    def __init__(
        self, num_pages: int, page_size: int, vocab_size: int = 32, *, history: TokenHistory | None = None
    ) -> None:
        self.num_pages = num_pages
        self.page_size = page_size
        self.vocab_size = vocab_size
        self.history: TokenHistory | None = None
        self._slots: list[list[int | None]] = []
        if history is not None:
            self.check_against(history)
        self._tables: dict[str, list[int]] = {}  # request id -> its pages, kept across steps
        self._rolled_back: dict[str, int] = {}  # request id -> pages its accepted positions fill after a verify
        self._host: dict[int, list[int | None]] = {}  # host slot -> the page contents copied there
        self.num_copies = 0
        self.num_steps = 0
        self.num_tokens = 0

    def check_against(self, history: TokenHistory) -> None:
        """Keep simulated KV and check every row against `history` from now on (a scheduler built after
        this executor hands its `token_history` here)."""
        self.history = history
        self._slots = [[None] * self.page_size for _ in range(self.num_pages)]

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
            self._rolled_back.pop(request_id, None)
        completed = self._run_copies(plan)
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
                self._write(pages, row.start_position,
                            [sampled.get(row.request_id, t) if t == PLACEHOLDER_TOKEN_ID else t for t in row.input_token_ids])
                outputs.append(self._run_blind(row))
                continue
            outputs.append(self._run_row(row, pages, sampled, history))
        self.num_steps += 1
        self.num_tokens += plan.num_tokens
        return ExecutionResult(step_id=plan.step_id, rows=outputs, completed_copies=completed)

    def _run_copies(self, plan: ExecutionPlan) -> list[tuple[int, bool]]:
        """Device -> host copies, then host -> device ones (`ExecutionPlan.copies`); all confirmed at once."""
        order = {CopyKind.DEVICE_TO_HOST: 0, CopyKind.HOST_TO_DEVICE: 1}
        for op in sorted(plan.copies, key=lambda op: order.get(op.kind, 2)):
            if op.kind not in order:
                raise AssertionError(f"copy {op.op_id}: {op.kind.value} copies are not simulated")
            self.num_copies += 1
            if self.history is None:
                continue
            if op.kind is CopyKind.DEVICE_TO_HOST:
                self._host[op.host_slot] = list(self._slots[op.device_page])
            else:
                self._slots[op.device_page] = list(self._host[op.host_slot])
        return [(op.op_id, True) for op in plan.copies]

    def _update_table(self, row: ScheduledRow) -> list[int]:
        """The row's page table after its update (fresh when `first_new_page == 0`)."""
        table = self._tables.get(row.request_id)
        kept = self._rolled_back.pop(row.request_id, None)
        if table is not None and kept is not None and kept < len(table):
            if row.first_new_page != kept:
                raise AssertionError(
                    f"{row.request_id}: after its verify row {kept} pages hold accepted positions, but the next "
                    f"row keeps {row.first_new_page} of {len(table)} (rejected drafts not rolled back exactly)"
                )
            del table[kept:]
        if row.first_new_page == 0:
            if table is not None:
                raise AssertionError(f"{row.request_id}: a fresh page table, but the old one was never released")
            table = self._tables[row.request_id] = []
        elif table is None or len(table) != row.first_new_page:
            held = None if table is None else len(table)
            raise AssertionError(f"{row.request_id}: adds pages at {row.first_new_page}, the executor holds {held}")
        table.extend(row.new_page_ids)
        if len(table) * self.page_size < row.kv_end_position:
            raise AssertionError(f"{row.request_id}: {len(table)} pages cannot hold {row.kv_end_position} positions")
        return table

    def _run_blind(self, row: ScheduledRow) -> RowOutput:
        """No history to check against: a token from the row's position and seed, nothing stored or read."""
        output = RowOutput(request_id=row.request_id)
        if row.sample:
            key = (row.end_position * 1_000_003 + row.seed) & ((1 << 63) - 1)
            accepted = key % (row.num_draft_tokens + 1)
            drafts = row.draft_token_ids or [(key >> 8) % self.vocab_size] * row.num_draft_tokens
            output.sampled_token_ids = [*drafts[:accepted], key % self.vocab_size]
            self._note_verify(row, output)
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
        if row.num_draft_tokens and (not row.sample or end != len(context)):
            raise AssertionError(f"{row.request_id}: drafts on a row that does not decode the last token")
        drafts = row.draft_token_ids or self._device_drafts(context[:end], row)
        if len(drafts) != row.num_draft_tokens:
            raise AssertionError(f"{row.request_id}: {len(drafts)} drafts, num_draft_tokens {row.num_draft_tokens}")
        written = context[:end] + drafts
        self._write(pages, start, written[start:])
        seen = [self._slots[pages[p // size]][p % size] for p in range(len(written))]
        if seen != written:
            bad = next(p for p in range(len(written)) if seen[p] != written[p])
            raise AssertionError(
                f"{row.request_id}: KV at position {bad} (page {pages[bad // size]}) holds "
                f"{seen[bad]}, expected token {written[bad]}"
            )
        output = RowOutput(request_id=row.request_id)
        if row.sample:
            for i in range(len(drafts) + 1):  # verify: accept drafts while they are the model's token
                token = self._row_token(written[: end + i], row, row.sample_index + i)
                output.sampled_token_ids.append(token)
                if i == len(drafts) or drafts[i] != token:
                    break
            self._note_verify(row, output)
            if row.sampling.logprobs is not None:
                output.logprobs = [_fake_logprob(t) for t in output.sampled_token_ids]
        if row.prompt_logprobs_start is not None:
            if row.prompt_token_ids is None:
                raise AssertionError(f"{row.request_id}: prompt logprobs read the prompt, but the row carries none")
            last = min(end, len(prompt) - 1)
            output.prompt_logprobs = [_fake_logprob(prompt[p + 1]) for p in range(row.prompt_logprobs_start, last)]
        return output

    def _write(self, pages: list[int], start: int, tokens: Sequence[int]) -> None:
        """Store `tokens` at positions `start...`, as a device stores K/V."""
        size = self.page_size
        for position, token in enumerate(tokens, start):
            self._slots[pages[position // size]][position % size] = token

    def model_token(self, context: list[int], *, greedy: bool, seed: int = 0, sample_index: int = 0) -> int:
        """The hash "model": the token it samples after `context` (keyed by seed and index unless greedy)."""
        key = blake2b(blake2b(array("q", context).tobytes(), digest_size=8).digest(), digest_size=8)
        if not greedy:
            key.update(seed.to_bytes(16, "little", signed=True))
            key.update(sample_index.to_bytes(8, "little"))
        return int.from_bytes(key.digest(), "little") % self.vocab_size

    def _row_token(self, context: list[int], row: ScheduledRow, sample_index: int) -> int:
        return self.model_token(context, greedy=row.sampling.greedy, seed=row.seed, sample_index=sample_index)

    def _device_drafts(self, context: list[int], row: ScheduledRow) -> list[int]:
        """The drafts a device drafter proposes when the row asks for them: the model's token, but one
        position in three (by a hash of the history) one off, so rows are partially accepted."""
        drafts: list[int] = []
        for i in range(row.num_draft_tokens):
            token = self._row_token([*context, *drafts], row, row.sample_index + i)
            if blake2b(array("q", [*context, *drafts, 7]).tobytes(), digest_size=1).digest()[0] % 3 == 0:
                token = (token + 1) % self.vocab_size
            drafts.append(token)
        return drafts

    def _note_verify(self, row: ScheduledRow, output: RowOutput) -> None:
        """After a verify row, the request's next row must keep exactly the pages of accepted positions."""
        if row.num_draft_tokens:
            computed = row.end_position + len(output.sampled_token_ids) - 1
            self._rolled_back[row.request_id] = -(-computed // self.page_size)


def _fake_logprob(token: int) -> TokenLogprob:
    logprob = -float(token % 7) / 2.0
    return TokenLogprob(token_id=token, logprob=logprob, rank=1, top=[(token, logprob)])
