"""`NgramDrafter`: prompt lookup. Propose what followed the last time the current suffix appeared.

For n from `prompt_lookup_max` down to `prompt_lookup_min`, take the request's
last n tokens; if they occurred earlier in its prompt + output, propose the
tokens that followed their most recent earlier occurrence. Agents re-emit what
is in their context (file contents, diffs, tool arguments), so a long exact
match usually continues.

Incremental: per n, a dict maps each n-gram to the position after its most
recent occurrence that has a follower. A new token adds one entry per n
(the n-gram that now has a follower), and a proposal is one lookup per n, so
a step costs O(new tokens * n_max), never O(context). Memory is one entry per
token and n (about 150 bytes each), dropped when the request is released.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field


@dataclass(slots=True)
class _RequestIndex:
    tokens: list[int] = field(default_factory=list)  # prompt + output indexed so far
    # last[i][ngram] = position after the most recent occurrence (with a follower) of an n-gram, n = min_n + i
    last: list[dict[tuple[int, ...], int]] = field(default_factory=list)


class NgramDrafter:
    __slots__ = ("min_n", "max_n", "_requests")

    def __init__(self, prompt_lookup_min: int, prompt_lookup_max: int) -> None:
        if not 1 <= prompt_lookup_min <= prompt_lookup_max:
            raise ValueError(f"need 1 <= prompt_lookup_min ({prompt_lookup_min}) <= prompt_lookup_max "
                             f"({prompt_lookup_max})")
        self.min_n = prompt_lookup_min
        self.max_n = prompt_lookup_max
        self._requests: dict[str, _RequestIndex] = {}

    @property
    def method(self) -> str:
        return "ngram"

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    def propose(
        self, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int], max_tokens: int
    ) -> list[int]:
        index = self._requests.get(request_id)
        if index is None:
            index = self._requests[request_id] = _RequestIndex(last=[{} for _ in range(self.min_n, self.max_n + 1)])
        self._catch_up(index, prompt_token_ids, output_token_ids)
        if max_tokens <= 0:
            return []
        tokens = index.tokens
        end = len(tokens)
        for n in range(min(self.max_n, end - 1), self.min_n - 1, -1):
            follower = index.last[n - self.min_n].get(tuple(tokens[end - n :]))
            if follower is not None:
                return tokens[follower : follower + max_tokens]
        return []

    def release(self, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        self._requests.pop(request_id, None)

    def _catch_up(self, index: _RequestIndex, prompt: Sequence[int], output: Sequence[int]) -> None:
        """Index the tokens appended since the last call."""
        tokens = index.tokens
        seen = len(tokens)
        if seen < len(prompt):
            tokens.extend(prompt[seen:])
            tokens.extend(output)
        else:
            tokens.extend(output[seen - len(prompt) :])
        min_n = self.min_n
        for end in range(max(seen, 1), len(tokens)):  # tokens[end] is new: n-grams ending at end - 1 get it
            for i, table in enumerate(index.last):
                n = min_n + i
                if end >= n:
                    table[tuple(tokens[end - n : end])] = end
