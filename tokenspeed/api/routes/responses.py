"""OpenAI's Responses API: `POST /v1/responses`, `GET` and `DELETE /v1/responses/{id}`.

A request is a chat turn in another shape: `instructions` become the
system message, `input` items (and, with `previous_response_id`, the stored
conversation before them) become the messages (`responses_input.py`), and
function tools go through the same tool policy and parsers as chat, so a
Responses client gets the same prompt, the same prefix-cache hits and the
same tool-call formats. Output items and stream events are built from the
parser events (`responses_output.py`). A response ends `completed`, or
`incomplete` (`max_output_tokens`) when cut off; with `store` (the
default) it is kept for `previous_response_id` and `GET` in a bounded LRU
(`responses_store.py`). Usage reports the prompt tokens read from the prefix
cache as `input_tokens_details.cached_tokens`.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from tokenspeed.api import sse
from tokenspeed.api.errors import APIError, from_exception
from tokenspeed.api.generation import Generation, collect
from tokenspeed.api.openai_format import new_id
from tokenspeed.api.protocol.responses import FunctionChoice, InputItem, ResponsesRequest
from tokenspeed.api.responses_input import items_conversation
from tokenspeed.api.responses_output import OutputItems
from tokenspeed.api.responses_store import StoredResponse
from tokenspeed.api.sampling import response_format_params
from tokenspeed.api.state import ServerState, get_state
from tokenspeed.api.tool_policy import ToolPolicy, tool_policy
from tokenspeed.errors import InvalidRequest
from tokenspeed.scheduler.sampling_params import SamplingParams
from tokenspeed.scheduler.structured_outputs import StructuredOutputsParams

router = APIRouter()

CALL_ID_PREFIX = "call_"


class _Turn:
    """One request's prepared state: everything the response object echoes back."""

    def __init__(self, body: ResponsesRequest, model: str, previous: StoredResponse | None) -> None:
        self.body = body
        self.model = model
        self.previous = previous
        self.id = new_id("resp_")
        self.created = int(time.time())
        self.input = [InputItem(role="user", content=body.input)] if isinstance(body.input, str) else body.input

    def response(self, status: str, output: list[dict[str, Any]], usage: dict[str, Any] | None = None,
                 error: APIError | None = None) -> dict[str, Any]:
        body = self.body
        choice = body.tool_choice
        return {
            "id": self.id, "object": "response", "created_at": self.created, "status": status,
            "completed_at": int(time.time()) if status == "completed" else None,
            "error": {"code": error.code or "server_error", "message": error.message} if error else None,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "instructions": body.instructions, "max_output_tokens": body.max_output_tokens, "model": self.model,
            "output": output, "parallel_tool_calls": body.parallel_tool_calls,
            "previous_response_id": body.previous_response_id, "reasoning": {"effort": None, "summary": None},
            "store": body.store, "temperature": body.temperature, "top_p": body.top_p,
            "text": {"format": _text_format(body)},
            "tool_choice": choice.model_dump() if isinstance(choice, FunctionChoice) else (choice or "auto"),
            "tools": [tool.model_dump(exclude_none=True) for tool in body.tools or []],
            "truncation": "disabled", "usage": usage, "user": body.user, "metadata": body.metadata or {},
        }


def _text_format(body: ResponsesRequest) -> dict[str, Any]:
    fmt = body.text.format if body.text is not None else None
    return {"type": "text"} if fmt is None else fmt.model_dump(by_alias=True, exclude_none=True)


def _check_supported(body: ResponsesRequest) -> None:
    if body.background:
        raise InvalidRequest("background responses are not supported.")
    for position, tool in enumerate(body.tools or []):
        if tool.type != "function" or not tool.name:
            raise InvalidRequest(f"tools[{position}]: only function tools (with a name) are supported, "
                                 f"not {tool.type!r}.")


def _grammar(body: ResponsesRequest, policy: ToolPolicy) -> StructuredOutputsParams | None:
    """`text.format` as a grammar, or the forced tool call's (not both)."""
    fmt = body.text.format if body.text is not None else None
    spec = None if fmt is None else response_format_params(fmt.type, fmt.schema_, "text.format")
    if spec is not None and policy.grammar is not None:
        raise InvalidRequest("A forced tool call and a structured output cannot be asked for together.")
    return spec or policy.grammar


def _tools(body: ResponsesRequest) -> list[dict[str, Any]] | None:
    """Function tools in the chat shape the templates and the tool policy take."""
    if not body.tools:
        return None
    return [{"type": "function", "function": {k: v for k, v in (("name", t.name), ("description", t.description),
                                                                 ("parameters", t.parameters)) if v is not None}}
            for t in body.tools]


