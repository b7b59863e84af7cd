"""KV tiers through the API: session keys from request bodies, `usage` cached tokens, `/metrics`, `/debug/kv`."""

from __future__ import annotations

from collections.abc import Iterator

import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_api_server import start_server
from tokenspeed.api.cache_session import anthropic_session, openai_session, parse_ttl
from tokenspeed.api.protocol import anthropic
from tokenspeed.api.protocol import openai as openai_protocol
from tokenspeed.errors import InvalidRequest

CHAT = [{"role": "system", "content": "You are a careful coding agent. " * 20},
        {"role": "user", "content": "List the files."}]


def test_openai_session_from_prompt_cache_key_then_user() -> None:
    body = openai_protocol.ChatCompletionRequest(model="m", messages=CHAT, prompt_cache_key="k1", user="u")
    assert openai_session(body) == ("openai:k1", None)
    body = openai_protocol.ChatCompletionRequest(model="m", messages=CHAT, user="u")
    assert openai_session(body) == ("openai:u", None)
    assert openai_session(openai_protocol.ChatCompletionRequest(model="m", messages=CHAT)) == (None, None)


def test_anthropic_session_from_cache_control_with_its_ttl() -> None:
    def body(**kw: object) -> anthropic.MessagesRequest:
        return anthropic.MessagesRequest.model_validate({"model": "m", "max_tokens": 4, **kw})

    marked = [{"type": "text", "text": "big system prompt", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    key, ttl = anthropic_session(body(system=marked, messages=[{"role": "user", "content": "hi"}]))
    assert key is not None and key.startswith("anthropic:") and ttl == 3600.0
    # The same system prompt is the same session; metadata.user_id names it when given.
    assert anthropic_session(body(system=marked, messages=[{"role": "user", "content": "next"}]))[0] == key
    assert anthropic_session(body(system=marked, messages=[{"role": "user", "content": "x"}],
                                  metadata={"user_id": "dev-1"}))[0] == "anthropic:dev-1"
    plain = [{"role": "user", "content": [{"type": "text", "text": "q", "cache_control": {"type": "ephemeral"}}]}]
    assert anthropic_session(body(messages=plain))[1] == 300.0
    assert anthropic_session(body(messages=[{"role": "user", "content": "hi"}])) == (None, None)
    assert parse_ttl("30s") == 30.0
    with pytest.raises(InvalidRequest, match="ttl"):
        parse_ttl("forever")


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("kv_tiers_serve") / "serve.log"
    running = start_server(log, "--host-kv-cache-bytes", str(64 * 1024 * 1024), "--num-kv-pages", "80",
                           "--page-size", "16", "--session-ttl", "120")
    try:
        yield running.url
    finally:
        running.proc.terminate()
        running.proc.wait(timeout=30)


def test_a_session_turn_reports_cached_tokens_and_the_tiers_show(server: str) -> None:
    client = openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0)
    first = client.chat.completions.create(model="embedded", messages=CHAT, max_tokens=4,  # type: ignore[arg-type]
                                           extra_body={"prompt_cache_key": "agent-1"})
    assert first.usage is not None
    for i in range(6):  # other traffic while the agent's tool runs: more than the device pool holds
        client.completions.create(model="embedded", prompt=f"unrelated request {i} " * 60, max_tokens=2)
    again = client.chat.completions.create(model="embedded", messages=CHAT, max_tokens=4,  # type: ignore[arg-type]
                                           extra_body={"prompt_cache_key": "agent-1"})
    assert again.usage is not None and again.usage.prompt_tokens_details is not None
    assert again.usage.prompt_tokens_details.cached_tokens >= 16 * 8
    families = {f.name: f for f in text_string_to_metric_families(httpx2.get(server + "/metrics").text)}
    events = {s.labels["event"]: s.value for s in families["tokenspeed_kv_tier_pages"].samples
              if s.name.endswith("_total")}
    assert set(events) >= {"retracted", "restored", "spilled"}
    assert "tokenspeed_kv_tier_hit_tokens" in families and "tokenspeed_kv_tier_bytes" in families
    debug = httpx2.get(server + "/debug/kv").json()
    tiers = debug["kv_tiers"]
    assert tiers["host"]["total"] > 0 and tiers["device"]["total"] == 80 and tiers["disk"] is None
    assert tiers["page_size"] == 16


def test_anthropic_cache_control_reports_cache_reads_and_writes(server: str) -> None:
    system = [{"type": "text", "text": "You are a coding agent with many tools. " * 20,
               "cache_control": {"type": "ephemeral", "ttl": "1h"}}]
    body = {"model": "embedded", "max_tokens": 4, "system": system,
            "messages": [{"role": "user", "content": "Run the tests."}]}
    first = httpx2.post(server + "/v1/messages", json=body, timeout=120).json()["usage"]
    second = httpx2.post(server + "/v1/messages", json=body, timeout=120).json()["usage"]
    assert first["cache_creation_input_tokens"] > 0 and first["input_tokens"] == 0
    assert second["cache_read_input_tokens"] >= 16 * 8
    assert second["cache_read_input_tokens"] + second["cache_creation_input_tokens"] == (
        first["cache_read_input_tokens"] + first["cache_creation_input_tokens"])
