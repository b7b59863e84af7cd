"""`POST /v1/messages` and `/v1/messages/count_tokens`: Anthropic's Messages API.

The conversation is normalised into the same template messages as OpenAI's
(`conversation.py`), so an agent gets the same prompt, and the same prefix
cache hits, whichever API it speaks. Output events from `OutputParser` map
one-to-one onto content blocks: reasoning → `thinking`, answer → `text`,
each call → `tool_use`, in the order the model wrote them; streaming opens
and closes a block whenever the kind changes, and a call's `tool_use` block
opens when its name is known and receives its arguments as
`input_json_delta`s while the model writes them.

Usage follows Anthropic's accounting: `input_tokens` excludes the prompt
tokens read from the prefix cache, which are reported as
`cache_read_input_tokens`.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenspeed.api import sse
from tokenspeed.api.conversation import anthropic_conversation, anthropic_tools
from tokenspeed.api.errors import anthropic_body, from_exception
from tokenspeed.api.generation import Generation, collect
from tokenspeed.api.openai_format import new_id
from tokenspeed.api.parsers import ParsedEvent, ToolCallArguments, ToolCallStart
from tokenspeed.api.protocol.anthropic import CountTokensRequest, MessagesRequest
from tokenspeed.api.sampling import messages_params
from tokenspeed.api.state import ServerState, get_state
from tokenspeed.api.templating import RenderedPrompt
from tokenspeed.api.tool_policy import CallFilter, ToolPolicy, tool_policy

router = APIRouter()

_CHOICES = {"auto": "auto", "any": "required", "none": "none", "tool": None}


async def _prepare(
    state: ServerState, body: CountTokensRequest, *, counting: bool = False
) -> tuple[RenderedPrompt, ToolPolicy]:
    """The rendered prompt and tool policy. Counting needs no tool-call parser: without one, the prompt is
    counted as rendered with the tools, and no forced tool-call opening is added."""
    tools = anthropic_tools(body.tools)
    choice = body.tool_choice
    if counting and state.settings.tool_call_parser is None:
        policy = ToolPolicy()
    else:
        policy = tool_policy(
            tools,
            _CHOICES[choice.type] if choice is not None else None,
            choice.name if choice is not None and choice.type == "tool" else None,
            parser_name=state.settings.tool_call_parser,
            parallel=not (choice is not None and choice.disable_parallel_tool_use),
            token_markers=state.added_tokens,
        )
    conversation = anthropic_conversation(body.system, body.messages)
    prefill = conversation[-1]["role"] == "assistant"
    kwargs = {"enable_thinking": body.thinking.type != "disabled"} if body.thinking is not None else None
    prompt = await state.render(
        conversation, tools=tools, add_generation_prompt=not prefill, continue_final_message=prefill,
        template_kwargs=kwargs, forced_prefix=policy.forced_prefix,
    )
    return prompt, policy


def _stop(finish_reason: str | None, stop_reason: int | str | None, has_calls: bool) -> tuple[str, str | None]:
    if finish_reason == "length":
        return "max_tokens", None
    if has_calls:
        return "tool_use", None
    if isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return "end_turn", None


def _usage(generation: Generation) -> dict[str, int]:
    """Cached tokens come from any KV tier. With `cache_control` breakpoints (a retained session, whose
    ttl they set) the uncached part of the prompt is what this turn writes to the cache."""
    cached = generation.num_cached_tokens
    uncached = len(generation.prompt_token_ids) - cached
    writes = uncached if generation.params.cache_ttl is not None else 0
    return {"input_tokens": uncached - writes, "output_tokens": generation.num_generated,
            "cache_read_input_tokens": cached, "cache_creation_input_tokens": writes}


TOOL_ID_PREFIX = "toolu_"


def _input(arguments: str) -> dict[str, Any]:
    """A call's arguments as a `tool_use` input, which must be an object (`{}` for a call cut off inside them)."""
    try:
        value = json.loads(arguments)
    except ValueError:
        return {}
    return value if isinstance(value, dict) else {}


def _blocks(events: list[ParsedEvent]) -> list[dict[str, Any]]:
    blocks: list[dict[str, Any]] = []
    for item in events:
        if isinstance(item, ToolCallStart):
            blocks.append({"type": "tool_use", "id": item.call_id, "name": item.name, "input": ""})
            continue
        if isinstance(item, ToolCallArguments):
            blocks[-1]["input"] += item.text
            continue
        kind, field = ("thinking", "thinking") if item.kind == "reasoning" else ("text", "text")
        if blocks and blocks[-1]["type"] == kind:
            blocks[-1][field] += item.text
        else:
            blocks.append({"type": kind, field: item.text, **({"signature": ""} if kind == "thinking" else {})})
    for block in blocks:
        if block["type"] == "tool_use":
            block["input"] = _input(block["input"])
    return blocks


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: CountTokensRequest, request: Request) -> Response:
    state = get_state(request)
    state.check_model(body.model)
    prompt, _ = await _prepare(state, body, counting=True)
    return JSONResponse({"input_tokens": len(prompt.token_ids)})