def _usage(generation: Generation, reasoning_tokens: int) -> dict[str, Any]:
    prompt, output = len(generation.prompt_token_ids), generation.num_generated
    return {"input_tokens": prompt, "input_tokens_details": {"cached_tokens": generation.num_cached_tokens},
            "output_tokens": output, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": prompt + output}


async def _reasoning_tokens(state: ServerState, items: list[dict[str, Any]]) -> int:
    """The reasoning's length in tokens, re-tokenised (the engine does not count tokens by where they went)."""
    text = "".join(part["text"] for item in items if item["type"] == "reasoning" for part in item["content"])
    return len(await state.encode(text)) if text else 0


@router.post("/v1/responses")
async def create_response(body: ResponsesRequest, request: Request) -> Response:
    state = get_state(request)
    model = state.check_model(body.model)
    _check_supported(body)
    previous = None
    if body.previous_response_id is not None:
        previous = state.responses.get(body.previous_response_id)
        if previous is None:
            raise APIError(400, f"Previous response with id {body.previous_response_id!r} not found.",
                           param="previous_response_id", code="previous_response_not_found")
    turn = _Turn(body, model, previous)
    conversation = items_conversation((previous.history() if previous else []) + turn.input)
    if body.instructions:
        conversation.insert(0, {"role": "system", "content": body.instructions})
    if not conversation:
        raise InvalidRequest("input must not be empty.")
    tools = _tools(body)
    choice = body.tool_choice
    policy = tool_policy(
        tools, None if isinstance(choice, FunctionChoice) else choice,
        choice.name if isinstance(choice, FunctionChoice) else None,
        parser_name=state.settings.tool_call_parser, parallel=body.parallel_tool_calls,
        token_markers=state.added_tokens,
    )
    prompt = await state.render(conversation, tools=tools, forced_prefix=policy.forced_prefix)
    params = SamplingParams(
        temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p,
        max_tokens=body.max_output_tokens,
        logit_bias=body.logit_bias or None,
        structured_outputs=_grammar(body, policy),
    )
    generation = await sse.cancel_on_disconnect(
        request, state.start_generation(turn.id, prompt.token_ids, params, parsed=state.parses_output(policy))
    )
    if body.stream:
        return sse.response(_stream(state, turn, generation, policy))
    (output,) = await sse.cancel_on_disconnect(request, collect(generation))
    items = OutputItems(streaming=False)
    parser = policy.output_parser(state.settings.reasoning_parser)
    calls = policy.calls(CALL_ID_PREFIX)
    items.add(calls(parser.feed(output.text) + parser.finish()))
    calls.check()
    status = "incomplete" if output.finish_reason == "length" else "completed"
    items.close(status)
    response = turn.response(status, items.items, _usage(generation, await _reasoning_tokens(state, items.items)))
    _store(state, turn, response)
    return JSONResponse(response)


def _store(state: ServerState, turn: _Turn, response: dict[str, Any]) -> None:
    if turn.body.store:
        output = [InputItem.model_validate(item) for item in response["output"]]
        state.responses.put(turn.id, StoredResponse(response, turn.input + output, turn.previous))


async def _stream(state: ServerState, turn: _Turn, generation: Generation, policy: ToolPolicy) -> AsyncIterator[str]:
    items = OutputItems(streaming=True)
    parser = policy.output_parser(state.settings.reasoning_parser)
    calls = policy.calls(CALL_ID_PREFIX)
    try:
        yield items.event("response.created", response=turn.response("in_progress", []))
        yield items.event("response.in_progress", response=turn.response("in_progress", []))
        finish_reason: str | None = None
        async for update in generation.deltas():
            for piece in update.deltas:
                for line in items.add(calls(parser.feed(piece.text))):
                    yield line
                finish_reason = piece.finish_reason or finish_reason
        status = "incomplete" if finish_reason == "length" else "completed"
        for line in items.add(calls(parser.finish())) + items.close(status):
            yield line
        calls.check()
        usage = _usage(generation, await _reasoning_tokens(state, items.items))
        response = turn.response(status, items.items, usage)
        _store(state, turn, response)
        yield items.event(f"response.{status}", response=response)
    except Exception as exc:  # the status line is sent: report in-band, as OpenAI does
        error = from_exception(exc)
        yield items.event("error", code=error.code, message=error.message, param=error.param)
        yield items.event("response.failed", response=turn.response("failed", items.items, error=error))
    finally:
        await generation.close()


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, request: Request) -> JSONResponse:
    record = get_state(request).responses.get(response_id)
    if record is None:
        raise APIError(404, f"Response with id {response_id!r} not found.", param="response_id")
    return JSONResponse(record.body)


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, request: Request) -> JSONResponse:
    if not get_state(request).responses.delete(response_id):
        raise APIError(404, f"Response with id {response_id!r} not found.", param="response_id")
    return JSONResponse({"id": response_id, "object": "response.deleted", "deleted": True})
