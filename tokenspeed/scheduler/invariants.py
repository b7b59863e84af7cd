"""The scheduler's invariants: queues, request states and page ownership agree.

Checked between steps by the tests and the model checkers (`Scheduler.check_invariants`);
kept apart from the scheduler because it only reads its state. Page books of every tier
are `KVCache.check_invariants`; this adds what only the scheduler knows: which request
holds which table, and in which queue and state each request is.
"""

from __future__ import annotations

from tokenspeed.kvcache import BlockTable, KVCache
from tokenspeed.scheduler.fsm import Decoding, Prefilling, Retracted, Waiting
from tokenspeed.scheduler.plan import PLACEHOLDER_TOKEN_ID
from tokenspeed.scheduler.request import Request


def check_scheduler_invariants(
    kv: KVCache,
    running: list[Request],
    waiting: list[Request],
    retracted: list[Request],
    streams: dict[str, Request],
    *,
    between_steps: bool,
    provisional: bool,
) -> None:
    """Raise AssertionError unless the queues, states and page ownership agree.

    `between_steps`: no plan is in flight (then a request holds exactly the pages of its
    computed tokens); `provisional`: a step was advanced on placeholders (overlap).
    """
    kv.check_invariants()
    owned: list[BlockTable] = []
    for request in running:
        state = request.state
        assert isinstance(state, (Prefilling, Decoding)), f"{request.request_id} runs in {state}"
        owned.append(state.table)
        if isinstance(state, Decoding):
            assert request.num_uncomputed_tokens == 1, f"{request.request_id} decodes with more to compute"
        else:
            assert request.num_uncomputed_tokens >= 1, f"{request.request_id} prefills with nothing left"
        assert len(state.table) >= kv.pages_for(request.num_computed_tokens), "computed KV has no page"
        if between_steps:  # between steps a request holds the pages of its computed tokens only
            assert len(state.table) == kv.pages_for(request.num_computed_tokens), (
                f"{request.request_id} holds {len(state.table)} pages for {request.num_computed_tokens} "
                "computed tokens (pages of rejected drafts not rolled back?)"
            )
    for request in running + waiting + retracted:
        outputs = request.output_token_ids
        holes = [i for i, t in enumerate(outputs) if t == PLACEHOLDER_TOKEN_ID]
        assert holes in ([], [len(outputs) - 1]), f"{request.request_id} has placeholders at {holes}"
        assert not holes or provisional, f"{request.request_id} keeps a resolved placeholder"
        assert not holes or request.num_uncomputed_tokens >= 1, f"{request.request_id} computed a placeholder"
    for request in waiting:
        assert isinstance(request.state, Waiting), f"{request.request_id} queued in {request.state}"
        assert request.num_computed_tokens == 0, f"waiting {request.request_id} claims computed tokens"
    for request in retracted:
        state = request.state
        assert isinstance(state, Retracted), f"{request.request_id} retracted in {state}"
        state.retraction.ensure_live()
        assert request.num_computed_tokens == 0, f"retracted {request.request_id} claims computed tokens"
        assert state.retraction.num_computed_tokens < request.num_tokens, "a retraction saved an uncomputed token"
    queued = running + waiting + retracted
    assert len({id(r) for r in queued}) == len(queued) == len(streams), "a request is lost or queued twice"
    assert all(streams.get(r.request_id) is r for r in queued), "queues and request ids disagree"
    for queue in (running, waiting, retracted):
        keys = [r.arrival for r in queue]
        assert keys == sorted(keys), "a queue is out of arrival order"
    holders = {id(t) for t in kv.pool.live_holders()}
    assert holders == {id(t) for t in owned}, (
        f"{len(holders)} live BlockTables but running requests own {len(owned)}: a handle leaked"
    )
