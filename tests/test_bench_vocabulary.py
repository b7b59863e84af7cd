"""`bench serve` warns when the served tokenizer decodes fewer ids than the model samples (issue 19, item 9).

The server reports both vocabularies in `/v1/models`; the whole `bench serve`
command runs here against the app with a scripted engine (tests/test_api_routes.py),
in process.
"""

from __future__ import annotations

import asyncio

import httpx
import openai
import pytest

from tests.test_api_routes import ScriptedEngine
from tokenspeed.api.app import build_app
from tokenspeed.api.settings import ServerSettings
from tokenspeed.bench.calibrate import vocabulary_warning
from tokenspeed.cli import main
from tokenspeed.engine.llm import load_tokenizer
from tokenspeed.models.embedded.materialize import embedded_model_path


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(embedded_model_path())


def _app(tokenizer, vocab_size):
    return build_app(ScriptedEngine(tokenizer, vocab_size=vocab_size), ServerSettings(served_model_names=["llama-3.1-8b"]))


def _bench(app, monkeypatch, tmp_path, capsys) -> str:
    real_client = httpx.AsyncClient

    def in_process(**kwargs):
        return real_client(transport=httpx.ASGITransport(app=app), **kwargs)

    monkeypatch.setattr(httpx, "AsyncClient", in_process)
    code = main(["bench", "serve", "--base-url", "http://test", "--output-dir", str(tmp_path), "--workload",
                 "random", "--sessions", "1", "--turns", "1", "--concurrency", "1", "--input-len", "32",
                 "--output-len", "4", "--no-calibrate", "--no-progress", "--time-scale", "0"])
    err = capsys.readouterr().err
    assert code == 0, err
    return err


def test_models_report_both_vocabularies_through_the_openai_client(tokenizer):
    async def models():
        http = httpx.AsyncClient(transport=httpx.ASGITransport(app=_app(tokenizer, 128256)), base_url="http://test")
        oai = openai.AsyncOpenAI(base_url="http://test/v1", api_key="k", http_client=http, max_retries=0)
        return (await oai.models.list()).data

    (card,) = asyncio.run(models())
    assert card.model_extra["vocab_size"] == 128256
    assert card.model_extra["tokenizer_vocab_size"] == len(tokenizer)


def test_bench_serve_warns_about_a_smaller_served_vocabulary(tokenizer, monkeypatch, tmp_path, capsys):
    err = _bench(_app(tokenizer, 128256), monkeypatch, tmp_path, capsys)
    assert f"warning: the server's tokenizer decodes {len(tokenizer):,} ids but its model samples from 128,256" in err


def test_matching_or_padded_vocabularies_get_no_warning(tokenizer, monkeypatch, tmp_path, capsys):
    assert "warning" not in _bench(_app(tokenizer, len(tokenizer)), monkeypatch, tmp_path, capsys)
    # Qwen3 pads 151,669 tokens to 151,936 rows for its GEMMs: padding, not a mismatch.
    assert vocabulary_warning({"vocab_size": 151936, "tokenizer_vocab_size": 151669}) is None
    assert vocabulary_warning({"vocab_size": 151936}) is None  # a server that does not say
