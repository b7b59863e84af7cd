"""Bad input raises a typed error with a clear message, and the engine stays usable."""

from __future__ import annotations

import pytest

from tokenspeed import LLM, SamplingParams
from tokenspeed.errors import ContextTooLong, InvalidRequest, ModelNotFound, ModelNotSupported


@pytest.fixture(scope="module")
def llm():
    return LLM(max_model_len=64, page_size=16)


def still_works(llm) -> None:
    out = llm.generate("ok", SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    assert len(out[0].outputs[0].token_ids) == 3


@pytest.mark.parametrize(
    "prompt, params, error, words",
    [
        ("", SamplingParams(), InvalidRequest, "empty"),
        ({"prompt_token_ids": []}, SamplingParams(), InvalidRequest, "empty"),
        ({"prompt_token_ids": list(range(10, 80))}, SamplingParams(), ContextTooLong, "64"),
        ({"prompt_token_ids": [5, 999999]}, SamplingParams(), InvalidRequest, "999999"),
        ({"prompt_token_ids": [5, -1]}, SamplingParams(), InvalidRequest, "-1"),
        ({"prompt_token_ids": ["a"]}, SamplingParams(), InvalidRequest, "integers"),
        # An out-of-vocabulary stop id used to index past the logits row and kill the engine.
        ("x", SamplingParams(min_tokens=2, max_tokens=4, stop_token_ids=[10**9]), InvalidRequest, "stop_token_ids"),
        ("x", SamplingParams(presence_penalty=1.0, stop_token_ids=[4096]), InvalidRequest, r"\[0, 4096\)"),
    ],
    ids=["empty-text", "empty-ids", "too-long", "id-too-big", "id-negative", "id-not-int", "stop-id-too-big",
         "stop-id-with-penalty"],
)
def test_bad_prompt(llm, prompt, params, error, words):
    with pytest.raises(error, match=words):
        llm.generate(["fine prompt", prompt], params)  # the good prompt in the batch is withdrawn too
    still_works(llm)


@pytest.mark.parametrize(
    "kwargs, words",
    [
        (dict(max_tokens=0), "max_tokens"),
        (dict(top_p=0.0), "top_p"),
        (dict(top_p=1.5), "top_p"),
        (dict(temperature=-0.5), "temperature"),
        (dict(n=0), "n must"),
        (dict(min_tokens=5, max_tokens=2), "min_tokens"),
        (dict(logprobs=-1), "logprobs"),
        (dict(stop=[""]), "stop"),
        (dict(temperature=float("nan")), "temperature"),
        (dict(temperature=float("inf")), "temperature"),
        (dict(temperature=1e308), "temperature"),
        (dict(repetition_penalty=float("nan")), "repetition_penalty"),
        (dict(top_p=float("nan")), "top_p"),
        (dict(min_p=float("nan")), "min_p"),
        (dict(presence_penalty=float("-inf")), "presence_penalty"),
        (dict(frequency_penalty=float("nan")), "frequency_penalty"),
        (dict(max_tokens=2**64), "max_tokens"),
        (dict(top_k=2**64), "top_k"),
        (dict(seed=2**63), "seed"),
        (dict(seed=2**63 - 2, n=3), "seed"),  # sample 2 would draw with seed + 2, past int64
        (dict(n=True), "n must"),
        (dict(stop_token_ids=[-5]), "stop_token_ids"),
        (dict(stop_token_ids=[True]), "stop_token_ids"),
    ],
)
def test_bad_sampling_params(kwargs, words):
    with pytest.raises(InvalidRequest, match=words):
        SamplingParams(**kwargs)


def test_unknown_model_path(tmp_path):
    with pytest.raises(ModelNotFound, match="does not exist"):
        LLM(str(tmp_path / "nope"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(ModelNotFound, match="config.json"):
        LLM(str(tmp_path / "empty"))


def test_unknown_architecture_names_supported_ones(tmp_path):
    (tmp_path / "config.json").write_text('{"architectures": ["GPTFooForCausalLM"], "model_type": "foo"}')
    with pytest.raises(ModelNotSupported, match="LlamaForCausalLM"):
        LLM(str(tmp_path))


def test_pool_too_small_for_one_request():
    with pytest.raises(InvalidRequest, match="num_kv_pages"):
        LLM(max_model_len=256, page_size=16, num_kv_pages=4)


def test_wrong_number_of_sampling_params(llm):
    with pytest.raises(InvalidRequest, match="2 prompts"):
        llm.generate(["a", "b"], [SamplingParams()])
    still_works(llm)
