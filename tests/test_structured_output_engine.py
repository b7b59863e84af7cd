"""Structured output and logit bias through the engine (offline `LLM`, embedded model, whatever its weights).

Schema-valid JSON for every request (sampled, n > 1, overlap on and off), choices, regexes, EBNF
grammars, logit bias forcing and forbidding tokens, grammar on/off identity where the grammar allows
the greedy path, requests waiting for a slow grammar without holding others up, and a bad grammar
failing its request alone. Page accounting is checked after every test (conftest).
"""

from __future__ import annotations

import json
import re
import threading

import jsonschema
import pytest

from tokenspeed import LLM, SamplingParams, StructuredOutputsParams
from tokenspeed.errors import InvalidRequest
from tokenspeed.grammar.compiler import GrammarCompiler

# Nested objects, enums, arrays, required fields; every string and array bounded, so outputs are short.
SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "kind": {"enum": ["file", "dir", "link"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 999},
        "tags": {"type": "array", "items": {"enum": ["x", "y", "z"]}, "maxItems": 2},
        "owner": {"type": "object", "properties": {"uid": {"type": "integer", "minimum": 0, "maximum": 99},
                                                   "admin": {"type": "boolean"}},
                  "required": ["uid", "admin"]},
    },
    "required": ["name", "kind", "size", "tags", "owner"],
}
PROMPTS = ["def parse(path):", "import os\n", "class Tree:", "# build the index"]


@pytest.fixture(scope="module")
def llm():
    return LLM(num_kv_pages=256, show_progress=False)


@pytest.fixture(scope="module")
def llm_sync():
    return LLM(num_kv_pages=256, show_progress=False, disable_overlap=True)


def _json_params(**extra):
    return SamplingParams(temperature=1.0, max_tokens=120, structured_outputs=StructuredOutputsParams(json=SCHEMA),
                          **extra)


def test_sampled_json_is_always_schema_valid_with_overlap_on_and_off(llm, llm_sync):
    params = [_json_params(seed=i) for i in range(12)] + [_json_params(seed=99, n=3)]
    prompts = [PROMPTS[i % 4] for i in range(13)]
    outs = llm.generate(prompts, params, use_tqdm=False)
    for out in outs:
        for sample in out.outputs:
            assert sample.finish_reason == "stop", sample.text
            jsonschema.validate(json.loads(sample.text), SCHEMA)
    assert len({o.text for o in outs[-1].outputs}) > 1  # n > 1: three different samples
    sync = llm_sync.generate(prompts, params, use_tqdm=False)
    assert [[s.token_ids for s in o.outputs] for o in sync] == [[s.token_ids for s in o.outputs] for o in outs]


def test_constrained_and_free_requests_share_steps(llm, llm_sync):
    params = [_json_params(seed=1), SamplingParams(temperature=1.0, seed=2, max_tokens=20, ignore_eos=True),
              SamplingParams(temperature=0.0, max_tokens=10, structured_outputs={"regex": "[0-9]{3}-[a-f]{2}"})]
    outs = llm.generate(PROMPTS[:3], params, use_tqdm=False)
    assert len(outs[1].outputs[0].token_ids) == 20
    assert re.fullmatch("[0-9]{3}-[a-f]{2}", outs[2].outputs[0].text)
    sync = llm_sync.generate(PROMPTS[:3], params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in sync] == [o.outputs[0].token_ids for o in outs]


def test_choice_regex_grammar_and_json_object(llm):
    choices = ["alpha", "beta", 'say "gamma"']
    regex = r"(GET|POST) /[a-z]{1,5}"
    grammar = 'root ::= "call(" num ("," num)? ")"\nnum ::= [0-9]'
    # `}` is biased up by 100, yet the grammar opens the object first: the bias cannot undo a mask.
    brace = llm.get_tokenizer().convert_tokens_to_ids("}")
    specs = [{"choice": choices}, {"regex": regex}, {"grammar": grammar}, {"json_object": True}]
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=30, structured_outputs=spec,
                             logit_bias={brace: 100} if "json_object" in spec else None)
              for i, spec in enumerate(specs)]
    texts = [o.outputs[0].text for o in llm.generate(PROMPTS, params, use_tqdm=False)]
    assert texts[0] in choices
    assert re.fullmatch(regex, texts[1])
    assert re.fullmatch(r"call\([0-9](,[0-9])?\)", texts[2])
    assert texts[3] == "{}"


