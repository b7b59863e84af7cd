"""Responses API items → the message dicts chat templates expect (as `conversation.py` does for chat).

A response's output items (reasoning, message, function calls) are sent
back as input items on the next turn, or found through
`previous_response_id`; they fold back into the one assistant turn the model
wrote (`reasoning_content`, `content`, `tool_calls`, in that order), so the
next prompt renders those turns to the tokens the model wrote and the
prefix cache keeps hitting across an agent's turns. A `function_call_output`
becomes a tool turn; it carries the function's name where the call is in the
conversation, for templates that name the tool.
"""

from __future__ import annotations

from typing import Any

from tokenspeed.api.canonical_json import arguments_for_template
from tokenspeed.api.conversation import Conversation
from tokenspeed.api.protocol.responses import ContentPart, InputItem
from tokenspeed.errors import InvalidRequest

_JOIN = "\n"
_TEXT_PARTS = ("input_text", "output_text", "text", "reasoning_text", "summary_text")


def _text(parts: str | list[ContentPart] | None, where: str) -> str:
    if parts is None or isinstance(parts, str):
        return parts or ""
    texts = []
    for part in parts:
        if part.type == "refusal" and part.refusal is not None:
            texts.append(part.refusal)
        elif part.type in _TEXT_PARTS and part.text is not None:
            texts.append(part.text)
        else:
            raise InvalidRequest(f"{where}: content of type {part.type!r} is not supported (text-only model).")
    return _JOIN.join(texts)


def _assistant_turn(out: Conversation, after: tuple[str, ...]) -> dict[str, Any]:
    """The assistant turn being built, if it has nothing in `after` yet (parts come in the order written);
    else a new one."""
    last = out[-1] if out else None
    if last is not None and last["role"] == "assistant" and not any(last.get(k) for k in after):
        return last
    turn: dict[str, Any] = {"role": "assistant", "content": None}
    out.append(turn)
    return turn


def items_conversation(items: list[InputItem]) -> Conversation:
    out: Conversation = []
    call_names: dict[str, str] = {}
    for position, item in enumerate(items):
        where = f"input[{position}]"
        if item.type == "message":
            if item.role is None:
                raise InvalidRequest(f"{where}: a message needs a role.")
            text = _text(item.content, where)
            if item.role == "assistant":
                _assistant_turn(out, ("content", "tool_calls"))["content"] = text
            else:
                out.append({"role": "system" if item.role == "developer" else item.role, "content": text})
        elif item.type == "reasoning":
            reasoning = _text(item.content, where) if item.content else ""
            if reasoning:  # a summary or encrypted reasoning is not what the model wrote: nothing to render
                _assistant_turn(out, ("reasoning_content", "content", "tool_calls"))["reasoning_content"] = reasoning
        elif item.type == "function_call":
            if not item.name or item.call_id is None or item.arguments is None:
                raise InvalidRequest(f"{where}: a function_call needs name, call_id and arguments.")
            call_names[item.call_id] = item.name
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": arguments_for_template(item.arguments)}}
            _assistant_turn(out, ()).setdefault("tool_calls", []).append(call)
        elif item.type == "function_call_output":
            if item.call_id is None or item.output is None:
                raise InvalidRequest(f"{where}: a function_call_output needs call_id and output.")
            turn = {"role": "tool", "tool_call_id": item.call_id, "content": _text(item.output, where)}
            if item.call_id in call_names:
                turn["name"] = call_names[item.call_id]
            out.append(turn)
        else:
            raise InvalidRequest(f"{where}: input items of type {item.type!r} are not supported.")
    return out
