"""Incremental detokenisation with stop strings.

Decoding the whole output after every token is quadratic; decoding each token
alone breaks multi-byte characters and tokenizers that drop a leading space.
We decode a short sliding window instead (a few tokens of context plus the
new ones) and emit only text that is complete — not ending in U+FFFD, the
marker of a half-decoded UTF-8 sequence.

Stop strings are matched on the text as it grows; the match and everything
after it are cut (unless `include_stop_str_in_output`). A streaming front end
must not emit text that a stop string may still cut: `stable_length()` leaves
out the longest tail of the text that could be the start of a stop string, so
the streamed text always equals the final (non-streamed) text.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

_CONTEXT_TOKENS = 6  # prompt tokens used as decoding context for the first output tokens


@dataclass(slots=True)
class StopStringMatch:
    stop: str


class IncrementalDetokenizer:
    def __init__(
        self,
        tokenizer: Any,
        prompt_token_ids: list[int],
        *,
        skip_special_tokens: bool = True,
        stop: list[str] | None = None,
        include_stop_str_in_output: bool = False,
    ) -> None:
        self.tokenizer = tokenizer
        self.skip_special_tokens = skip_special_tokens
        self.stop = stop or []
        self.include_stop = include_stop_str_in_output
        self._tokens: list[int] = list(prompt_token_ids[-_CONTEXT_TOKENS:])
        self._prefix_offset = 0
        self._read_offset = len(self._tokens)
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        text: str = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special_tokens)
        return text

    def push(self, token_ids: list[int]) -> StopStringMatch | None:
        """Add tokens; return the stop string that ended the text, if one appeared."""
        for token_id in token_ids:
            self._tokens.append(token_id)
            prefix_text = self._decode(self._tokens[self._prefix_offset : self._read_offset])
            full_text = self._decode(self._tokens[self._prefix_offset :])
            if len(full_text) <= len(prefix_text) or full_text.endswith("\ufffd"):
                continue  # incomplete character (or nothing visible yet): wait for more tokens
            before = len(self.text)
            self.text += full_text[len(prefix_text) :]
            self._prefix_offset = self._read_offset
            self._read_offset = len(self._tokens)
            match = self._find_stop(before)
            if match is not None:
                return match
        return None

    def stable_length(self) -> int:
        """Characters of `text` no later token can retract: all but a tail that may begin a stop string."""
        text = self.text
        held = 0
        for stop in self.stop:
            for k in range(min(len(stop) - 1, len(text)), held, -1):
                if text.endswith(stop[:k]):
                    held = k
                    break
        return len(text) - held

    def _find_stop(self, new_text_start: int) -> StopStringMatch | None:
        best: tuple[int, str] | None = None
        for stop in self.stop:
            index = self.text.find(stop, max(0, new_text_start - len(stop) + 1))
            if index != -1 and (best is None or index < best[0]):
                best = (index, stop)
        if best is None:
            return None
        index, stop = best
        self.text = self.text[: index + len(stop)] if self.include_stop else self.text[:index]
        return StopStringMatch(stop)
