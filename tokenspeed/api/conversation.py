"""OpenAI and Anthropic conversations → the message dicts chat templates expect.

Templates are written against one shape (HF's: `role`, `content` string,
`reasoning_content`, `tool_calls[].function.{name, arguments}`, tool turns
with `tool_call_id`), so both APIs are normalised into it here and templating
stays API-agnostic. Every conversion is a pure function of the request's
content (no ids, clocks or counters), which is what keeps rendering
byte-stable across the turns of an agent session. Text-only: image, audio
and document parts are refused with a 400 rather than silently dropped.
"""

from __future__ import annotations

from typing import Any

from tokenspeed.api.canonical_json import arguments_for_template
from tokenspeed.api.protocol import anthropic, openai
from tokenspeed.errors import InvalidRequest

_JOIN = "\n"  # text parts of one message are joined by newlines (vLLM's convention)

Conversation = list[dict[str, Any]]


def _text_parts(parts: list[openai.ContentPart] | list[anthropic.Block], where: str) -> str:
    texts: list[str] = []
    for part in parts:
        if part.type != "text" or part.text is None:
            raise InvalidRequest(f"{where}: content of type {part.type!r} is not supported (text-only model).")
        texts.append(part.text)
    return _JOIN.join(texts)


# ---- OpenAI -----------------------------------------------------------------------------


def _openai_content(content: str | list[openai.ContentPart] | None, where: str) -> str | None:
    if content is None or isinstance(content, str):
        return content
    return _text_parts(content, where)


def openai_conversation(messages: list[openai.ChatMessage]) -> Conversation:
    out: Conversation = []
    for position, message in enumerate(messages):
        where = f"messages[{position}]"
        role = "system" if message.role == "developer" else message.role
        entry: dict[str, Any] = {"role": role, "content": _openai_content(message.content, where)}
        if message.role == "tool":
            if entry["content"] is None:
                raise InvalidRequest(f"{where}: a tool message needs content.")
            entry["tool_call_id"] = message.tool_call_id
        if message.name is not None:
            entry["name"] = message.name
        if message.role == "assistant":
            if message.reasoning_content:
                entry["reasoning_content"] = message.reasoning_content
            if message.tool_calls:
                entry["tool_calls"] = [
                    {
                        "id": call.id,
                        "type": "function",
                        "function": {
                            "name": call.function.name,
                            "arguments": arguments_for_template(call.function.arguments),
                        },
                    }
                    for call in message.tool_calls
                ]
        elif message.tool_calls:
            raise InvalidRequest(f"{where}: only assistant messages may carry tool_calls.")
        elif entry["content"] is None:
            raise InvalidRequest(f"{where}: a {message.role} message needs content.")
        out.append(entry)
    return out


def openai_tools(tools: list[openai.ChatTool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    return [tool.model_dump(exclude_none=True) for tool in tools]


# ---- Anthropic --------------------------------------------------------------------------


def _anthropic_text(content: str | list[anthropic.Block] | None, where: str) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return _text_parts(content, where)


def anthropic_conversation(
    system: str | list[anthropic.Block] | None, messages: list[anthropic.Message]
) -> Conversation:
    out: Conversation = []
    if system:
        out.append({"role": "system", "content": _anthropic_text(system, "system")})
    for position, message in enumerate(messages):
        where = f"messages[{position}]"
        if isinstance(message.content, str):
            out.append({"role": message.role, "content": message.content})
        elif message.role == "assistant":
            out.append(_anthropic_assistant(message.content, where))
        else:
            out.extend(_anthropic_user(message.content, where))
    return out


def _anthropic_assistant(blocks: list[anthropic.Block], where: str) -> dict[str, Any]:
    texts: list[str] = []
    thinking: list[str] = []
    calls: list[dict[str, Any]] = []
    for block in blocks:
        if block.type == "text":
            texts.append(block.text or "")
        elif block.type == "thinking":
            thinking.append(block.thinking or "")
        elif block.type == "redacted_thinking":
            continue  # opaque to us: nothing to render
        elif block.type == "tool_use":
            if not block.name:
                raise InvalidRequest(f"{where}: a tool_use block needs a name.")
            calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": block.input or {}},
                }
            )
        else:
            raise InvalidRequest(f"{where}: assistant content of type {block.type!r} is not supported.")
    entry: dict[str, Any] = {"role": "assistant", "content": _JOIN.join(texts)}
    if thinking:
        entry["reasoning_content"] = _JOIN.join(thinking)
    if calls:
        entry["tool_calls"] = calls
    return entry


def _anthropic_user(blocks: list[anthropic.Block], where: str) -> Conversation:
    """Tool results become tool turns; runs of text blocks become user turns, in order."""
    out: Conversation = []
    texts: list[str] = []
    for block in blocks:
        if block.type == "tool_result":
            if texts:
                out.append({"role": "user", "content": _JOIN.join(texts)})
                texts = []
            out.append(
                {
                    "role": "tool",
                    "tool_call_id": block.tool_use_id,
                    "content": _anthropic_text(block.content, f"{where} tool_result"),
                }
            )
        elif block.type == "text":
            texts.append(block.text or "")
        else:
            raise InvalidRequest(f"{where}: user content of type {block.type!r} is not supported (text-only model).")
    if texts or not out:
        out.append({"role": "user", "content": _JOIN.join(texts)})
    return out


def anthropic_tools(tools: list[anthropic.Tool] | None) -> list[dict[str, Any]] | None:
    if not tools:
        return None
    converted = []
    for tool in tools:
        if tool.type not in (None, "custom"):
            raise InvalidRequest(f"Server tool {tool.name!r} of type {tool.type!r} is not supported.")
        function: dict[str, Any] = {"name": tool.name}
        if tool.description is not None:
            function["description"] = tool.description
        function["parameters"] = tool.input_schema
        converted.append({"type": "function", "function": function})
    return converted