@router.post("/v1/messages")
async def create_message(body: MessagesRequest, request: Request) -> Response:
    state = get_state(request)
    model = state.check_model(body.model)
    prompt, policy = await _prepare(state, body)
    params = messages_params(body, policy.grammar)
    message_id = new_id("msg_")
    generation = await sse.cancel_on_disconnect(
        request, state.start_generation(message_id, prompt.token_ids, params, parsed=state.parses_output(policy))
    )
    thinking = body.thinking is None or body.thinking.type != "disabled"
    if body.stream:
        return sse.response(_stream(state, generation, policy, model, thinking))
    (choice,) = await sse.cancel_on_disconnect(request, collect(generation))
    parser = policy.output_parser(state.settings.reasoning_parser, thinking=thinking)
    calls = policy.calls(TOOL_ID_PREFIX)
    events = calls(parser.feed(choice.text) + parser.finish())
    calls.check()
    blocks = _blocks(events)
    has_calls = any(b["type"] == "tool_use" for b in blocks)
    stop_reason, stop_sequence = _stop(choice.finish_reason, choice.stop_reason, has_calls)
    return JSONResponse({
        "id": message_id, "type": "message", "role": "assistant", "model": model, "content": blocks,
        "stop_reason": stop_reason, "stop_sequence": stop_sequence, "usage": _usage(generation),
    })


class _BlockWriter:
    """Turns parser events into Anthropic's content_block_* events, opening a block per change of kind."""

    def __init__(self, calls: CallFilter) -> None:
        self.calls = calls
        self.index = -1
        self.open_kind: str | None = None

    def write(self, events: list[ParsedEvent]) -> list[str]:
        out: list[str] = []
        for item in self.calls(events):
            if isinstance(item, ToolCallStart):
                block: dict[str, Any] = {"type": "tool_use", "id": item.call_id, "name": item.name, "input": {}}
                out += self._open("tool_use", block)
            elif isinstance(item, ToolCallArguments):
                out.append(self._delta({"type": "input_json_delta", "partial_json": item.text}))
            elif item.kind == "reasoning":
                if self.open_kind != "thinking":
                    out += self._open("thinking", {"type": "thinking", "thinking": "", "signature": ""})
                out.append(self._delta({"type": "thinking_delta", "thinking": item.text}))
            else:
                if self.open_kind != "text":
                    out += self._open("text", {"type": "text", "text": ""})
                out.append(self._delta({"type": "text_delta", "text": item.text}))
        return out

    def close(self) -> list[str]:
        if self.open_kind is None:
            return []
        self.open_kind = None
        return [sse.event("content_block_stop", {"type": "content_block_stop", "index": self.index})]

    def _open(self, kind: str, block: dict[str, Any]) -> list[str]:
        out = self.close()
        self.index += 1
        self.open_kind = kind
        out.append(sse.event("content_block_start", {"type": "content_block_start", "index": self.index,
                                                      "content_block": block}))
        return out

    def _delta(self, delta: dict[str, Any]) -> str:
        return sse.event("content_block_delta", {"type": "content_block_delta", "index": self.index, "delta": delta})


async def _stream(
    state: ServerState, generation: Generation, policy: ToolPolicy, model: str, thinking: bool
) -> AsyncIterator[str]:
    parser = policy.output_parser(state.settings.reasoning_parser, thinking=thinking)
    writer = _BlockWriter(policy.calls(TOOL_ID_PREFIX))
    usage = _usage(generation)
    start: dict[str, Any] = {"id": generation.request_id, "type": "message", "role": "assistant", "model": model, "content": [],
             "stop_reason": None, "stop_sequence": None, "usage": {**usage, "output_tokens": 0}}
    try:
        yield sse.event("message_start", {"type": "message_start", "message": start})
        finish: tuple[str | None, int | str | None] = (None, None)
        async for update in generation.deltas():
            for piece in update.deltas:
                for line in writer.write(parser.feed(piece.text)):
                    yield line
                if piece.finish_reason is not None:
                    finish = (piece.finish_reason, piece.stop_reason)
        for line in writer.write(parser.finish()) + writer.close():
            yield line
        writer.calls.check()
        stop_reason, stop_sequence = _stop(finish[0], finish[1], bool(writer.calls.calls))
        yield sse.event("message_delta", {"type": "message_delta",
                                          "delta": {"stop_reason": stop_reason, "stop_sequence": stop_sequence},
                                          "usage": _usage(generation)})
        yield sse.event("message_stop", {"type": "message_stop"})
    except Exception as exc:
        yield sse.event("error", anthropic_body(from_exception(exc)))
    finally:
        await generation.close()
