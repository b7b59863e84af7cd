"""One rank's part of a DP-attention step: its sub-plan, its row counts, and where its logits go back.

`AttentionRanks.split` says which plan rows each rank runs (the same answer on
every rank). From it each rank derives, with no communication:

- its local plan: its own rows (in plan order) and the releases of its own
  requests, which its page tables and KV then see as if it ran alone;
- the token counts of the body's gathers: its own tokens, padded to the
  largest rank's (a rank with no rows runs one filler token on the scratch
  page, so it still joins every collective with a well-formed batch);
- the logits rows likewise, and `logits_order`: for each logits row of the
  whole plan's layout (`step_layout.lay_out`), its row in the rank-major
  gathered logits. Indexing the gathered logits with it restores the
  scheduler's order, so sampling, logprobs and the next step's placeholder
  tokens run on the whole plan exactly as on one device.

Pure index arithmetic, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenspeed.executor.attention_ranks import RankShare
from tokenspeed.executor.step_layout import logits_rows
from tokenspeed.scheduler.plan import ExecutionPlan

IDLE_RANK_TOKENS = 1  # filler tokens a rank with no rows runs (scratch page) to join the step's collectives


@dataclass(frozen=True, slots=True)
class DPStep:
    local: ExecutionPlan
    num_tokens: int  # tokens this rank's batch holds (IDLE_RANK_TOKENS when it has no rows)
    padded_tokens: int  # the largest rank's
    num_logits: int
    padded_logits: int
    logits_order: list[int]  # gathered logits row of each logits row of the whole plan

    @property
    def idle(self) -> bool:
        return not self.local.rows


def dp_step(plan: ExecutionPlan, shares: list[RankShare], rank: int) -> DPStep:
    """Rank `rank`'s part of `plan`, given every rank's share (see the module docstring)."""
    counts = [logits_rows(row) for row in plan.rows]
    per_rank_logits = [sum(counts[i] for i in share.rows) for share in shares]
    padded_logits = max(per_rank_logits, default=0)
    first_logits: dict[int, int] = {}  # plan row -> its first row in the gathered logits
    for r, share in enumerate(shares):
        offset = r * padded_logits
        for i in share.rows:
            first_logits[i] = offset
            offset += counts[i]
    order = [first_logits[i] + j for i, count in enumerate(counts) for j in range(count)]
    mine = shares[rank]
    local = ExecutionPlan(
        step_id=plan.step_id,
        rows=[plan.rows[i] for i in mine.rows],
        released_request_ids=list(mine.released),
    )
    tokens = [share.num_tokens or IDLE_RANK_TOKENS for share in shares]
    return DPStep(
        local=local,
        num_tokens=tokens[rank],
        padded_tokens=max(tokens),
        num_logits=per_rank_logits[rank],
        padded_logits=padded_logits,
        logits_order=order,
    )
