"""`tokenspeed serve --speculative-config`: the served engine speculates, `/metrics` says how well, and
`bench serve` rows carry the drafters' acceptance; streamed text with stop strings equals the
non-streamed and the offline text although steps now bring several tokens."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import httpx2
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.test_api_server import start_server
from tokenspeed import LLM, SamplingParams
from tokenspeed.cli import main

SUFFIX = '{"method": "suffix", "num_speculative_tokens": 8}'
# A prompt that asks for text it contains, as an agent's edit requests do.
FILE = "def area(r):\n    return 3.14159 * r * r\n\n\ndef perimeter(r):\n    return 2 * 3.14159 * r\n"
PROMPT = f"{FILE}\n# The same file again:\n{FILE}\n# And once more:\n"


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    log = tmp_path_factory.mktemp("spec_serve") / "serve.log"
    running = start_server(log, "--speculative-config", SUFFIX)
    try:
        yield running.url
    finally:
        running.proc.terminate()
        running.proc.wait(timeout=30)


def test_metrics_and_bench_serve_report_the_drafters(server: str, tmp_path: Path) -> None:
    client = openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0)
    client.completions.create(model="embedded", prompt=PROMPT, max_tokens=48, temperature=0)
    families = {f.name: f for f in text_string_to_metric_families(httpx2.get(server + "/metrics").text)}
    drafted = families["tokenspeed_spec_decode_num_draft_tokens"].samples[0]
    assert drafted.labels == {"method": "suffix"} and drafted.value > 0
    assert families["tokenspeed_spec_decode_acceptance_rate"].type == "gauge"
    assert families["tokenspeed_spec_decode_mean_accepted_length"].samples[0].value >= 1.0

    out = tmp_path / "results"
    code = main(["bench", "serve", "--base-url", server, "--output-dir", str(out), "--workload", "agentic",
                 "--concurrency", "2", "--sessions", "2", "--turns", "2", "--max-context", "1024",
                 "--time-scale", "0", "--no-progress"])
    assert code == 0
    row = json.loads((out / "results.json").read_text())["rows"][0]
    assert row["spec_method"] == "suffix" and row["spec_num_draft_tokens"] > 0
    assert 0.0 <= row["spec_acceptance_rate"] <= 1.0 and row["spec_mean_accepted_length"] >= 1.0


def test_streamed_text_with_stop_strings_equals_non_streamed_and_offline(server: str) -> None:
    client = openai.OpenAI(base_url=server + "/v1", api_key="x", max_retries=0)
    plain = client.completions.create(model="embedded", prompt=PROMPT, max_tokens=40, temperature=0).choices[0].text
    assert len(plain) > 8
    stop = plain[len(plain) // 2 : len(plain) // 2 + 3]  # a stop string the output surely contains
    kwargs = dict(model="embedded", prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop])
    whole = client.completions.create(**kwargs).choices[0]
    streamed = "".join(c.choices[0].text for c in client.completions.create(**kwargs, stream=True))
    offline = LLM(speculative_config=SUFFIX, show_progress=False, max_model_len=1024).generate(
        PROMPT, SamplingParams(max_tokens=40, temperature=0, stop=[stop]))[0].outputs[0]
    assert whole.finish_reason == "stop" and whole.text == streamed == offline.text
    assert whole.text == plain[: plain.find(stop)]
