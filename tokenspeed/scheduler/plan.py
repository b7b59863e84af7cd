"""The contract between the scheduler and the executor.

`ExecutionPlan` is everything the executor needs to run one step: it never
calls back into the scheduler. `ExecutionResult` is everything the scheduler
needs to advance its requests. Both are plain records (no torch) so they can
later cross a process boundary to tensor-parallel workers unchanged.

Plans are incremental: the executor keeps each running request's page table
from step to step, a row carries only the pages its request gained since its
previous row, and the plan names the requests whose tables the executor must
drop (finished, aborted or preempted). A row carries the request's token
history only when the executor reads it (penalties, prompt logprobs). Host
work per step is then proportional to what changed, not to the context length
(`benchmarks/scheduler_overhead.py`). The executor applies a plan's drops
before its rows, and plans in the order they were made.

Within a step, the K/V of every row is stored before any row attends, so a
row may read pages an earlier row of the same plan writes (prefix-cache hits
on pages published when that earlier row was scheduled).

Speculative decoding: a decode row may carry k draft tokens. Its K/V is
written for its input token and the k drafts, at positions p .. p+k, and its
pages cover all of them; the executor verifies the drafts (`spec/verify.py`)
and returns the emitted tokens: the accepted drafts, then the model's own
token at the first rejected position (or the bonus token after the last
draft), 1 .. k+1 in all. Host drafts (n-gram, suffix) come in
`draft_token_ids`; a row with `num_draft_tokens > 0` and no `draft_token_ids`
asks the executor's own drafter (EAGLE, MTP, a draft model) for k drafts.
After the scheduler applies the result it frees the pages that held only
rejected positions: the next row of that request then has a `first_new_page`
below the number of pages the executor holds, and the executor cuts the
table there before adding `new_page_ids` (the K/V of rejected positions in a
kept page is stale and is rewritten before anything reads it: rows attend
only to positions below their own, and those are all accepted).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenspeed.kvcache import CopyOp, KVLayout
from tokenspeed.scheduler.sampling_params import SamplingParams

# A sampled id that is not known yet (overlap scheduling, see `scheduler/provisional.py`).
# As a row's input it means "the token this stream sampled in the previous step", which
# the executor reads where that step left it (on the device), never from the host.
PLACEHOLDER_TOKEN_ID = -1


@dataclass(slots=True)
class ScheduledRow:
    """One request's slice of a step: some new tokens, and maybe a sample at the end.

    A prefill chunk has many input tokens; a decode row has one. The row's K/V
    for `input_token_ids` are written at positions `start_position ...` into the
    request's pages, which cover every position up to `end_position`: the
    executor's table for the request, cut to `first_new_page` pages (shorter
    than the executor's only after rejected drafts were rolled back) and then
    extended by `new_page_ids`. `first_new_page == 0` starts a fresh table
    (first admission, or re-admission after preemption).

    A verify row (`num_draft_tokens = k > 0`, decode rows only) also writes
    K/V at positions `end_position .. end_position + k - 1` for its drafts
    and samples at each of its k+1 positions, keyed by `sample_index + i`
    (see the module docstring).
    """

    request_id: str
    input_token_ids: list[int]
    start_position: int
    first_new_page: int
    new_page_ids: list[int]
    sampling: SamplingParams
    # Sample after the last input token? False for all but the last prompt chunk.
    sample: bool
    # The request's seed: with `sample_index` it keys the random draw.
    seed: int
    # Output tokens generated so far; with the seed it keys the random draw, so a
    # request's tokens do not depend on batch composition or preemption.
    sample_index: int
    # First prompt position whose logprob must be returned (None: not wanted).
    # Position p's logprob is that of prompt_token_ids[p + 1] given tokens 0..p.
    prompt_logprobs_start: int | None = None
    # The request's token history (references, not copies), only on rows whose executor work
    # reads it: penalties (prompt and output) and prompt logprobs (the prompt). None otherwise,
    # so a plan's size does not grow with the context when it crosses a process boundary.
    prompt_token_ids: list[int] | None = None
    output_token_ids: list[int] | None = None
    # Drafts to verify after the input token: k of them, or none when the executor drafts them.
    num_draft_tokens: int = 0
    draft_token_ids: list[int] = field(default_factory=list)  # host drafts (n-gram, suffix), else empty

    @property
    def num_pages(self) -> int:
        """Length of the request's page table once this row's pages are added."""
        return self.first_new_page + len(self.new_page_ids)

    @property
    def num_samples(self) -> int:
        """Samples the row asks for: one, or up to k+1 for a verify row (`max_samples`)."""
        return 1 if self.sample else 0

    @property
    def max_samples(self) -> int:
        return self.num_samples + self.num_draft_tokens

    @property
    def end_position(self) -> int:
        """End of the input tokens (drafts are not inputs: they are computed only if accepted)."""
        return self.start_position + len(self.input_token_ids)

    @property
    def kv_end_position(self) -> int:
        """End of the positions whose K/V the row writes: its inputs and its drafts."""
        return self.end_position + self.num_draft_tokens

    @property
    def num_scheduled_tokens(self) -> int:
        """Tokens the row adds to the step's forward pass (inputs and drafts)."""
        return len(self.input_token_ids) + self.num_draft_tokens