def test_logit_bias_forces_and_forbids(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    (free,) = llm.generate(["def f(x):"], greedy, use_tqdm=False)
    first = free.outputs[0].token_ids[0]
    forced = SamplingParams(temperature=1.0, seed=3, max_tokens=6, ignore_eos=True, logit_bias={"77": 100})
    forbidden = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logit_bias={first: -100})
    a, b = llm.generate(["def f(x):"] * 2, [forced, forbidden], use_tqdm=False)
    assert a.outputs[0].token_ids == [77] * 6
    assert b.outputs[0].token_ids[0] != first


def test_grammar_on_off_identity_where_the_grammar_allows_the_greedy_path(llm):
    greedy = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)
    for prompt in PROMPTS:
        (free,) = llm.generate([prompt], greedy, use_tqdm=False)
        text = free.outputs[0].text
        if "\ufffd" in text:  # cut inside a character: not a string a grammar can name
            continue
        constrained = SamplingParams(temperature=0.0, max_tokens=12, structured_outputs={"choice": [text, "zz"]})
        (out,) = llm.generate([prompt], constrained, use_tqdm=False)
        assert out.outputs[0].token_ids == free.outputs[0].token_ids
        return
    pytest.fail("no prompt's greedy text decodes cleanly")


def test_bad_grammar_fails_its_request_and_the_engine_goes_on(llm):
    with pytest.raises(InvalidRequest, match="JSON schema cannot be compiled"):
        llm.generate(["x"], SamplingParams(structured_outputs={"json": {"type": "object", "properties": 3}}),
                     use_tqdm=False)
    (out,) = llm.generate(["x"], SamplingParams(max_tokens=3, ignore_eos=True), use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 3


def test_a_compiling_grammar_holds_only_its_own_request(llm, monkeypatch):
    release = threading.Event()
    compile_for_real = GrammarCompiler._compile

    def slow(self, spec):
        release.wait(30)
        return compile_for_real(self, spec)

    monkeypatch.setattr(GrammarCompiler, "_compile", slow)
    core = llm.core
    spec = StructuredOutputsParams(regex="[a-z]{2}")  # not compiled before in this module: not cached
    core.add_request("held", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=8, structured_outputs=spec,
                                                       eos_token_ids=llm.eos_token_ids))
    core.add_request("free", [5, 6, 7], SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    finished: dict[str, list[int]] = {}
    tokens: dict[str, list[int]] = {}
    while "free" not in finished:
        for update in core.step():
            tokens.setdefault(update.request_id, []).extend(update.new_token_ids)
            if update.finished:
                finished[update.request_id] = tokens[update.request_id]
    assert "held" not in tokens and core.scheduler.get("held") is not None and core.scheduler.num_waiting == 1
    release.set()
    while "held" not in finished:
        for update in core.step():
            tokens.setdefault(update.request_id, []).extend(update.new_token_ids)
            if update.finished:
                finished[update.request_id] = tokens[update.request_id]
    text = llm.get_tokenizer().decode(finished["held"], skip_special_tokens=True)
    assert re.fullmatch("[a-z]{2}", text)


def test_a_request_that_cannot_stop_goes_on_unconstrained_after_its_grammar(llm):
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True, structured_outputs={"choice": ["ab"]})
    (out,) = llm.generate(["x"], params, use_tqdm=False)
    assert len(out.outputs[0].token_ids) == 8 and out.outputs[0].text.startswith("ab")
