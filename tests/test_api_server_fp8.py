"""`tokenspeed serve --quantization fp8 --kv-cache-dtype fp8_e4m3` end to end: the flags a vLLM user passes.

One real server subprocess on the embedded model (CPU: the reference FP8 kernels), the official client:
its greedy chat and its log-probabilities equal the offline `LLM` given the same options (and not those
of the unquantised model), and its KV pool holds the pages of an e4m3 cache (more than the same memory
holds at the model's dtype).
"""

from __future__ import annotations

import httpx2
import openai
import pytest
import torch

from tests.test_api_server import chat_kwargs, start_server, stop_server
from tokenspeed import LLM, SamplingParams


def _offline(messages: list[dict[str, str]], **options: str) -> tuple[str, list[float], int]:
    """Greedy text, the chosen tokens' log-probabilities and the KV pages of an offline engine, on one
    intra-op thread as the server runs."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        llm = LLM(max_model_len=1024, show_progress=False, **options)
        out = llm.chat(messages, SamplingParams(temperature=0, max_tokens=16, logprobs=0))[0].outputs[0]
        chosen = [next(iter(step.values())).logprob for step in out.logprobs]
        return out.text, chosen, llm.core.executor.limits.num_pages
    finally:
        torch.set_num_threads(threads)


def test_fp8_server_answers_as_the_offline_fp8_engine_on_e4m3_pages(tmp_path) -> None:
    kwargs = chat_kwargs("Explain paged attention in one sentence.", max_tokens=16)
    server = start_server(tmp_path / "server.log", "--quantization", "fp8", "--kv-cache-dtype", "fp8_e4m3")
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0) as oai:
            choice = oai.chat.completions.create(**kwargs, logprobs=True).choices[0]
        pages = httpx2.get(server.url + "/debug/kv", timeout=30).json()["kv_pages_total"]
    finally:
        stop_server(server)
    served = [entry.logprob for entry in choice.logprobs.content]
    fp8_text, fp8_logprobs, fp8_pages = _offline(kwargs["messages"], quantization="fp8", kv_cache_dtype="fp8")
    _, bf16_weights_logprobs, _ = _offline(kwargs["messages"], kv_cache_dtype="fp8")
    _, _, plain_pages = _offline(kwargs["messages"])
    assert choice.message.content == fp8_text and fp8_text
    assert served == pytest.approx(fp8_logprobs, abs=1e-4)
    assert served != pytest.approx(bf16_weights_logprobs, abs=1e-2)  # the server's weights really are fp8
    assert pages == fp8_pages > plain_pages
