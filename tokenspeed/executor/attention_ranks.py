"""`AttentionRanks`: which data-parallel attention rank holds each request (DP attention), torch-free.

Under DP attention (`enable_dp_attention`) every rank runs attention only over
the rows of its own requests, against its own KV pool; the MLP/MoE between
attention layers sees every rank's tokens (the compiled plan's all-gather and
reduce-scatter). The scheduler stays one: it plans the whole batch and hands
the same plan to every rank, and every rank runs these rules on it, so all
ranks agree on every split without exchanging a byte. The rules:

- whole requests per rank: a request's rows all go to one rank;
- sticky: once placed, a request stays on its rank until the plan releases it
  (finished, aborted or preempted), because its latent KV lives only there;
- prefix-cache hits follow the pages: a fresh request whose first positions are
  cached (its row starts past position 0) goes to the rank that wrote those
  pages. By induction every page a request reads was written on its rank: the
  request that extended a cached prefix sat where the prefix did;
- otherwise balance by tokens: the rank whose requests hold the fewest tokens
  (ties: the lowest rank), updated row by row so one plan's new requests
  spread out;
- deterministic: the same sequence of plans gives the same placement on every
  rank (dict order and ties are fixed).

Page homes: a page belongs to the rank of the last request that gained it
(`new_page_ids`); the scheduler hands a page to one request at a time, so the
last one to gain it is the one whose K/V it holds.

Known limit: every rank still sizes a whole KV pool over the scheduler's page
ids (the scheduler does not know ranks), so DP attention brings no KV capacity
gain yet, only the attention compute and KV bandwidth split.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenspeed.scheduler.plan import ExecutionPlan, ScheduledRow


class PlacementConflict(RuntimeError):
    """A plan row cannot go to one rank (its cached pages sit on several, or none): the KV is not where it
    is read, so running on would give wrong tokens."""


@dataclass(slots=True)
class RankShare:
    """One rank's part of a step: plan row indices (in plan order) and the requests it releases."""

    rows: list[int] = field(default_factory=list)
    released: list[str] = field(default_factory=list)
    num_tokens: int = 0  # tokens the rank's rows add to the step (inputs and drafts)


class AttentionRanks:
    """The placement state of one engine's DP-attention ranks (see the module docstring)."""

    def __init__(self, num_ranks: int, page_size: int) -> None:
        if num_ranks < 1 or page_size < 1:
            raise ValueError(f"num_ranks and page_size must be >= 1, got {num_ranks}, {page_size}")
        self.num_ranks = num_ranks
        self.page_size = page_size
        self._rank_of: dict[str, int] = {}
        self._tokens_of: dict[str, int] = {}  # KV positions each placed request covers
        self._load = [0] * num_ranks  # tokens held by each rank's requests
        self._page_home: dict[int, int] = {}
        self.steps_with_idle_rank = 0  # steps with rows where some rank had none (observability, tests)
        self.placements = [0] * num_ranks  # fresh placements (admissions, resumptions) per rank

    def rank_of(self, request_id: str) -> int | None:
        return self._rank_of.get(request_id)

    @property
    def load(self) -> tuple[int, ...]:
        return tuple(self._load)

    def split(self, plan: ExecutionPlan) -> list[RankShare]:
        """Each rank's share of `plan`, placing its new requests; call once per plan, in plan order."""
        shares = [RankShare() for _ in range(self.num_ranks)]
        for request_id in plan.released_request_ids:
            rank = self._rank_of.pop(request_id, None)
            if rank is None:
                raise PlacementConflict(f"plan {plan.step_id} releases {request_id!r}, which no rank holds")
            self._load[rank] -= self._tokens_of.pop(request_id)
            shares[rank].released.append(request_id)
        for index, row in enumerate(plan.rows):
            rank = self._place(plan.step_id, row)
            for page in row.new_page_ids:
                self._page_home[page] = rank
            tokens = row.kv_end_position
            self._load[rank] += tokens - self._tokens_of.get(row.request_id, 0)
            self._tokens_of[row.request_id] = tokens
            shares[rank].rows.append(index)
            shares[rank].num_tokens += row.num_scheduled_tokens
        if plan.rows and any(not share.rows for share in shares):
            self.steps_with_idle_rank += 1
        return shares

    def _place(self, step_id: int, row: ScheduledRow) -> int:
        placed = self._rank_of.get(row.request_id)
        if row.first_new_page > 0:
            if placed is None:
                raise PlacementConflict(f"plan {step_id}: {row.request_id!r} continues but was never placed")
            return placed
        if placed is not None:
            raise PlacementConflict(f"plan {step_id}: {row.request_id!r} starts afresh without being released")
        rank = self._home_of_cached(step_id, row)
        if rank is None:
            rank = min(range(self.num_ranks), key=lambda r: (self._load[r], r))
        self._rank_of[row.request_id] = rank
        self.placements[rank] += 1
        return rank

    def _home_of_cached(self, step_id: int, row: ScheduledRow) -> int | None:
        """The rank holding the pages of a fresh row's cached prefix (None: nothing cached)."""
        cached_pages = -(-row.start_position // self.page_size)
        homes = {self._page_home.get(page) for page in row.new_page_ids[:cached_pages]}
        if not homes:
            return None
        if len(homes) > 1 or None in homes:
            raise PlacementConflict(
                f"plan {step_id}: {row.request_id!r} reads cached pages held by ranks {sorted(map(str, homes))}; "
                "DP attention needs a request's whole prefix on one rank"
            )
        (home,) = homes
        assert home is not None
        return home
