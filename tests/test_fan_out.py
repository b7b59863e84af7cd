"""`n > 1` as fan-out in the front end: child requests, regrouping, finishing, cached-token counts."""

from __future__ import annotations

import pytest

from tokenspeed import LLM, SamplingParams
from tokenspeed.engine.fan_out import fan_out
from tokenspeed.engine.output_processor import OutputProcessor
from tokenspeed.errors import InvalidRequest
from tokenspeed.scheduler import RequestUpdate


def test_children_have_derived_ids_consecutive_seeds_and_one_sample_each() -> None:
    params = SamplingParams(n=3, seed=40, prompt_logprobs=2, temperature=0.7)
    children = fan_out("req", params)
    assert [(c.request_id, c.index) for c in children] == [("req#0", 0), ("req#1", 1), ("req#2", 2)]
    assert [c.params.seed for c in children] == [40, 41, 42] and all(c.params.n == 1 for c in children)
    assert [c.params.prompt_logprobs for c in children] == [2, None, None]  # the parent's, once
    assert all(c.params.temperature == 0.7 for c in children)
    assert [c.params.seed for c in fan_out("u", SamplingParams(n=2))] == [None, None]  # drawn by the core
    (single,) = fan_out("solo", SamplingParams(seed=5))
    assert (single.request_id, single.index, single.params.seed) == ("solo", 0, 5)


def test_the_parent_finishes_when_every_child_has_and_reports_child_0s_cache_hit() -> None:
    processor = OutputProcessor(None, lambda *args: None)
    processor.add_request("p", None, [1, 2, 3], SamplingParams(n=2, detokenize=False))
    assert processor.core_request_ids("p") == ["p#0", "p#1"] and processor.parent_of("p#1") == "p"
    first = processor.process(
        [
            RequestUpdate("p#0", [7], finished=True, finish_reason="length", num_cached_tokens=0),
            RequestUpdate("p#1", [8], num_cached_tokens=2),  # hit the pages p#0 computes
        ]
    )
    assert first == []  # p#1 still runs
    (done,) = processor.process([RequestUpdate("p#1", [9], finished=True, finish_reason="length")])
    assert [(c.index, c.token_ids) for c in done.outputs] == [(0, [7]), (1, [8, 9])]
    assert done.num_cached_tokens == 0
    assert not processor.has_request("p") and processor.parent_of("p#0") is None
    assert processor.process([RequestUpdate("p#1", [5])]) == []  # late updates of a finished request


def test_child_ids_may_not_collide_with_live_ones() -> None:
    processor = OutputProcessor(None, lambda *args: None)
    processor.add_request("a#1", None, [1], SamplingParams())
    with pytest.raises(InvalidRequest, match="collides"):
        processor.add_request("a", None, [1], SamplingParams(n=2))
    assert not processor.has_request("a")
    processor.abort("a#1")
    assert processor.add_request("a", None, [1], SamplingParams(n=2))[1].request_id == "a#1"


def test_llm_children_share_a_warm_prefix_and_report_the_parents_hit() -> None:
    llm = LLM(page_size=16, max_model_len=512, show_progress=False)
    prompt = {"prompt_token_ids": list(range(100, 180))}  # 5 full pages
    cold = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True))[0]
    assert cold.num_cached_tokens == 0  # child 0's: the cache was empty; children 1, 2 hit its pages
    warm = llm.generate(prompt, SamplingParams(n=3, temperature=1.0, seed=1, max_tokens=4, ignore_eos=True))[0]
    assert warm.num_cached_tokens == 64  # (80 - 1) // 16 pages: the last token always runs
    assert [c.token_ids for c in warm.outputs] == [c.token_ids for c in cold.outputs]
    with pytest.raises(InvalidRequest, match="n=300 exceeds max_num_seqs=256"):
        llm.generate(prompt, SamplingParams(n=300))
    assert not llm.core.has_unfinished()
