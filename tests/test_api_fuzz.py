"""Bounded fuzzing of the live server: no request may get a 5xx, and the server must be healthy afterwards.

Every numeric field of the completions, chat and responses schemas (read from the
app's own OpenAPI schema, so a field added later is fuzzed too) is drawn
near its limits: the schema's bounds, the sampling ranges of
`SamplingParams`, the vocabulary edge, 32/64-bit edges, NaN and infinities,
and values of the wrong type. Most draws are valid with small `max_tokens`,
so a good share of requests reach generation (streamed and not) rather than
stopping at validation.
"""

from __future__ import annotations

import json
import math

import httpx2
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.test_api_server import start_server, stop_server
from tokenspeed.api.protocol.openai import ChatCompletionRequest, CompletionRequest
from tokenspeed.api.protocol.responses import ResponsesRequest

VOCAB = 4096
EDGES = [0, 1, 2, -1, VOCAB - 1, VOCAB, 2**31 - 1, 2**31, 2**63 - 1, 2**63, 2**64, -(2**63) - 1]
FLOAT_EDGES = [0.0, -0.0, 1e-9, 1e-5, 0.5, 1.0, 1.0000001, 2.0, 2.0000001, -2.0, -2.0000001, 100.0, 100.5,
               1e308, math.nan, math.inf, -math.inf]
WRONG_TYPES = ["3", True, [1], {"a": 1}, None]
SMALL = {"max_tokens", "max_completion_tokens", "min_tokens", "n", "best_of", "logprobs", "top_logprobs",
         "prompt_logprobs", "max_output_tokens"}


def _numeric_fields(model: type) -> dict[str, dict]:
    """name -> its JSON schema (the non-null branch), for every integer or number field."""
    out = {}
    for name, schema in model.model_json_schema()["properties"].items():
        branch = next((b for b in schema.get("anyOf", [schema]) if b.get("type") in ("integer", "number")), None)
        if branch is not None:
            out[name] = branch
    return out


def _value(name: str, schema: dict) -> st.SearchStrategy[object]:
    if schema["type"] == "integer":
        low, high = schema.get("minimum", -(2**63)), schema.get("maximum", 2**63)
        if name in SMALL:  # valid and small: the request runs
            valid = st.integers(max(low, 0), min(high, 3))
        else:
            valid = st.integers(max(low, -5), min(high, 5000))
        near = st.sampled_from(sorted({low - 1, low, high, high + 1, *EDGES}))
        return st.one_of(valid, valid, valid, near, st.sampled_from(WRONG_TYPES))
    valid_float = st.floats(0.0, 1.0)
    return st.one_of(valid_float, valid_float, st.floats(-2.5, 2.5), st.sampled_from(FLOAT_EDGES),
                     st.sampled_from(WRONG_TYPES))


def _body(model: type, required: dict[str, st.SearchStrategy[object]]) -> st.SearchStrategy[dict]:
    optional = {name: _value(name, schema) for name, schema in _numeric_fields(model).items()}
    optional["stop_token_ids"] = st.lists(st.sampled_from([0, 2, VOCAB - 1, VOCAB, -1, 2**64]), max_size=3)
    optional["stop"] = st.sampled_from(["\n", "<|im_end|>", "", "\ud800", ["a", "b"], 7])
    optional["stream"] = st.booleans()
    optional["ignore_eos"] = st.booleans()
    return st.fixed_dictionaries(required, optional=optional).map(
        lambda body: {**body, "max_tokens": body.get("max_tokens", 3)}
    )


PROMPT = st.one_of(st.text(max_size=30), st.lists(st.integers(-1, VOCAB), min_size=0, max_size=6),
                   st.lists(st.text(min_size=1, max_size=8), min_size=1, max_size=3))
MESSAGES = st.lists(st.fixed_dictionaries({"role": st.sampled_from(["user", "system", "assistant", "robot"]),
                                           "content": st.text(max_size=30)}), min_size=0, max_size=3)
ITEMS = st.one_of(
    st.text(max_size=30),
    st.lists(st.one_of(
        st.fixed_dictionaries({"role": st.sampled_from(["user", "developer", "assistant", "robot"]),
                               "content": st.text(max_size=30)}),
        st.fixed_dictionaries({"type": st.just("function_call"), "call_id": st.text(max_size=4),
                               "name": st.text(max_size=4), "arguments": st.sampled_from(["{}", "[", '{"a": 1}'])}),
        st.fixed_dictionaries({"type": st.sampled_from(["function_call_output", "reasoning", "nope"]),
                               "call_id": st.text(max_size=4), "output": st.text(max_size=8)}),
    ), max_size=3),
)
REQUESTS = st.one_of(
    st.tuples(st.just("/v1/completions"), _body(CompletionRequest, {"prompt": PROMPT})),
    st.tuples(st.just("/v1/chat/completions"), _body(ChatCompletionRequest, {"messages": MESSAGES})),
    st.tuples(st.just("/v1/responses"), _body(ResponsesRequest, {"input": ITEMS})),
)


@pytest.fixture(scope="module")
def http(tmp_path_factory):
    # A short context bounds every generation, including those whose max_tokens is capped to it.
    server = start_server(tmp_path_factory.mktemp("fuzz") / "server.log", "--max-model-len", "96")
    with httpx2.Client(base_url=server.url, timeout=120) as client:
        yield client
    stop_server(server)


def test_fuzzed_requests_never_get_a_5xx(http):
    outcomes: dict[int, int] = {}

    @settings(max_examples=300, deadline=None, derandomize=True,
              suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
    @given(REQUESTS)
    def one(request: tuple[str, dict]) -> None:
        path, body = request
        response = http.post(path, content=json.dumps(body).encode(), headers={"content-type": "application/json"})
        outcomes[response.status_code] = outcomes.get(response.status_code, 0) + 1
        assert response.status_code < 500, (path, body, response.text)
        if response.status_code == 200 and body.get("stream") is True:
            for line in response.text.splitlines():
                if line.startswith("data: ") and line != "data: [DONE]":
                    event = json.loads(line[6:])
                    assert event.get("error") is None and event.get("type") != "error", (path, body, line)

    one()
    assert outcomes.get(200, 0) >= 40, outcomes  # generation was reached, not only validation
    assert sum(v for k, v in outcomes.items() if 400 <= k < 500) >= 60, outcomes
    assert http.get("/health").json() == {"status": "ok"}
    stats = http.get("/debug/kv").json()
    assert stats["kv_pages_referenced"] == 0 and stats["num_running"] == 0
    assert stats["kv_pages_free"] + stats["kv_pages_cached"] == stats["kv_pages_total"]
