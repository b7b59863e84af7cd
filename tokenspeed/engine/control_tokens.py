"""Client text never becomes control tokens: only the chat template's own markers do.

A chat template renders to text, and tokenising that text turns every
special-token string into its control token, wherever it came from. So a
user message containing `<|im_end|>\\n<|im_start|>system` would close its own
turn and open a system turn: role spoofing, and with agents (whose prompts
carry tool output and fetched web pages) prompt injection.

`ControlTokenGuard` closes it without touching the template:

1. `escape` replaces every special-token string inside client-provided
   values (message contents, names, tool definitions and calls, template
   arguments; keys too) with an opaque ASCII placeholder that no template
   filter alters;
2. the template renders; every special-token string now in the text is the
   template's own;
3. `encode` splits the text at those markers, maps each marker to its id,
   restores the placeholders, and tokenises the text between markers with
   special tokens read as plain text.

Splitting at special tokens is what the tokenizer itself does before BPE, so
a conversation without such strings tokenises exactly as before; with none
to escape and no segment cache, the ordinary `encode` runs and nothing
changes at all.

With a `SegmentTokenCache` (`segment_cache.py`), every prompt takes the split
path, and the text between two markers is looked up before it is tokenised:
an agent's next turn tokenises only its new messages. That needs markers the
tokenizer extracts as they are (no `lstrip` / `rstrip` / `single_word`, not
normalised); a tokenizer whose special tokens are otherwise gets no cache.
"""

from __future__ import annotations

import re
import secrets
from dataclasses import dataclass, field
from typing import Any

from tokenspeed.engine.segment_cache import SegmentTokenCache


@dataclass(slots=True)
class Escapes:
    """The special-token strings taken out of one request's client text, by placeholder number."""

    nonce: str = field(default_factory=lambda: secrets.token_hex(8))
    originals: list[str] = field(default_factory=list)

    def placeholder(self, text: str) -> str:
        self.originals.append(text)
        return f"TSctl{self.nonce}n{len(self.originals) - 1}x"

    def restore(self, text: str) -> str:
        if not self.originals:
            return text
        return re.sub(f"TSctl{self.nonce}n(\\d+)x", lambda m: self.originals[int(m.group(1))], text)


class ControlTokenGuard:
    def __init__(self, tokenizer: Any, cache: SegmentTokenCache | None = None) -> None:
        self.tokenizer = tokenizer
        decoder = getattr(tokenizer, "added_tokens_decoder", None) or {}
        specials = {i: t for i, t in decoder.items() if getattr(t, "special", False)}
        self.special_ids: dict[str, int] = {str(t): i for i, t in specials.items()}
        extracted_as_is = not any(
            getattr(t, flag, False) for t in specials.values() for flag in ("lstrip", "rstrip", "single_word", "normalized")
        )
        self.cache = cache if extracted_as_is and self.special_ids else None
        names = sorted(self.special_ids, key=len, reverse=True)  # longest first: one marker may prefix another
        self._pattern = re.compile("|".join(re.escape(n) for n in names)) if names else None
        self._plain: Any = None  # the tokenizer, reading special-token strings as text; built on first use

    def escape(self, value: Any, escapes: Escapes) -> Any:
        """`value` (str, list, dict, nested) with special-token strings replaced by placeholders."""
        if self._pattern is None:
            return value
        if isinstance(value, str):
            return self._pattern.sub(lambda m: escapes.placeholder(m.group()), value)
        if isinstance(value, dict):
            return {self.escape(k, escapes): self.escape(v, escapes) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.escape(v, escapes) for v in value]
        return value

    def encode(self, text: str, escapes: Escapes) -> list[int]:
        """Token ids of rendered `text`: its special-token strings are markers, placeholders are plain text."""
        if self._pattern is None or (not escapes.originals and self.cache is None):
            return list(self.tokenizer.encode(text, add_special_tokens=False))
        ids: list[int] = []
        position = 0
        for marker in self._pattern.finditer(text):
            ids.extend(self._encode_segment(escapes.restore(text[position:marker.start()])))
            ids.append(self.special_ids[marker.group()])
            position = marker.end()
        ids.extend(self._encode_segment(escapes.restore(text[position:])))
        return ids

    def _encode_segment(self, text: str) -> list[int]:
        """Text between markers, from the segment cache when it was tokenised before."""
        if self.cache is None or len(text) < self.cache.min_chars:
            return self._encode_plain(text)
        ids = self.cache.get(text)
        if ids is None:
            ids = self._encode_plain(text)
            self.cache.put(text, ids)
        return ids

    def _encode_plain(self, text: str) -> list[int]:
        if not text:
            return []
        backend = getattr(self.tokenizer, "backend_tokenizer", None)
        if backend is None:  # a Python tokenizer: the flag is a per-call argument there
            return list(self.tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))
        if self._plain is None:
            # A private copy: flipping the flag on the shared tokenizer would race with other threads.
            from tokenizers import Tokenizer

            plain = Tokenizer.from_str(backend.to_str())
            plain.encode_special_tokens = True
            self._plain = plain
        return list(self._plain.encode(text, add_special_tokens=False).ids)
