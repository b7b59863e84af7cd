"""`POST /v1/chat/completions`: OpenAI chat, streaming and not, with tools and reasoning.

Both modes run the same `OutputParser` per choice (non-streaming parses the
whole text in one feed), so a streamed answer concatenates to the
non-streamed one. Tool calls stream as OpenAI streams them: a first
`tool_calls` delta with the call's index, id and name, then fragments of its
arguments under the same index (see `parsers/tool_blocks.py`).
`prompt_logprobs` (vLLM's extra field) comes back as vLLM returns it, at
the top of the response.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenspeed.api import sse
from tokenspeed.api.conversation import openai_conversation, openai_tools
from tokenspeed.api.errors import from_exception, openai_body
from tokenspeed.api.generation import Generation, collect
from tokenspeed.api.openai_format import TokenText, chat_logprobs, new_id, prompt_logprobs_json, usage
from tokenspeed.api.parsers import OutputParser, ParsedEvent, ParsedOutput, TextPiece, ToolCall, ToolCallStart
from tokenspeed.api.parsers.reasoning import thinking_requested
from tokenspeed.api.protocol.openai import ChatCompletionRequest, NamedToolChoice
from tokenspeed.api.sampling import chat_params
from tokenspeed.api.state import ServerState, get_state
from tokenspeed.api.tool_policy import CallFilter, ToolPolicy, tool_policy

router = APIRouter()

CALL_ID_PREFIX = "call_"


def _finish_reason(reason: str | None, has_calls: bool) -> str | None:
    return "tool_calls" if has_calls and reason == "stop" else reason


def _tool_call_json(call: ToolCall) -> dict[str, Any]:
    return {"id": call.call_id, "type": "function", "function": {"name": call.name, "arguments": call.arguments}}


@router.post("/v1/chat/completions")
async def create_chat_completion(body: ChatCompletionRequest, request: Request) -> Response:
    state = get_state(request)
    model = state.check_model(body.model)
    tools = openai_tools(body.tools)
    choice = body.tool_choice
    function = choice.function.name if isinstance(choice, NamedToolChoice) else None
    policy = tool_policy(
        tools, None if isinstance(choice, NamedToolChoice) else choice, function,
        parser_name=state.settings.tool_call_parser, parallel=body.parallel_tool_calls,
        token_markers=state.added_tokens,
    )
    prompt = await state.render(
        openai_conversation(body.messages),
        tools=tools,
        add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
        continue_final_message=body.continue_final_message,
        template_kwargs=body.chat_template_kwargs,
        forced_prefix=policy.forced_prefix,
    )
    params = chat_params(body, policy.grammar)
    request_id = new_id("chatcmpl-")
    generation = await sse.cancel_on_disconnect(
        request, state.start_generation(request_id, prompt.token_ids, params, parsed=state.parses_output(policy))
    )
    thinking = thinking_requested(body.chat_template_kwargs)
    if body.stream:
        options = body.stream_options
        include_usage = options is not None and options.include_usage
        return sse.response(_stream(state, generation, policy, model, include_usage,
                                    include_usage and options is not None and options.continuous_usage_stats,
                                    thinking))
    choices = await sse.cancel_on_disconnect(request, collect(generation))
    text = TokenText(state.engine.tokenizer)
    out = []
    for c in choices:
        parser = policy.output_parser(state.settings.reasoning_parser, thinking=thinking)
        calls = policy.calls(CALL_ID_PREFIX)
        parsed = ParsedOutput.fold(calls(parser.feed(c.text) + parser.finish()))
        calls.check()
        message: dict[str, Any] = {"role": "assistant",
                                   "content": parsed.content if parsed.content or not parsed.tool_calls else None}
        if message["content"] is None and not parsed.tool_calls:
            message["content"] = ""
        if state.settings.reasoning_parser is not None or parsed.reasoning is not None:  # harmony carries it
            message["reasoning_content"] = parsed.reasoning
        if parsed.tool_calls:
            message["tool_calls"] = [_tool_call_json(call) for call in parsed.tool_calls]
        logprobs = None
        if c.logprobs is not None:
            logprobs = {"content": chat_logprobs(c.token_ids, c.logprobs, params.logprobs or 0, text)}
        out.append({"index": c.index, "message": message, "logprobs": logprobs,
                    "finish_reason": _finish_reason(c.finish_reason, bool(parsed.tool_calls)),
                    "stop_reason": c.stop_reason})
    response: dict[str, Any] = {
        "id": request_id, "object": "chat.completion", "created": int(time.time()), "model": model,
        "choices": out,
        "usage": usage(len(generation.prompt_token_ids), generation.num_generated, generation.num_cached_tokens),
    }
    if params.prompt_logprobs is not None:
        response["prompt_logprobs"] = prompt_logprobs_json(
            generation.prompt_token_ids, generation.prompt_logprobs, params.prompt_logprobs)
    return JSONResponse(response)


class _ChoiceStream:
    """Parser state of one choice while streaming, folding its events into OpenAI deltas."""

    def __init__(self, parser: OutputParser, policy: ToolPolicy) -> None:
        self.parser = parser
        self.calls: CallFilter = policy.calls(CALL_ID_PREFIX)

    def deltas(self, events: list[ParsedEvent]) -> list[dict[str, Any]]:
        """The chunks' deltas for `events`: text and argument fragments merge, and each call's start (index,
        id, name) gets a delta of its own, as OpenAI streams it."""
        out: list[dict[str, Any]] = []
        current: dict[str, Any] = {}
        passed = self.calls(events)
        index = len(self.calls.calls) - 1 - sum(isinstance(item, ToolCallStart) for item in passed)
        for item in passed:
            if isinstance(item, TextPiece):
                key = "reasoning_content" if item.kind == "reasoning" else "content"
                current[key] = current.get(key, "") + item.text
            elif isinstance(item, ToolCallStart):
                index += 1
                out += [current] if current else []
                out.append({"tool_calls": [{"index": index, "id": item.call_id, "type": "function",
                                            "function": {"name": item.name, "arguments": ""}}]})
                current = {}
            elif current.get("tool_calls") and current["tool_calls"][-1]["index"] == index:
                current["tool_calls"][-1]["function"]["arguments"] += item.text
            else:
                current.setdefault("tool_calls", []).append({"index": index, "function": {"arguments": item.text}})
        return out + [current] if current else out


async def _stream(
    state: ServerState, generation: Generation, policy: ToolPolicy, model: str, include_usage: bool,
    continuous_usage: bool = False, thinking: bool = True,
) -> AsyncIterator[str]:
    """The SSE stream; with `continuous_usage` (vLLM's `continuous_usage_stats`) every chunk carries the
    usage so far, which lets a client count tokens per chunk rather than chunks."""
    params = generation.params
    reasoning = state.settings.reasoning_parser
    streams = [_ChoiceStream(policy.output_parser(reasoning, thinking=thinking), policy) for _ in range(params.n)]
    text = TokenText(state.engine.tokenizer)
    head = {"id": generation.request_id, "object": "chat.completion.chunk", "created": int(time.time()), "model": model}

    sent_tokens = 0  # output tokens in the chunks sent so far: what a chunk's continuous usage counts

    def chunk(index: int, delta: dict[str, Any], logprobs: Any = None, finish: str | None = None,
              stop_reason: int | str | None = None) -> str:
        choice = {"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}
        if finish is not None:
            choice["stop_reason"] = stop_reason
        if continuous_usage:
            return sse.data({**head, "choices": [choice], "usage": usage(
                len(generation.prompt_token_ids), sent_tokens, generation.num_cached_tokens)})
        return sse.data({**head, "choices": [choice]})

    try:
        for index in range(params.n):
            yield chunk(index, {"role": "assistant", "content": ""})
        async for update in generation.deltas():
            for piece in update.deltas:
                sent_tokens += len(piece.token_ids)
                stream = streams[piece.index]
                finishing = piece.finish_reason is not None
                deltas = stream.deltas(stream.parser.feed(piece.text) + (stream.parser.finish() if finishing else []))
                finish = None
                if finishing:
                    stream.calls.check()
                    finish = _finish_reason(piece.finish_reason, bool(stream.calls.calls))
                logprobs = None
                if piece.logprobs is not None:
                    logprobs = {"content": chat_logprobs(piece.token_ids, piece.logprobs, params.logprobs or 0, text)}
                for delta in deltas[:-1]:
                    yield chunk(piece.index, delta)
                last = deltas[-1] if deltas else {}
                if last or logprobs is not None or finish is not None:
                    yield chunk(piece.index, last, logprobs, finish, piece.stop_reason)
        if include_usage:
            yield sse.data({**head, "choices": [], "usage": usage(
                len(generation.prompt_token_ids), generation.num_generated, generation.num_cached_tokens)})
    except Exception as exc:  # the status line is sent: report in-band, as OpenAI does
        yield sse.data(openai_body(from_exception(exc)))
    finally:
        await generation.close()
    yield sse.DONE
