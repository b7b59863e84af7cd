"""`check_admission`: the one admission rule every front end and the scheduler apply."""

from __future__ import annotations

import dataclasses

import pytest

from tokenspeed.errors import ContextTooLong, InvalidRequest
from tokenspeed.scheduler import SamplingParams, Scheduler, SchedulerConfig
from tokenspeed.scheduler.admission import AdmissionLimits, check_admission, pages_needed

LIMITS = AdmissionLimits(max_model_len=64, max_num_seqs=4, page_size=16, num_kv_pages=6, vocab_size=100)


@pytest.mark.parametrize(
    ("prompt", "params", "error", "words"),
    [
        ([], SamplingParams(), InvalidRequest, "empty"),
        (list(range(64)), SamplingParams(), ContextTooLong, "max_model_len is 64"),
        ([1, 100], SamplingParams(), InvalidRequest, r"Prompt token ids .*\[0, 100\)"),
        ([1, 2], SamplingParams(stop_token_ids=[100]), InvalidRequest, r"stop_token_ids .*\[0, 100\).*100"),
        ([1, 2], SamplingParams(n=5), InvalidRequest, "n=5 exceeds max_num_seqs=4"),
        # Refused, not clamped: 60 + 16 > 64.
        (list(range(60)), SamplingParams(max_tokens=16), ContextTooLong, "ask for at most 4 new tokens"),
    ],
)
def test_refusals(prompt, params, error, words):
    with pytest.raises(error, match=words):
        check_admission(prompt, params, LIMITS)
    small_pool = dataclasses.replace(LIMITS, num_kv_pages=3)
    with pytest.raises(ContextTooLong, match="A 60-token prompt needs 4 KV pages; the engine has 3"):
        check_admission(list(range(60)), SamplingParams(n=4, max_tokens=2), small_pool)


def test_fitting_request_passes_and_pages_are_counted():
    check_admission([1] * 63, SamplingParams(n=1, max_tokens=1, stop_token_ids=[99]), LIMITS)
    # n > 1 is fanned out (engine/fan_out.py): each child needs the prompt's pages, no more.
    check_admission(list(range(60)), SamplingParams(n=4, max_tokens=2), LIMITS)
    assert pages_needed(16, 16) == 1 and pages_needed(17, 16) == 2


def test_scheduler_applies_the_same_rule_with_the_vocabulary():
    config = SchedulerConfig(max_num_seqs=2, max_num_batched_tokens=32, max_model_len=32, page_size=4,
                             num_pages=16, vocab_size=50)
    scheduler = Scheduler(config)
    with pytest.raises(InvalidRequest, match="stop_token_ids"):
        scheduler.submit("a", [1, 2], SamplingParams(stop_token_ids=[50]))
    with pytest.raises(InvalidRequest, match="Prompt token ids"):
        scheduler.submit("a", [50], SamplingParams())
    scheduler.submit("a", [1, 2], SamplingParams(stop_token_ids=[49]))
    assert scheduler.num_waiting == 1


def test_the_scheduler_clamps_where_front_ends_refuse():
    lenient = dataclasses.replace(LIMITS, refuse_overlong_max_tokens=False)
    check_admission(list(range(60)), SamplingParams(max_tokens=16), lenient)
