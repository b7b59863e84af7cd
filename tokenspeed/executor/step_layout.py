"""Where each plan row's tokens and logits go in one step's flat batch.

Every row's input tokens are concatenated along one token axis. Logits are
computed only where they are read: the prompt positions whose logprobs were
asked for, the last token of a sampling row, and every position of a verify
row (a decode row carrying k drafts: tokens `[last, d1 .. dk]` at positions
p .. p+k, whose k+1 logits score d1 .. dk and the token after dk). Host drafts
(n-gram, suffix) are in the plan; a device drafter's are written into the
batch on the device, so the layout holds a 0 in their place.

Pure index arithmetic on the host, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenspeed.scheduler.plan import ExecutionPlan, ScheduledRow


@dataclass(slots=True)
class PromptLogprobSlice:
    """Logits rows [first, first + count) score prompt positions start.. of one plan row."""

    row: int
    first: int
    count: int
    start_position: int


def prompt_logprob_positions(row: ScheduledRow) -> range:
    """Prompt positions of this chunk whose next-token logprob is wanted."""
    if row.prompt_logprobs_start is None:
        return range(0)
    assert row.prompt_token_ids is not None, "a row that wants prompt logprobs carries its prompt"
    last_scored = len(row.prompt_token_ids) - 1  # the last prompt token has no prompt successor
    return range(max(row.start_position, row.prompt_logprobs_start), min(row.end_position, last_scored))


@dataclass(slots=True)
class StepLayout:
    tokens: list[list[int]] = field(default_factory=list)  # per plan row: its tokens in the batch
    padding: list[int] = field(default_factory=list)  # per plan row: filler tokens before them (`pad_to`)
    row_starts: list[int] = field(default_factory=list)  # per plan row: flat index of its first real token
    logits_indices: list[int] = field(default_factory=list)
    prompt_slices: list[PromptLogprobSlice] = field(default_factory=list)
    sample_slots: list[tuple[int, int]] = field(default_factory=list)  # (plan row, logits row), one draw each
    verify_rows: list[int] = field(default_factory=list)  # plan rows with drafts
    verify_logits_starts: list[int] = field(default_factory=list)  # first of each verify row's k+1 logits
    device_drafted: list[int] = field(default_factory=list)  # positions in verify_rows the drafter fills

    @property
    def num_tokens(self) -> int:
        return sum(len(t) for t in self.tokens)



def logits_rows(row: ScheduledRow) -> int:
    """Logits rows `lay_out` gives `row`: its scored prompt positions, then k+1 (verify) or its one sample."""
    scored = len(prompt_logprob_positions(row))
    if row.num_draft_tokens:
        return scored + row.num_draft_tokens + 1
    return scored + (1 if row.sample else 0)


def verify_graph_query_len(plan: ExecutionPlan, query_len: int) -> bool:
    """Whether every row fits a verify batch of `query_len` tokens a row: decode rows (some with
    drafts) of at most `query_len` tokens, no prompt logprobs."""
    return plan.has_drafts and all(
        len(r.input_token_ids) == 1 and r.sample and r.num_draft_tokens < query_len and r.prompt_logprobs_start is None
        for r in plan.rows
    )


def lay_out(plan: ExecutionPlan, pad_to: int = 0) -> StepLayout:
    """The step's layout; `pad_to` > 0 gives every row that many tokens, filler first (CUDA-graph
    verify batches: see `batch_builder.RowSpec.padding`)."""
    layout = StepLayout()
    flat = 0
    for i, row in enumerate(plan.rows):
        k = row.num_draft_tokens
        tokens = list(row.input_token_ids)
        if k:
            if len(tokens) != 1 or not row.sample:
                raise ValueError(f"row {row.request_id!r} carries drafts but is not a decode row")
            if row.draft_token_ids and len(row.draft_token_ids) != k:
                raise ValueError(f"row {row.request_id!r} carries {len(row.draft_token_ids)} drafts, says {k}")
            tokens.extend(row.draft_token_ids or [0] * k)
        filler = max(0, pad_to - len(tokens))
        flat += filler
        layout.padding.append(filler)
        layout.tokens.append([0] * filler + tokens)
        layout.row_starts.append(flat)
        positions = prompt_logprob_positions(row)
        if positions:
            logits_start = len(layout.logits_indices)
            layout.prompt_slices.append(PromptLogprobSlice(i, logits_start, len(positions), positions.start))
            layout.logits_indices.extend(flat + p - row.start_position for p in positions)
        if k:
            if not row.draft_token_ids:
                layout.device_drafted.append(len(layout.verify_rows))
            layout.verify_rows.append(i)
            layout.verify_logits_starts.append(len(layout.logits_indices))
            layout.logits_indices.extend(range(flat, flat + k + 1))
        elif row.sample:
            layout.sample_slots.append((i, len(layout.logits_indices)))
            layout.logits_indices.append(flat + len(tokens) - 1)
        flat += len(tokens)
    return layout
