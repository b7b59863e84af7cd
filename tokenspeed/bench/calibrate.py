"""Learn the server's tokenizer from the outside, before a sweep.

The workload is planned in tokens but sent as text, and we may not have the
server's tokenizer (a peer's server, a remote model).  So we ask the server:
a one-token request with a known text, minus a baseline request, gives the
tokens that text costs, hence characters per token for each text flavour; a
three-message history against a one-message one gives the chat framing each
turn adds.  Any OpenAI-compatible server reports `usage.prompt_tokens`, so
this works against all of them.

`server_info` records what we ran against, for the results file.
"""

from __future__ import annotations

import logging
import random
from typing import Any

import httpx

from tokenspeed.bench import textgen
from tokenspeed.bench.client import RequestOptions, RequestRecord, stream_request
from tokenspeed.bench.conversation import Message, TextRatios

logger = logging.getLogger("tokenspeed.bench")

_CALIBRATION_CHARS = 3000


async def _prompt_tokens(http: httpx.AsyncClient, options: RequestOptions, messages: list[Message]) -> int:
    record = RequestRecord("calibration", 0)
    await stream_request(http, options, messages, 1, record)
    if record.error or not record.usage_reported:
        raise RuntimeError(record.error or "the server reported no usage")
    return record.prompt_tokens


def _calibration_texts(chars: int) -> dict[str, str]:
    return {
        "system": textgen.system_prompt(random.Random(1), chars),
        "task": textgen.user_task(random.Random(2), chars),
        "tool": textgen.calibration_text(chars),
    }


async def calibrate(http: httpx.AsyncClient, options: RequestOptions, max_context: int | None) -> TextRatios:
    """Measure chars/token per flavour and per-turn framing; defaults if the server won't say."""
    # Byte-level BPE never spends more than one token per character, so half the
    # window is always safe to send.
    chars = _CALIBRATION_CHARS if max_context is None else min(_CALIBRATION_CHARS, max_context // 2)
    try:
        base = await _prompt_tokens(http, options, [{"role": "user", "content": "x"}])
        ratios: dict[str, float] = {}
        for kind, text in _calibration_texts(chars).items():
            tokens = await _prompt_tokens(http, options, [{"role": "user", "content": text}])
            ratios[kind] = len(text) / max(tokens - base + 1, 1)
        history: list[Message] = [
            {"role": "user", "content": "x"},
            {"role": "assistant", "content": "x"},
            {"role": "user", "content": "x"},
        ]
        overhead = max(await _prompt_tokens(http, options, history) - base - 2, 0)
    except (RuntimeError, httpx.HTTPError) as exc:
        logger.warning("calibration failed (%s); using default chars/token", exc)
        return TextRatios()
    return TextRatios(ratios["system"], ratios["task"], ratios["tool"], overhead)


async def server_info(http: httpx.AsyncClient) -> dict[str, Any]:
    """Model list, version and `Server` header, whichever the server offers."""
    info: dict[str, Any] = {"base_url": str(http.base_url)}
    try:
        response = await http.get("/v1/models")
        info["server_header"] = response.headers.get("server")
        if response.status_code == 200:
            models = response.json().get("data", [])
            info["models"] = [m.get("id") for m in models]
            # vLLM, SGLang and TokenSpeed report the context window; OpenAI does not.
            windows = [m["max_model_len"] for m in models if isinstance(m.get("max_model_len"), int)]
            if windows:
                info["max_model_len"] = min(windows)
            for key in ("vocab_size", "tokenizer_vocab_size"):  # TokenSpeed reports both
                sizes = [m[key] for m in models if isinstance(m.get(key), int)]
                if sizes:
                    info[key] = min(sizes)
    except (httpx.HTTPError, ValueError) as exc:
        info["models_error"] = str(exc)
    try:
        response = await http.get("/version")
        if response.status_code == 200:
            info["version"] = response.json()
    except (httpx.HTTPError, ValueError):
        pass
    return info


def vocabulary_warning(info: dict[str, Any]) -> str | None:
    """A warning when the served tokenizer decodes fewer ids than the model samples, else None.

    Ids past the tokenizer's range decode to no text, so a stream's text events stop matching
    its tokens (the `llama-3.1-8b` preset served with the embedded tokenizer sent a 256-token
    reply in 5-9 chunks), and the model's text is not what a real deployment would send. Models
    pad their vocabulary for the GEMMs (Qwen3: 151,936 rows for 151,669 tokens), so a gap under
    1% is padding, not a mismatch.
    """
    model, tokenizer = info.get("vocab_size"), info.get("tokenizer_vocab_size")
    if not isinstance(model, int) or not isinstance(tokenizer, int) or tokenizer >= 0.99 * model:
        return None
    return (
        f"the server's tokenizer decodes {tokenizer:,} ids but its model samples from {model:,}: "
        f"the ids past {tokenizer:,} stream as no text, so replies are not what a real deployment "
        f"sends (ITL is still per token where the server reports usage in every chunk)"
    )


async def replica_cache_hit_rates(http: httpx.AsyncClient) -> dict[str, float] | None:
    """Each replica's prefix-cache hit rate (cached / prompt tokens since it started), where a gateway
    reports it (smg's `/get_loads`, fed by each replica's `GetLoads`); None elsewhere."""
    try:
        response = await http.get("/get_loads")
        if response.status_code != 200:
            return None
        loads = response.json().get("loads", [])
        return {str(load["worker"]): float(load["cache_hit_rate"]) for load in loads}
    except (httpx.HTTPError, ValueError, KeyError, TypeError, AttributeError):
        return None



_SPEC_PREFIXES = ("tokenspeed_spec_decode_", "vllm:spec_decode_")
_SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens")


async def speculation_counters(http: httpx.AsyncClient) -> dict[str, dict[str, float]]:
    """The server's speculative-decoding counters per drafter method (TokenSpeed's or vLLM's names in
    `/metrics`): {method: {num_drafts, num_draft_tokens, num_accepted_tokens}}; empty when it has none."""
    try:
        response = await http.get("/metrics")
        if response.status_code != 200:
            return {}
        text = response.text
    except httpx.HTTPError:
        return {}
    counters: dict[str, dict[str, float]] = {}
    for line in text.splitlines():
        prefix = next((p for p in _SPEC_PREFIXES if line.startswith(p)), None)
        if prefix is None:
            continue
        name, _, rest = line[len(prefix) :].partition("{")
        labels, _, value = rest.rpartition("}")
        name = name.removesuffix("_total")
        if name not in _SPEC_COUNTERS or "position=" in labels:
            continue
        method = labels.partition('method="')[2].partition('"')[0] or "unknown"
        try:
            counters.setdefault(method, {})[name] = float(value.split()[0])
        except (ValueError, IndexError):
            continue
    return counters


def speculation_summary(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]
                        ) -> dict[str, float | str]:
    """Result-row fields for what the drafters did between two `speculation_counters` readings."""
    out: dict[str, float | str] = {}
    for method, now in after.items():
        was = before.get(method, {})
        delta = {k: now.get(k, 0.0) - was.get(k, 0.0) for k in _SPEC_COUNTERS}
        drafts, drafted, accepted = delta["num_drafts"], delta["num_draft_tokens"], delta["num_accepted_tokens"]
        out.update({
            "spec_method": method,
            "spec_num_drafts": drafts,
            "spec_num_draft_tokens": drafted,
            "spec_num_accepted_tokens": accepted,
            "spec_acceptance_rate": accepted / drafted if drafted else 0.0,
            "spec_mean_accepted_length": 1.0 + accepted / drafts if drafts else 0.0,
        })
    return out
