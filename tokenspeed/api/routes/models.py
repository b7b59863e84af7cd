"""`GET /v1/models`: the names this server answers to (`--served-model-name`)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse

from tokenspeed.api.state import ServerState, get_state

router = APIRouter()


def _card(state: ServerState, name: str) -> dict[str, Any]:
    """OpenAI's model object, plus vLLM's `max_model_len` and the two vocabularies: the ids the model
    can sample (`vocab_size`) and those the tokenizer can decode (`tokenizer_vocab_size`), so a
    benchmark can tell when ids decode to no text (`bench serve` warns)."""
    tokenizer = state.engine.tokenizer
    return {"id": name, "object": "model", "created": state.created, "owned_by": "tokenspeed",
            "root": state.settings.model_name, "max_model_len": state.engine.max_model_len,
            "vocab_size": state.engine.vocab_size,
            "tokenizer_vocab_size": None if tokenizer is None else len(tokenizer)}


@router.get("/v1/models")
async def list_models(request: Request) -> JSONResponse:
    state = get_state(request)
    return JSONResponse({"object": "list", "data": [_card(state, n) for n in state.settings.served_model_names]})


@router.get("/v1/models/{name:path}")
async def get_model(name: str, request: Request) -> JSONResponse:
    state = get_state(request)
    return JSONResponse(_card(state, state.check_model(name)))
