"""`POST /v1/completions`: the legacy text completion API.

`prompt` may be a string, a list of strings, a list of token ids or a list of
lists of token ids; each prompt is its own engine request and its `n`
choices are numbered `prompt_index * n + sample_index`, as OpenAI does.
Usage sums over the prompts. `echo` with `logprobs` returns the prompt's
tokens first in the logprobs, as OpenAI's legacy completions do (the first
prompt token has `null`s: nothing precedes it); `prompt_logprobs` (vLLM's
extra field) comes back on each choice, as vLLM returns it.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenspeed.api import sse
from tokenspeed.api.errors import from_exception, openai_body
from tokenspeed.api.generation import Generation, collect_all, merge_streams
from tokenspeed.api.openai_format import (
    TokenText,
    completion_logprobs,
    join_logprobs,
    new_id,
    prompt_logprobs_json,
    usage,
)
from tokenspeed.api.protocol.openai import CompletionRequest
from tokenspeed.api.sampling import completion_params
from tokenspeed.api.state import ServerState, get_state
from tokenspeed.errors import InvalidRequest

router = APIRouter()


async def _prompts(
    state: ServerState, prompt: str | list[str] | list[int] | list[list[int]]
) -> list[list[int]]:
    if isinstance(prompt, str):
        return [await state.encode(prompt)]
    if not prompt:
        raise InvalidRequest("prompt must not be an empty list.")
    if all(isinstance(p, int) for p in prompt):
        return [list(prompt)]  # type: ignore[arg-type]
    limit = state.settings.max_prompts_per_request
    if len(prompt) > limit:
        raise InvalidRequest(f"prompt has {len(prompt)} prompts; at most {limit} are served per request "
                             f"(--max-prompts-per-request).")
    if all(isinstance(p, str) for p in prompt):
        return [await state.encode(p) for p in prompt]  # type: ignore[arg-type]
    if all(isinstance(p, list) for p in prompt):
        return [list(p) for p in prompt]  # type: ignore[arg-type]
    raise InvalidRequest("prompt must be a string, a list of strings, or token ids.")


def _usage(generations: list[Generation], completion_tokens: int | None = None) -> dict[str, Any]:
    """Usage summed over the prompts; `completion_tokens` (the tokens sent so far) for a stream's chunks."""
    return usage(
        sum(len(g.prompt_token_ids) for g in generations),
        sum(g.num_generated for g in generations) if completion_tokens is None else completion_tokens,
        sum(g.num_cached_tokens for g in generations),
    )


@router.post("/v1/completions")
async def create_completion(body: CompletionRequest, request: Request) -> Response:
    state = get_state(request)
    model = state.check_model(body.model)
    params = completion_params(body)
    prompts = await _prompts(state, body.prompt)
    request_id = new_id("cmpl-")
    ids = [request_id] if len(prompts) == 1 else [f"{request_id}-{i}" for i in range(len(prompts))]

    async def start_all() -> list[Generation]:
        started: list[Generation] = []
        try:
            for rid, prompt in zip(ids, prompts):
                started.append(await state.start_generation(rid, prompt, params))
        except BaseException:
            for generation in started:
                await generation.close()
            raise
        return started

    generations = await sse.cancel_on_disconnect(request, start_all())
    tokenizer = state.engine.tokenizer
    echoes = [tokenizer.decode(p) if body.echo else "" for p in prompts]
    text = TokenText(tokenizer)
    top_n = params.logprobs or 0

    def echo_logprobs(generation: Generation) -> dict[str, Any] | None:
        """The echoed prompt's part of the logprobs (None without echo or logprobs)."""
        if not body.echo or params.logprobs is None:
            return None
        positions = generation.prompt_logprobs or [None] * len(generation.prompt_token_ids)
        return completion_logprobs(generation.prompt_token_ids, positions, top_n, text, 0)

    if body.stream:
        options = body.stream_options
        include_usage = options is not None and options.include_usage
        return sse.response(_stream(state, generations, echoes, echo_logprobs, model, request_id, include_usage,
                                    include_usage and options is not None and options.continuous_usage_stats))

    per_prompt = await sse.cancel_on_disconnect(request, collect_all(generations))
    choices = []
    for position, outputs in enumerate(per_prompt):
        generation = generations[position]
        prompt_part = echo_logprobs(generation)
        for c in outputs:
            logprobs = None
            if c.logprobs is not None:
                offset = len(echoes[position])
                logprobs = completion_logprobs(c.token_ids, list(c.logprobs), top_n, text, offset)
                logprobs = join_logprobs(prompt_part, logprobs) if prompt_part is not None else logprobs
            choice = {"index": position * params.n + c.index, "text": echoes[position] + c.text,
                      "logprobs": logprobs, "finish_reason": c.finish_reason, "stop_reason": c.stop_reason}
            if body.prompt_logprobs is not None:
                choice["prompt_logprobs"] = prompt_logprobs_json(
                    generation.prompt_token_ids, generation.prompt_logprobs, body.prompt_logprobs)
            choices.append(choice)
    return JSONResponse({"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model,
                         "choices": choices, "usage": _usage(generations)})


async def _stream(
    state: ServerState, generations: list[Generation], echoes: list[str],
    echo_logprobs: Callable[[Generation], dict[str, Any] | None], model: str, request_id: str,
    include_usage: bool, continuous_usage: bool = False,
) -> AsyncIterator[str]:
    """The SSE stream; with `continuous_usage` every chunk carries the usage so far (see chat.py). A choice's
    first chunk carries its echo (and the echo's logprobs) before its first output."""
    n = generations[0].params.n
    top_n = generations[0].params.logprobs or 0
    text = TokenText(state.engine.tokenizer)
    offsets: dict[int, int] = {}
    head = {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": model}
    sent_tokens = 0
    try:
        async for position, update in merge_streams([g.deltas() for g in generations]):
            for piece in update.deltas:
                sent_tokens += len(piece.token_ids)
                index = position * n + piece.index
                first = index not in offsets
                echo = echoes[position] if first else ""
                offset = offsets.get(index, len(echo))
                logprobs = None
                if piece.logprobs is not None:
                    logprobs = completion_logprobs(piece.token_ids, list(piece.logprobs), top_n, text, offset)
                    prompt_part = echo_logprobs(generations[position]) if first else None
                    logprobs = join_logprobs(prompt_part, logprobs) if prompt_part is not None else logprobs
                offsets[index] = offset + len(piece.text)
                if piece.text or echo or logprobs is not None or piece.finish_reason is not None:
                    event = {**head, "choices": [{
                        "index": index, "text": echo + piece.text, "logprobs": logprobs,
                        "finish_reason": piece.finish_reason, "stop_reason": piece.stop_reason}]}
                    if continuous_usage:
                        event["usage"] = _usage(generations, sent_tokens)
                    yield sse.data(event)
        if include_usage:
            yield sse.data({**head, "choices": [], "usage": _usage(generations)})
    except Exception as exc:
        yield sse.data(openai_body(from_exception(exc)))
    finally:
        for generation in generations:
            await generation.close()
    yield sse.DONE
