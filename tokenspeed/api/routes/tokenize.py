"""`POST /tokenize` and `/detokenize` (vLLM's shapes): what the server would feed the engine.

`/tokenize` accepts either a raw `prompt` or chat `messages` (+ `tools`),
rendered exactly as `/v1/chat/completions` renders them, which lets agents
and tests check prompt lengths and the byte stability of multi-turn history.
"""

from __future__ import annotations

import functools
from typing import Any

import anyio
from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse
from pydantic import ConfigDict, model_validator

from tokenspeed.api.conversation import openai_conversation, openai_tools
from tokenspeed.api.protocol.openai import ChatMessage, ChatTool
from tokenspeed.api.protocol.strict import RequestBody, TokenId
from tokenspeed.api.state import get_state
from tokenspeed.errors import InvalidRequest

router = APIRouter()


class TokenizeRequest(RequestBody):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = None
    add_special_tokens: bool = False
    messages: list[ChatMessage] | None = None
    tools: list[ChatTool] | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give exactly one of prompt and messages")
        return self


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[TokenId]


@router.post("/tokenize")
async def tokenize(body: TokenizeRequest, request: Request) -> JSONResponse:
    state = get_state(request)
    state.check_model(body.model)
    if body.messages is not None:
        tokens = (await state.render(
            openai_conversation(body.messages),
            tools=openai_tools(body.tools),
            add_generation_prompt=body.add_generation_prompt and not body.continue_final_message,
            continue_final_message=body.continue_final_message,
            template_kwargs=body.chat_template_kwargs,
        )).token_ids
    else:
        assert body.prompt is not None
        encode = functools.partial(state.engine.tokenizer.encode, add_special_tokens=body.add_special_tokens)
        tokens = list(await anyio.to_thread.run_sync(encode, body.prompt))
    return JSONResponse({"tokens": tokens, "count": len(tokens), "max_model_len": state.engine.max_model_len})


@router.post("/detokenize")
async def detokenize(body: DetokenizeRequest, request: Request) -> JSONResponse:
    state = get_state(request)
    state.check_model(body.model)
    vocab = state.engine.vocab_size
    bad = [t for t in body.tokens if not 0 <= t < vocab]
    if bad:
        raise InvalidRequest(f"Token ids must be in [0, {vocab}); got {bad[:5]}.")
    return JSONResponse({"prompt": state.engine.tokenizer.decode(body.tokens)})
