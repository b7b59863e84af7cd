"""`speculative_config`: vLLM's names and defaults, and a clear InvalidRequest for every mistake."""

from __future__ import annotations

import re

import pytest

from tokenspeed.errors import InvalidRequest
from tokenspeed.spec import NgramDrafter, SpeculativeConfig, SuffixDrafter, parse_speculative_config


def test_valid_configurations_and_defaults() -> None:
    ngram = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4})
    assert ngram is not None and (ngram.prompt_lookup_min, ngram.prompt_lookup_max) == (5, 5)
    assert (parse_speculative_config({"method": "ngram", "num_speculative_tokens": 4, "prompt_lookup_max": 3})
            == SpeculativeConfig("ngram", 4, prompt_lookup_min=3, prompt_lookup_max=3))
    low = parse_speculative_config({"method": "ngram", "num_speculative_tokens": 2, "prompt_lookup_min": 2})
    assert low is not None and (low.prompt_lookup_min, low.prompt_lookup_max) == (2, 2)
    drafter = ngram.make_drafter()
    assert isinstance(drafter, NgramDrafter) and (drafter.min_n, drafter.max_n) == (5, 5)
    suffix = parse_speculative_config('{"method": "suffix", "suffix_decoding_max_tree_depth": 16}')
    assert suffix is not None and suffix.num_speculative_tokens == 16
    suffix_drafter = suffix.make_drafter()
    assert isinstance(suffix_drafter, SuffixDrafter) and suffix_drafter.max_depth == 16
    policy = suffix.draft_policy()
    assert policy.method == "suffix" and not policy.on_device and policy.num_speculative_tokens == 16
    mtp = parse_speculative_config({"method": "mtp"})
    assert mtp is not None and mtp.num_speculative_tokens == 1 and mtp.drafts_on_device and mtp.make_drafter() is None
    eagle = parse_speculative_config({"method": "eagle3", "model": "heads/llama", "num_speculative_tokens": 3,
                                      "adaptive_draft_length": False, "disable_by_batch_size": 64})
    assert eagle is not None and eagle.draft_policy().on_device and not eagle.draft_policy().adaptive
    assert parse_speculative_config(None) is None and parse_speculative_config(eagle) is eagle


@pytest.mark.parametrize("value, message", [
    ("[1, 2]", "must be an object"),
    ("{not json", "not valid JSON"),
    (42, "must be an object"),
    ({"num_speculative_tokens": 2}, "['method'] must be one of"),
    ({"method": "medusa", "num_speculative_tokens": 2}, "['method'] must be one of"),
    ({"method": "ngram"}, "needs 'num_speculative_tokens'"),
    ({"method": "ngram", "num_speculative_tokens": 0}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 65}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": True}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": "3"}, "num_speculative_tokens"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 4, "prompt_lookup_max": 2},
     "must not exceed"),
    ({"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 0}, "prompt_lookup_min"),
    ({"method": "ngram", "num_speculative_tokens": 3, "model": "x"}, "remove 'model'"),
    ({"method": "suffix", "prompt_lookup_max": 3}, "applies to method 'ngram'"),
    ({"method": "ngram", "num_speculative_tokens": 3, "suffix_decoding_max_tree_depth": 3}, "applies to method"),
    ({"method": "suffix", "suffix_decoding_min_token_prob": 1.5}, "suffix_decoding_min_token_prob"),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": 0}, "suffix_decoding_max_spec_factor"),
    ({"method": "suffix", "suffix_decoding_max_spec_factor": float("nan")}, "suffix_decoding_max_spec_factor"),
    ({"method": "suffix", "suffix_decoding_max_tree_depth": 0}, "suffix_decoding_max_tree_depth"),
    ({"method": "eagle", "num_speculative_tokens": 3}, "needs 'model'"),
    ({"method": "draft_model", "num_speculative_tokens": 3, "model": ""}, "non-empty string"),
    ({"method": "mtp", "disable_by_batch_size": 0}, "disable_by_batch_size"),
    ({"method": "mtp", "adaptive_draft_length": 1}, "true or false"),
    ({"method": "mtp", "draft_token_cost": -1}, "draft_token_cost"),
    ({"method": "mtp", "speculative_model": "x"}, "unknown key"),
])
def test_mistakes_are_invalid_requests_naming_the_key(value: object, message: str) -> None:
    with pytest.raises(InvalidRequest, match=re.escape(message)):
        parse_speculative_config(value)