@dataclass(slots=True)
class GrammarMasks:
    """The tokens each grammar-constrained sample of a step may take (structured output), as bitmasks.

    Entry i is the sample `positions[i] = (plan row, sample position)` (position 0: the row's sample;
    a verify row's positions 0..k: its k+1 samples, each masked by the grammar state after the drafts
    before it) and owns words `[i * num_words, (i + 1) * num_words)` of `bits`, little-endian int32:
    bit b of word w allows token `32 * w + b`. Samples without an entry are unconstrained. Plain bytes,
    no torch, so a plan still crosses a process boundary as it is; the engine core fills it in
    (`grammar/`), the executor applies it before the draw (`executor/logits_processors.py`).
    """

    positions: list[tuple[int, int]]
    num_words: int
    bits: bytes


@dataclass(slots=True)
class ExecutionPlan:
    step_id: int
    rows: list[ScheduledRow] = field(default_factory=list)
    # Requests whose page tables the executor drops before running the rows.
    released_request_ids: list[str] = field(default_factory=list)
    # Allowed-token masks of the grammar-constrained samples, set by the engine core (None: no grammar).
    grammar_masks: GrammarMasks | None = None
    # KV copies between tiers (kvcache/copy_ops.py), run before the rows (device -> host ones read pages
    # as earlier steps left them; rows of this plan read the host -> device ones); they never conflict.
    # The executor confirms each in `ExecutionResult.completed_copies`, now or with a later step.
    copies: list[CopyOp] = field(default_factory=list)
    # Nothing else can run until a copy in flight lands: the executor waits for all of them.
    wait_for_copies: bool = False

    @property
    def num_tokens(self) -> int:
        return sum(r.num_scheduled_tokens for r in self.rows)

    @property
    def has_drafts(self) -> bool:
        """Rows to verify: their results (how many tokens were accepted) must be advanced, never
        placeholders (`scheduler/provisional.py`)."""
        return any(r.num_draft_tokens for r in self.rows)

    def is_empty(self) -> bool:
        """Nothing for the executor to do (no rows, no copies to run or wait for)."""
        return not self.rows and not self.copies and not self.wait_for_copies


@dataclass(slots=True)
class TokenLogprob:
    """Log-probability of one chosen token, its rank, and the top alternatives."""

    token_id: int
    logprob: float
    rank: int  # 1 = most likely
    top: list[tuple[int, float]]  # (token id, logprob), most likely first


@dataclass(slots=True)
class RowOutput:
    request_id: str
    # One when row.sample; for a verify row 1 .. k+1: the accepted drafts, then the model's token.
    sampled_token_ids: list[int] = field(default_factory=list)
    logprobs: list[TokenLogprob] | None = None  # one per sampled token, when requested
    prompt_logprobs: list[TokenLogprob] | None = None  # positions prompt_logprobs_start.. in this chunk


@dataclass(slots=True)
class ExecutionResult:
    step_id: int
    rows: list[RowOutput] = field(default_factory=list)  # aligned with ExecutionPlan.rows
    # (copy op id, ok) of the tier copies that finished since the last result (ok=False: a disk file
    # failed to write or verify, a miss); any plan's copies, in any order.
    completed_copies: list[tuple[int, bool]] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class ExecutorLimits:
    """What an executor can run, known once it is built: the engine core sizes its scheduler from
    these and the front ends check requests against them."""

    vocab_size: int
    max_model_len: int
    num_pages: int  # KV pages the scheduler may hand out
    page_size: int
    device: str = "cpu"
    dtype: str = "float32"
    kv_layout: KVLayout | None = None  # what a KV page's bytes are (None: not real bytes, e.g. simulated)
    host_kv_cache_bytes: int = 0  # the host tier the executor allocated (whole slots of kv_layout pages)
