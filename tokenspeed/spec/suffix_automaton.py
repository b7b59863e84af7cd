"""`SuffixAutomaton`: an online index of a token stream that answers "what came after this?".

Suffix decoding needs two things of a text: the longest suffix of some query
(the request's last tokens) that occurs in it, and how often each token
followed that suffix. A suffix automaton gives both with work independent of
the text's length:

* `extend(token)` adds one token in amortised O(1) for the structure, plus
  O(depth) to count the new end position (below);
* a query is walked along with the request (`Match.advance`, amortised O(1)
  per token: the matching-statistics walk over suffix links), so a step costs
  O(new tokens), never O(context);
* `speculate` walks the most frequent continuation from a match.

Each state holds the strings that share one set of end positions; its count is
the size of that set (how often its strings occur). Exact counts kept online
would cost a walk up the whole suffix-link chain per token (O(text) on
repetitive text), so counts are kept only for strings of at most
`max_depth + 1` tokens, i.e. states whose shortest string is that short. The
new end position belongs to exactly those states on the chain below `anchor`,
the state of the text's last `max_depth + 1` tokens, and that chain has at
most `max_depth + 2` states. Queries are cut to `max_depth` tokens, so every
state they reach and every follower they score has an exact count.

Documents are separated by `end_document()`, which appends a fresh negative
token: no match crosses it, and negative tokens are never proposed.

Memory, about 110 bytes per token: at most 2 states per token in five int64
arrays; 85% of states have one transition (measured on source code), kept
inline, and only the others get a dict.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass

ROOT = 0
_NO_STATE = -1
_NONE = -(2**62)  # no transition (tokens are >= 0, separators -2, -3, ...)
_MANY = _NONE + 1  # transitions in `_more`


class SuffixAutomaton:
    __slots__ = ("max_depth", "num_tokens", "_tok", "_to", "_more", "_link", "_len", "_count", "_last",
                 "_anchor", "_anchor_len", "_next_separator")

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be at least 1, got {max_depth}")
        self.max_depth = max_depth
        self.num_tokens = 0  # tokens extended, separators included
        self._tok = array("q", [_NONE])  # a state's only transition: its token ...
        self._to = array("q", [0])  # ... and target
        self._more: dict[int, dict[int, int]] = {}  # states with several transitions
        self._link = array("q", [_NO_STATE])
        self._len = array("q", [0])
        self._count = array("q", [0])
        self._last = ROOT  # state of the whole text
        self._anchor = ROOT  # state of the text's last min(max_depth + 1, num_tokens) tokens
        self._anchor_len = 0
        self._next_separator = -2  # -1 is the scheduler's placeholder id: never used here

    @property
    def num_states(self) -> int:
        return len(self._len)

    # ---- transitions ----------------------------------------------------------------------

    def step(self, state: int, token: int) -> int:
        """The state reached from `state` by `token`, or -1 if its strings are never followed by it."""
        first = self._tok[state]
        if first == token:
            return self._to[state]
        if first == _MANY:
            return self._more[state].get(token, _NO_STATE)
        return _NO_STATE

    def _set(self, state: int, token: int, target: int) -> None:
        first = self._tok[state]
        if first in (_NONE, token):
            self._tok[state], self._to[state] = token, target
        elif first == _MANY:
            self._more[state][token] = target
        else:
            self._more[state] = {first: self._to[state], token: target}
            self._tok[state] = _MANY

    def _new_state(self, length: int, link: int, count: int, copy_of: int | None = None) -> int:
        state = len(self._len)
        self._len.append(length)
        self._link.append(link)
        self._count.append(count)
        if copy_of is None:
            self._tok.append(_NONE)
            self._to.append(0)
        else:
            self._tok.append(self._tok[copy_of])
            self._to.append(self._to[copy_of])
            if copy_of in self._more:
                self._more[state] = dict(self._more[copy_of])
        return state

    def followers(self, state: int) -> list[tuple[int, int]]:
        """(token, occurrences of the state's strings followed by it), separators left out."""
        first = self._tok[state]
        if first == _MANY:
            items = list(self._more[state].items())
        elif first == _NONE:
            return []
        else:
            items = [(first, self._to[state])]
        count = self._count
        return [(token, count[target]) for token, target in items if token >= 0]

    # ---- building ------------------------------------------------------------------------

    def extend(self, token: int) -> None:
        """Append one token (the classic online construction, plus the bounded occurrence counts)."""
        self.extend_all((token,))

    def extend_all(self, tokens: Sequence[int]) -> None:
        """Append `tokens`, one `extend` each. The hot path of suffix drafting (every emitted token of
        every request goes through it): one loop with the state's fields in locals, `step` and `_set`
        inlined."""
        link, length, count, tok, to, more = self._link, self._len, self._count, self._tok, self._to, self._more
        last, anchor, anchor_len = self._last, self._anchor, self._anchor_len
        cap = self.max_depth + 1
        for token in tokens:
            p = last
            cur = len(length)
            length.append(length[p] + 1)
            link.append(ROOT)
            count.append(0)
            tok.append(_NONE)
            to.append(0)
            q = _NO_STATE
            while p != _NO_STATE:  # add token -> cur where missing
                first = tok[p]
                if first == token:
                    q = to[p]
                    break
                if first == _MANY:
                    edges = more[p]
                    q = edges.get(token, _NO_STATE)
                    if q != _NO_STATE:
                        break
                    edges[token] = cur
                elif first == _NONE:
                    tok[p] = token
                    to[p] = cur
                else:
                    more[p] = {first: to[p], token: cur}
                    tok[p] = _MANY
                p = link[p]
            if q != _NO_STATE:
                if length[p] + 1 == length[q]:
                    link[cur] = q
                else:  # split q: its strings no longer than len(p) + 1 now also end here
                    # Same end positions so far as q; the new one is counted below.
                    clone = len(length)
                    length.append(length[p] + 1)
                    link.append(link[q])
                    count.append(count[q])
                    first = tok[q]
                    tok.append(first)
                    to.append(to[q])
                    if first == _MANY:
                        more[clone] = dict(more[q])
                    while p != _NO_STATE:  # redirect p's transitions on token from q to the clone
                        first = tok[p]
                        if first == token:
                            if to[p] != q:
                                break
                            to[p] = clone
                        elif first == _MANY:
                            edges = more[p]
                            if edges.get(token) != q:
                                break
                            edges[token] = clone
                        else:
                            break
                        p = link[p]
                    link[q] = clone
                    link[cur] = clone
                    if anchor == q and anchor_len <= length[clone]:
                        anchor = clone
            last = cur
            # The anchor follows the text's last max_depth + 1 tokens: one transition, at most one link.
            first = tok[anchor]
            if first == token:
                anchor = to[anchor]
            elif first == _MANY:
                anchor = more[anchor].get(token, _NO_STATE)
            else:
                anchor = _NO_STATE
            anchor_len += 1
            if anchor_len > cap:
                anchor_len = cap
                if length[link[anchor]] >= cap:
                    anchor = link[anchor]
            state = anchor
            while state > ROOT:  # every suffix of at most max_depth + 1 tokens occurs once more
                count[state] += 1
                state = link[state]
        self._last, self._anchor, self._anchor_len = last, anchor, anchor_len
        self.num_tokens += len(tokens)

    def end_document(self) -> None:
        """Close the current document: what follows never continues a match into it."""
        self.extend(self._next_separator)
        self._next_separator -= 1

    # ---- queries ---------------------------------------------------------------------------

    def count(self, state: int) -> int:
        """Occurrences of the state's strings (exact for states a depth-bounded query reaches)."""
        return self._count[state]

    def state_len(self, state: int) -> int:
        """Length of the state's longest string."""
        return self._len[state]

    def tail(self) -> Match:
        """The match of the text's own last `max_depth` tokens (a request's index queries itself)."""
        state, length = self._anchor, min(self._anchor_len, self.max_depth)
        if state != ROOT and self._len[self._link[state]] >= length:
            state = self._link[state]
        return Match(state, length)

    def advance(self, match: Match, tokens: Sequence[int]) -> None:
        """`match.advance(self, token)` for each of `tokens`."""
        for token in tokens:
            match.advance(self, token)

    def state_link(self, state: int) -> int:
        return self._link[state]

    def speculate_tail(self, max_tokens: int, max_spec_factor: float, min_token_prob: float
                       ) -> tuple[list[int], float]:
        """`speculate(tail(), ...)`: a request's proposal from its own text."""
        return self.speculate(self.tail(), max_tokens, max_spec_factor, min_token_prob)

    def extend_speculate_tail(self, tokens: Sequence[int], max_tokens: int, max_spec_factor: float,
                              min_token_prob: float) -> tuple[list[int], float]:
        """`extend_all(tokens)` then `speculate_tail(...)` (one call in the native automaton)."""
        self.extend_all(tokens)
        return self.speculate_tail(max_tokens, max_spec_factor, min_token_prob)

    def advance_speculate(self, match: Match, tokens: Sequence[int], max_tokens: int, max_spec_factor: float,
                          min_token_prob: float) -> tuple[list[int], float]:
        """`advance(match, tokens)` then `speculate(match, ...)` (one call in the native automaton)."""
        self.advance(match, tokens)
        return self.speculate(match, max_tokens, max_spec_factor, min_token_prob)

    def match(self, tokens: list[int]) -> Match:
        """The longest suffix of `tokens` (at most `max_depth` of them) that occurs in the text."""
        found = Match()
        for token in tokens[-self.max_depth :]:
            found.advance(self, token)
        return found

    def speculate(self, match: Match, max_tokens: int, max_spec_factor: float, min_token_prob: float
                  ) -> tuple[list[int], float]:
        """The most frequent continuation of `match`, and its expected number of accepted tokens.

        The match is first shortened to its longest suffix that was ever followed by a token
        (the text's own end has no follower). Then at most min(max_tokens, match length *
        max_spec_factor) tokens are taken, each the most frequent follower (ties: lowest id), while
        the product of their frequencies (the path's estimated acceptance) stays >= min_token_prob.
        The score is the sum of those products: the expected tokens accepted from the path.
        """
        link, length, tok, to, count = self._link, self._len, self._tok, self._to, self._count
        state, matched = match.state, match.length
        while state != ROOT and not self._has_follower(state):
            state = link[state]
            matched = length[state]
        limit = min(max_tokens, int(matched * max_spec_factor))
        tokens: list[int] = []
        prob, score = 1.0, 0.0
        while len(tokens) < limit:
            first = tok[state]
            if first >= 0:  # one follower (85% of states): probability 1, no scoring
                token, state = first, to[state]
            elif first == _MANY:
                token, best, total = -1, 0, 0
                for candidate, target in self._more[state].items():
                    if candidate < 0:
                        continue
                    seen = count[target]
                    total += seen
                    if seen > best or (seen == best and candidate < token):
                        token, best = candidate, seen
                if token < 0:
                    break
                prob *= best / total
                if prob < min_token_prob:
                    break
                state = self._more[state][token]
            else:  # no transition, or only a document separator
                break
            tokens.append(token)
            score += prob
            matched += 1
            if matched > self.max_depth:
                matched = self.max_depth
                if length[link[state]] >= matched:
                    state = link[state]
        return tokens, score

    def _has_follower(self, state: int) -> bool:
        first = self._tok[state]
        if first == _MANY:
            return any(token >= 0 for token in self._more[state])
        return first >= 0


@dataclass(slots=True)
class Match:
    """The longest suffix (at most `max_depth` tokens) of a query stream that occurs in an automaton."""

    state: int = ROOT
    length: int = 0

    def advance(self, automaton: SuffixAutomaton, token: int) -> None:
        """The query grew by `token` (matching statistics: shorten by suffix links until it extends)."""
        link, length = automaton._link, automaton._len
        state, matched = self.state, self.length
        target = automaton.step(state, token)
        while target == _NO_STATE and state != ROOT:
            state = link[state]
            matched = length[state]
            target = automaton.step(state, token)
        if target == _NO_STATE:
            self.state, self.length = ROOT, 0
            return
        matched += 1
        if matched > automaton.max_depth:
            matched = automaton.max_depth
            if length[link[target]] >= matched:
                target = link[target]
        self.state, self.length = target, matched
