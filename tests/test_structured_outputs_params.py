"""`StructuredOutputsParams` and `logit_bias` as `SamplingParams` takes them: shapes, bounds, names, wire."""

from __future__ import annotations

import pytest

from tokenspeed import GuidedDecodingParams, SamplingParams, StructuredOutputsParams
from tokenspeed.engine import ipc
from tokenspeed.errors import InvalidRequest
from tokenspeed.scheduler.admission import AdmissionLimits, check_admission

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}, "required": ["a"]}


def test_one_constraint_of_each_kind_and_its_key():
    for fields in ({"json": SCHEMA}, {"regex": "[a-z]+"}, {"choice": ["yes", "no"]}, {"grammar": 'root ::= "x"'},
                   {"json_object": True}, {"structural_tag": "{}"}):
        spec = StructuredOutputsParams(**fields)
        assert spec.kind == next(iter(fields))
        assert StructuredOutputsParams.coerce(spec.to_dict()) == spec
    # The same schema written as text, with other key order and spacing, shares one cache entry.
    assert StructuredOutputsParams(json=SCHEMA).cache_key() == StructuredOutputsParams(
        json='{"required": ["a"],   "type": "object", "properties": {"a": {"type": "integer"}}}').cache_key()
    assert StructuredOutputsParams(json=SCHEMA).cache_key() != StructuredOutputsParams(
        json=SCHEMA, any_whitespace=True).cache_key()


@pytest.mark.parametrize("fields, words", [
    ({}, "exactly one"),
    ({"json": SCHEMA, "regex": "x"}, "exactly one"),
    ({"json": "{not json"}, "not valid JSON"),
    ({"json": "[1, 2]"}, "JSON schema"),
    ({"choice": []}, "choice"),
    ({"choice": ["a", 3]}, "string"),
    ({"regex": ""}, "non-empty"),
    ({"json_object": "yes"}, "must be true"),
    ({"grammar": 'root ::= "x"', "any_whitespace": "no"}, "boolean"),
])
def test_bad_shapes_are_invalid_requests(fields, words):
    with pytest.raises(InvalidRequest, match=words):
        StructuredOutputsParams(**fields)


def test_both_vllm_names_and_dicts():
    spec = StructuredOutputsParams(regex="[0-9]+")
    old = SamplingParams(guided_decoding=GuidedDecodingParams(regex="[0-9]+"))
    new = SamplingParams(structured_outputs=spec)
    assert old.structured_outputs == old.guided_decoding == new.structured_outputs == new.guided_decoding == spec
    assert SamplingParams(structured_outputs={"choice": ["a"]}).structured_outputs == StructuredOutputsParams(
        choice=["a"])
    assert SamplingParams(structured_outputs=spec, guided_decoding=spec).needs_grammar
    with pytest.raises(InvalidRequest, match="two names"):
        SamplingParams(structured_outputs=spec, guided_decoding=StructuredOutputsParams(regex="x"))
    with pytest.raises(InvalidRequest, match="unknown field"):
        SamplingParams(structured_outputs={"jsn": {}})


def test_logit_bias_bounds():
    assert SamplingParams(logit_bias={"5": 100, 7: -100.0}).logit_bias == {5: 100.0, 7: -100.0}
    assert SamplingParams(logit_bias={}).logit_bias is None
    for bias, words in (({5: 100.5}, r"\[-100.0, 100.0\]"), ({5: float("nan")}, "finite"), ({"x": 1}, "token id"),
                        ({-1: 1}, "token id"), ({5: True}, "finite"), ([1], "map token ids"),
                        ({i: 1 for i in range(301)}, "at most 300")):
        with pytest.raises(InvalidRequest, match=words):
            SamplingParams(logit_bias=bias)


def test_logit_bias_ids_are_checked_against_the_vocabulary():
    limits = AdmissionLimits(max_model_len=64, max_num_seqs=4, page_size=16, num_kv_pages=6, vocab_size=100)
    check_admission([1, 2], SamplingParams(logit_bias={99: 1}), limits)
    with pytest.raises(InvalidRequest, match="logit_bias token ids"):
        check_admission([1, 2], SamplingParams(logit_bias={100: 1}), limits)


def test_the_wire_carries_both():
    params = SamplingParams(logit_bias={3: -2.5}, guided_decoding={"json": SCHEMA}, eos_token_ids=(2,))
    back = ipc.decode(ipc.encode(ipc.AddRequest("r", [1], params)))
    assert isinstance(back, ipc.AddRequest)
    assert back.params == params
    assert back.params.logit_bias == {3: -2.5} and back.params.structured_outputs == StructuredOutputsParams(json=SCHEMA)
