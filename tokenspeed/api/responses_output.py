"""Parser events → Responses output items, and the typed stream events that build them.

Reasoning becomes a `reasoning` item (its text as `reasoning_text`
content), answer text a `message` item with one `output_text` part, and each
tool call a `function_call` item, in the order the model wrote them. While
streaming, each item goes through its OpenAI lifecycle:

    response.output_item.added
      response.content_part.added                    (message, reasoning)
        response.output_text.delta / response.reasoning_text.delta / response.function_call_arguments.delta ...
      response.output_text.done / response.reasoning_text.done / response.function_call_arguments.done
      response.content_part.done
    response.output_item.done

every event numbered by `sequence_number`. A non-streaming response builds
the same items from the same events, so both modes agree by construction.
"""

from __future__ import annotations

from typing import Any

from tokenspeed.api import sse
from tokenspeed.api.openai_format import new_id
from tokenspeed.api.parsers import ParsedEvent, TextPiece, ToolCallArguments, ToolCallStart

_PARTS = {"message": "output_text", "reasoning": "reasoning_text"}  # item type -> its content part type


class OutputItems:
    def __init__(self, *, streaming: bool) -> None:
        self._streaming = streaming  # False: only the items are wanted, no stream events are built
        self.items: list[dict[str, Any]] = []
        self._open: dict[str, Any] | None = None
        self._sequence = 0

    def add(self, events: list[ParsedEvent]) -> list[str]:
        """Fold `events` into the items; return the stream events that say so."""
        out: list[str] = []
        for event in events:
            if isinstance(event, ToolCallStart):
                out += self._start({"id": new_id("fc_")[:27], "type": "function_call", "status": "in_progress",
                                    "call_id": event.call_id, "name": event.name, "arguments": ""})
            elif isinstance(event, ToolCallArguments):
                assert self._open is not None and self._open["type"] == "function_call"
                self._open["arguments"] += event.text
                out.append(self._event("response.function_call_arguments.delta", self._open, delta=event.text))
            else:
                out += self._text(event)
        return out

    def close(self, status: str = "completed") -> list[str]:
        """Finish the open item (`status` "incomplete" when the output was cut off)."""
        item, self._open = self._open, None
        if item is None:
            return []
        index = len(self.items) - 1
        done: list[str] = []
        if item["type"] == "function_call":
            done.append(self._event("response.function_call_arguments.done", item, index=index,
                                    arguments=item["arguments"], name=item["name"]))
        else:
            part = item["content"][0]
            kind = "response.output_text.done" if item["type"] == "message" else "response.reasoning_text.done"
            extra: dict[str, Any] = {"logprobs": []} if item["type"] == "message" else {}
            done.append(self._event(kind, item, index=index, content_index=0, text=part["text"], **extra))
            done.append(self._event("response.content_part.done", item, index=index, content_index=0, part=part))
        item["status"] = status
        done.append(self.event("response.output_item.done", output_index=index, item=item))
        return done

    def event(self, kind: str, **fields: Any) -> str:
        """A stream event outside any item (`response.created`, ...), numbered in sequence."""
        payload = {"type": kind, "sequence_number": self._sequence, **fields}
        self._sequence += 1
        return sse.event(kind, payload) if self._streaming else ""

    def _text(self, piece: TextPiece) -> list[str]:
        kind = "reasoning" if piece.kind == "reasoning" else "message"
        out: list[str] = []
        if self._open is None or self._open["type"] != kind:
            item: dict[str, Any] = {"id": new_id("rs_" if kind == "reasoning" else "msg_")[:28], "type": kind,
                                    "status": "in_progress", "content": []}
            if kind == "message":
                item["role"] = "assistant"
            else:
                item["summary"] = []
            out += self._start(item)
            part: dict[str, Any] = {"type": _PARTS[kind], "text": ""}
            if kind == "message":
                part.update(annotations=[], logprobs=[])
            out.append(self._event("response.content_part.added", item, content_index=0, part=part))
            item["content"].append(part)
        assert self._open is not None
        self._open["content"][0]["text"] += piece.text
        delta = "response.output_text.delta" if kind == "message" else "response.reasoning_text.delta"
        extra: dict[str, Any] = {"logprobs": []} if kind == "message" else {}
        out.append(self._event(delta, self._open, content_index=0, delta=piece.text, **extra))
        return out

    def _start(self, item: dict[str, Any]) -> list[str]:
        out = self.close()
        self.items.append(item)
        self._open = item
        out.append(self.event("response.output_item.added", output_index=len(self.items) - 1, item=item))
        return out

    def _event(self, kind: str, item: dict[str, Any], *, index: int | None = None, **fields: Any) -> str:
        """An event about `item` (the last one unless `index` says otherwise). Events are serialised at once,
        so later changes to the item do not show in them."""
        index = index if index is not None else len(self.items) - 1
        return self.event(kind, output_index=index, item_id=item["id"], **fields)
