"""DP attention's placement rules (`executor/attention_ranks.py`) and each rank's step (`dp_attention_step.py`).

Torch-free and fast: plans are built by hand. Balance by tokens, stickiness
until release, prefix hits following their pages, idle ranks, determinism,
and the logits order that puts every rank's gathered rows back in plan order.
"""

from __future__ import annotations

import pytest

from tokenspeed.executor.attention_ranks import AttentionRanks, PlacementConflict
from tokenspeed.executor.dp_attention_step import IDLE_RANK_TOKENS, dp_step
from tokenspeed.executor.step_layout import lay_out, logits_rows
from tokenspeed.scheduler.plan import ExecutionPlan, ScheduledRow
from tokenspeed.scheduler.sampling_params import SamplingParams

PAGE = 4


def row(
    request_id: str, tokens: int, *, start: int = 0, first_page: int = 0, pages: list[int] | None = None,
    sample: bool = True, prompt_logprobs: bool = False,
) -> ScheduledRow:
    end = start + tokens
    if pages is None:
        pages = list(range(first_page, -(-end // PAGE)))
    prompt = list(range(end + 5)) if prompt_logprobs else None
    return ScheduledRow(
        request_id=request_id,
        input_token_ids=[3] * tokens,
        start_position=start,
        first_new_page=first_page,
        new_page_ids=pages,
        sampling=SamplingParams(temperature=0.0, prompt_logprobs=1 if prompt_logprobs else None),
        sample=sample,
        seed=0,
        sample_index=0,
        prompt_logprobs_start=0 if prompt_logprobs else None,
        prompt_token_ids=prompt,
    )


def plan(step: int, *rows: ScheduledRow, released: tuple[str, ...] = ()) -> ExecutionPlan:
    return ExecutionPlan(step_id=step, rows=list(rows), released_request_ids=list(released))


def test_new_requests_go_to_the_rank_holding_fewest_tokens():
    ranks = AttentionRanks(2, PAGE)
    shares = ranks.split(plan(0, row("a", 20, pages=[0, 1, 2, 3, 4]), row("b", 4, pages=[5]),
                              row("c", 8, pages=[6, 7]), row("d", 8, pages=[8, 9])))
    # a -> 0 (tie: lowest rank); b -> 1; c -> 1 (4 < 20); d -> 1 (12 < 20)
    assert [s.rows for s in shares] == [[0], [1, 2, 3]]
    assert ranks.load == (20, 20)
    assert [s.num_tokens for s in shares] == [20, 20]


def test_a_request_stays_on_its_rank_until_released():
    ranks = AttentionRanks(2, PAGE)
    ranks.split(plan(0, row("a", 8, pages=[0, 1]), row("b", 2, pages=[2])))
    assert (ranks.rank_of("a"), ranks.rank_of("b")) == (0, 1)
    for step in range(1, 4):  # each keeps its rank, whatever the load, while it decodes
        shares = ranks.split(plan(step, row("b", 1, start=1 + step, first_page=1, pages=[]),
                                  row("a", 1, start=7 + step, first_page=2 + step, pages=[10 + step])))
        assert [s.rows for s in shares] == [[1], [0]]
    shares = ranks.split(plan(4, row("c", 2, pages=[20]), released=("a",)))
    assert shares[0].released == ["a"] and ranks.rank_of("a") is None
    assert ranks.rank_of("c") == 0  # rank 0 emptied by the release
    with pytest.raises(PlacementConflict, match="never placed"):
        ranks.split(plan(5, row("zz", 1, start=4, first_page=1, pages=[])))


def test_a_prefix_hit_follows_the_rank_that_wrote_its_pages():
    ranks = AttentionRanks(2, PAGE)
    ranks.split(plan(0, row("a", 8, pages=[0, 1]), row("b", 8, pages=[2, 3])))
    assert ranks.rank_of("b") == 1
    # c hits b's first page (positions 0..3 cached), and rank 0 holds fewer tokens after a's release
    ranks.split(plan(1, released=("a",)))
    ranks.split(plan(2, row("c", 5, start=4, pages=[2, 7])))
    assert ranks.rank_of("c") == 1
    # a preempted request resumes on the rank that holds its published prefix
    ranks.split(plan(3, released=("b",)))
    ranks.split(plan(4, row("b", 4, start=4, pages=[2, 3])))
    assert ranks.rank_of("b") == 1


def test_a_prefix_hit_on_a_page_written_earlier_in_the_same_plan():
    ranks = AttentionRanks(2, PAGE)
    ranks.split(plan(0, row("x", 12, pages=[5, 6, 7])))  # rank 0 is loaded
    shares = ranks.split(plan(1, row("a", 8, pages=[0, 1]), row("b", 2, start=4, pages=[0, 2])))
    assert ranks.rank_of("a") == 1 and ranks.rank_of("b") == 1
    assert shares[1].rows == [0, 1]


def test_cached_pages_on_two_ranks_are_refused():
    ranks = AttentionRanks(2, PAGE)
    ranks.split(plan(0, row("a", 4, pages=[0]), row("b", 4, pages=[1])))
    with pytest.raises(PlacementConflict, match="on one rank"):
        ranks.split(plan(1, row("c", 1, start=8, pages=[0, 1, 2])))
    with pytest.raises(PlacementConflict, match="on one rank"):
        ranks.split(plan(2, row("d", 1, start=4, pages=[9, 3])))  # page 9 was never written


def test_an_idle_rank_still_gets_a_share_and_one_filler_token():
    ranks = AttentionRanks(2, PAGE)
    shares = ranks.split(plan(0, row("a", 6, pages=[0, 1])))
    assert [s.rows for s in shares] == [[0], []]
    assert ranks.steps_with_idle_rank == 1
    idle = dp_step(plan(0, row("a", 6, pages=[0, 1])), shares, 1)
    assert idle.idle and idle.num_tokens == IDLE_RANK_TOKENS and idle.padded_tokens == 6
    assert (idle.num_logits, idle.padded_logits, idle.logits_order) == (0, 1, [0])
    ranks.split(plan(1))  # an empty plan is not an idle step
    assert ranks.steps_with_idle_rank == 1


def test_placement_is_deterministic():
    def run() -> list[tuple[int | None, ...]]:
        ranks = AttentionRanks(3, PAGE)
        seen = []
        page = 0
        for step in range(6):
            rows = []
            for j in range(step % 3 + 1):
                n = 3 + (step * 7 + j * 5) % 11
                pages = list(range(page, page + -(-n // PAGE)))
                page += len(pages)
                rows.append(row(f"r{step}.{j}", n, pages=pages))
            ranks.split(plan(step, *rows))
            seen.append(tuple(ranks.rank_of(r.request_id) for r in rows))
        return seen

    first = run()
    assert first == run()
    assert {rank for step in first for rank in step} == {0, 1, 2}


def test_logits_order_restores_the_plans_layout():
    """Rank-major gathered logits, indexed by `logits_order`, are the whole plan's logits rows in order."""
    ranks = AttentionRanks(2, PAGE)
    p = plan(0, row("a", 6, pages=[0, 1], prompt_logprobs=True), row("b", 3, pages=[2]),
             row("c", 5, pages=[3, 4], sample=False), row("d", 2, pages=[5]))
    shares = ranks.split(p)
    steps = [dp_step(p, shares, r) for r in range(2)]
    padded = steps[0].padded_logits
    assert all(s.padded_logits == padded for s in steps)
    # the gathered tensor: each rank's logits rows, labelled (request, index within the row), padded
    gathered: list[tuple[str, int] | None] = []
    for s in steps:
        labels = [(r.request_id, j) for r in s.local.rows for j in range(logits_rows(r))]
        assert len(labels) == s.num_logits == len(lay_out(s.local).logits_indices)
        gathered += labels + [None] * (padded - len(labels))
    expected = [(r.request_id, j) for r in p.rows for j in range(logits_rows(r))]
    assert len(expected) == len(lay_out(p).logits_indices)
    assert [gathered[i] for i in steps[0].logits_order] == expected
    assert steps[0].logits_order == steps[1].logits_order
    assert sum(s.num_tokens for s in steps) == p.num_tokens
