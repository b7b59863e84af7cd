"""Chat template rendering and prompt tokenisation for the API.

Rendering goes through the tokenizer's own `apply_chat_template` and then
`encode(..., add_special_tokens=False)`, exactly as the offline `LLM.chat`
does, so the server and `LLM.chat` build the same prompt ids for the same
messages. Byte stability across turns is a property of the template (the
embedded one is written for it) plus `conversation.py`'s deterministic
normalisation; this module adds nothing that varies between turns. A forced
tool-call opening (tool_choice required/named) is appended to the rendered
text here, after the generation prompt. Special-token strings inside client
text are tokenised as plain text (`control_tokens.py`): only the template's
own markers become control tokens. The server keeps the text between markers
tokenised (`--tokenizer-cache-tokens`, `engine/segment_cache.py`), so an
agent's next turn tokenises only its new messages.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tokenspeed.api.conversation import Conversation
from tokenspeed.engine.control_tokens import ControlTokenGuard, Escapes
from tokenspeed.engine.segment_cache import SegmentTokenCache
from tokenspeed.errors import InvalidRequest


@dataclass(slots=True)
class RenderedPrompt:
    text: str
    token_ids: list[int]


def load_chat_template(value: str | None) -> str | None:
    """`--chat-template`: a file path, or the template text itself."""
    if value is None:
        return None
    path = Path(value).expanduser()
    if path.is_file():
        return path.read_text()
    if "{" not in value:
        raise InvalidRequest(f"--chat-template {value!r} is neither a file nor a Jinja template.")
    return value


class ChatRenderer:
    def __init__(self, tokenizer: Any, chat_template: str | None = None, cache_tokens: int = 0) -> None:
        """`cache_tokens`: capacity of the `SegmentTokenCache` of prompt text between control tokens (0: none)."""
        self.tokenizer = tokenizer
        self.chat_template = chat_template
        self.guard = ControlTokenGuard(tokenizer, SegmentTokenCache(cache_tokens) if cache_tokens else None)
        if chat_template is None and not getattr(tokenizer, "chat_template", None):
            self._missing = "The model has no chat template; start the server with --chat-template."
        else:
            self._missing = ""

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def render(
        self,
        conversation: Conversation,
        *,
        tools: list[dict[str, Any]] | None = None,
        add_generation_prompt: bool = True,
        continue_final_message: bool = False,
        template_kwargs: dict[str, Any] | None = None,
        forced_prefix: str = "",
    ) -> RenderedPrompt:
        if self._missing:
            raise InvalidRequest(self._missing)
        if continue_final_message and (add_generation_prompt or conversation[-1]["role"] != "assistant"):
            raise InvalidRequest(
                "continue_final_message needs add_generation_prompt=false and a final assistant message."
            )
        reserved = {"conversation", "tools", "chat_template", "tokenize", "add_generation_prompt"}
        escapes = Escapes()
        kwargs = self.guard.escape({k: v for k, v in (template_kwargs or {}).items() if k not in reserved}, escapes)
        try:
            text = self.tokenizer.apply_chat_template(
                self.guard.escape(conversation, escapes),
                tools=self.guard.escape(tools, escapes),
                chat_template=self.chat_template,
                add_generation_prompt=add_generation_prompt,
                continue_final_message=continue_final_message,
                tokenize=False,
                **kwargs,
            )
        except InvalidRequest:
            raise
        except Exception as exc:  # jinja raises many types (raise_exception, undefined, type errors)
            raise InvalidRequest(f"The chat template could not render these messages: {exc}") from exc
        text = str(text) + forced_prefix
        return RenderedPrompt(escapes.restore(text), self.guard.encode(text, escapes))
