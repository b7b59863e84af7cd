"""`SuffixDrafter`: suffix decoding over the request's own text and the engine's recent outputs.

Two kinds of index, both `SuffixAutomaton`s (online, depth-bounded counts):

* per request, its prompt + output. An agent's next turn repeats the previous
  turn's context, so a finished request's index is retained and handed to
  the next request whose prompt starts with (at least half of) the same
  tokens: that request indexes only its new tokens (a turn costs O(delta),
  not O(context)) and also matches against the previous turn's output
  (the session's earlier turns). Where the new prompt diverges from the
  retained text, a separator is appended, then the new tokens (from
  `max_depth` tokens before the divergence, so matches of the new suffix are
  not cut short);
* a corpus of the engine's recent outputs (every released request's output
  is one document), bounded to `corpus_tokens` tokens and
  `max_corpus_documents` documents: two generations, the older dropped once
  the newer holds half of either (automata cannot forget).

A proposal walks each index from the longest suffix (at most `max_depth`
tokens) of the request that it holds, always taking the most frequent
follower while the product of follower frequencies (the path's estimated
acceptance) stays >= `min_token_prob`, for at most `max_spec_factor` times
the match length tokens; the path with the highest expected number of
accepted tokens (the sum of those products) wins. The request's match in
each corpus generation follows its new tokens (amortised O(1) each), and is
recomputed from its last `max_depth` tokens (O(depth)) when that generation
has grown since; so a step costs O(new tokens + depth + k), never O(context).

Both kinds are `NativeSuffixAutomaton`s (the same automaton in C,
`native_automaton.py`) where a C compiler is available and
`TOKENSPEED_SUFFIX_NATIVE` is not 0, else the Python `SuffixAutomaton`; the
proposals are the same (tested state by state). Costs measured on CPython
3.11 (the embedded BPE): the Python automaton about 2.5 us and 150 bytes per
indexed token (2-3 us in a running batch), and ~20 us per proposal once the
prompt is indexed (8 tokens, 4 new tokens indexed); the C one ~10 us per
proposal at 64 rows, foreign calls included (`benchmarks/spec_host_overhead.py`). A request whose prompt no
retained index covers indexes its whole prompt at its first proposal
(~0.25 s per 100K tokens, once). Proposals run in `next_plan`, on the
critical path of a step: at large batch sizes their sum matters (see
`disable_by_batch_size`).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field

from tokenspeed.spec.native_automaton import NativeSuffixAutomaton, load_library, native_enabled
from tokenspeed.spec.suffix_automaton import Match, SuffixAutomaton

Automaton = SuffixAutomaton | NativeSuffixAutomaton


@dataclass(slots=True)
class _CorpusMatch:
    match: Match
    version: int  # the generation's num_tokens when the match was computed
    num_query: int  # request tokens the match has seen


@dataclass(slots=True)
class _Generation:
    automaton: Automaton
    serial: int
    num_documents: int = 0


@dataclass(slots=True)
class _RequestIndex:
    automaton: Automaton
    tokens: list[int] = field(default_factory=list)  # the request's prompt + output indexed so far
    corpus: dict[int, _CorpusMatch] = field(default_factory=dict)  # by generation serial


class SuffixDrafter:
    __slots__ = ("max_depth", "max_spec_factor", "min_token_prob", "corpus_tokens", "max_corpus_documents",
                 "max_retained",
                 "max_retained_tokens", "_requests", "_retained", "_generations", "_serial", "num_handovers",
                 "native")

    def __init__(
        self,
        *,
        max_depth: int = 24,
        max_spec_factor: float = 1.0,
        min_token_prob: float = 0.1,
        corpus_tokens: int = 1 << 20,
        max_corpus_documents: int = 10000,
        max_retained: int = 64,
        max_retained_tokens: int = 1 << 21,
        native: bool | None = None,
    ) -> None:
        """`native`: index with the C automaton (`native_automaton.py`); None: unless `TOKENSPEED_SUFFIX_NATIVE=0`;
        where it cannot be built, the Python one either way (the proposals are the same)."""
        self.max_depth = max_depth
        self.max_spec_factor = max_spec_factor
        self.min_token_prob = min_token_prob
        self.corpus_tokens = corpus_tokens
        self.max_corpus_documents = max_corpus_documents
        self.max_retained = max_retained
        self.max_retained_tokens = max_retained_tokens
        self._requests: dict[str, _RequestIndex] = {}
        self._retained: OrderedDict[int, _RequestIndex] = OrderedDict()  # finished requests, oldest first
        self._serial = 0
        self.num_handovers = 0
        if native is None:
            native = native_enabled()
        self.native = native and load_library() is not None
        self._generations: list[_Generation] = [self._new_generation()]  # newest last

    @property
    def method(self) -> str:
        return "suffix"

    @property
    def num_requests(self) -> int:
        return len(self._requests)

    @property
    def corpus_size(self) -> int:
        """Tokens (separators included) the corpus automata hold."""
        return sum(g.automaton.num_tokens for g in self._generations)

    # ---- the Drafter protocol -----------------------------------------------------------

    def propose(
        self, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int], max_tokens: int
    ) -> list[int]:
        index = self._requests.get(request_id)
        if index is None:
            index = self._requests[request_id] = self._start(prompt_token_ids)
        new = self._new_tokens(index, prompt_token_ids, output_token_ids)
        own = index.automaton
        if max_tokens <= 0:
            own.extend_all(new)
            return []
        # Catch-up, own proposal, then each corpus generation's: one call each (one foreign call when native).
        best, best_score = own.extend_speculate_tail(new, max_tokens, self.max_spec_factor, self.min_token_prob)
        for generation in self._generations:
            tokens, score = self._corpus_speculate(index, generation, max_tokens)
            if score > best_score:
                best, best_score = tokens, score
        return best

    def release(self, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        index = self._requests.pop(request_id, None)
        if output_token_ids:
            self._add_to_corpus(list(output_token_ids))
        if index is not None:
            self._catch_up(index, prompt_token_ids, output_token_ids)
            index.corpus.clear()
            self._retain(index)

    # ---- per-request indexes ------------------------------------------------------------

    def _start(self, prompt: Sequence[int]) -> _RequestIndex:
        """A retained index this prompt continues (moved out of retention), else an empty one."""
        best_key, best_common = None, 0
        for key, retained in self._retained.items():
            half = (min(len(retained.tokens), len(prompt)) + 1) // 2
            if retained.tokens[:half] != list(prompt[:half]):  # shares less than half: not this session
                continue
            common = _common_prefix(retained.tokens, prompt)
            if common > best_common:
                best_key, best_common = key, common
        if best_key is None:
            return _RequestIndex(self._new_automaton())
        index = self._retained.pop(best_key)
        self.num_handovers += 1
        if best_common < len(index.tokens):  # diverged: a separator, then the new text with some context
            index.automaton.end_document()
            resume = max(0, best_common - self.max_depth)
            index.automaton.extend_all(list(prompt[resume:best_common]))
        del index.tokens[best_common:]
        return index

    def _catch_up(self, index: _RequestIndex, prompt: Sequence[int], output: Sequence[int]) -> None:
        index.automaton.extend_all(self._new_tokens(index, prompt, output))

    @staticmethod
    def _new_tokens(index: _RequestIndex, prompt: Sequence[int], output: Sequence[int]) -> list[int]:
        """The request's tokens its index has not seen (now recorded in `index.tokens`, not yet indexed)."""
        tokens = index.tokens
        seen = len(tokens)
        if seen < len(prompt):
            new = list(prompt[seen:])
            new.extend(output)
        else:
            new = list(output[seen - len(prompt) :])
        tokens.extend(new)
        return new

    def _retain(self, index: _RequestIndex) -> None:
        self._retained[id(index)] = index
        total = sum(r.automaton.num_tokens for r in self._retained.values())
        while self._retained and (len(self._retained) > self.max_retained or total > self.max_retained_tokens):
            _, dropped = self._retained.popitem(last=False)
            total -= dropped.automaton.num_tokens

    # ---- the corpus of recent outputs -------------------------------------------------------

    def _new_generation(self) -> _Generation:
        self._serial += 1
        return _Generation(self._new_automaton(), self._serial)

    def _new_automaton(self) -> Automaton:
        return NativeSuffixAutomaton(self.max_depth) if self.native else SuffixAutomaton(self.max_depth)

    def _add_to_corpus(self, output: list[int]) -> None:
        current = self._generations[-1]
        current.automaton.extend_all(output)
        current.automaton.end_document()
        current.num_documents += 1
        if 2 * current.automaton.num_tokens >= self.corpus_tokens or \
                2 * current.num_documents >= self.max_corpus_documents:
            self._generations = [current, self._new_generation()]

    def _corpus_speculate(self, index: _RequestIndex, generation: _Generation, max_tokens: int
                          ) -> tuple[list[int], float]:
        """The generation's proposal for the request: from the request's longest suffix the generation holds,
        a match kept up to date incrementally (recomputed from the last `max_depth` tokens when the
        generation grew since)."""
        automaton, tokens = generation.automaton, index.tokens
        state = index.corpus.get(generation.serial)
        if state is None or state.version != automaton.num_tokens:
            state = index.corpus[generation.serial] = _CorpusMatch(Match(), automaton.num_tokens, len(tokens))
            unseen = tokens[-self.max_depth :]  # `automaton.match(tokens)`
        else:
            unseen = tokens[state.num_query :]
            state.num_query = len(tokens)
        if len(index.corpus) > len(self._generations):  # forget generations that were dropped
            live = {g.serial for g in self._generations}
            for serial in [s for s in index.corpus if s not in live]:
                del index.corpus[serial]
        return automaton.advance_speculate(state.match, unseen, max_tokens, self.max_spec_factor,
                                           self.min_token_prob)


def _common_prefix(a: Sequence[int], b: Sequence[int]) -> int:
    """Length of the longest common prefix (slice comparisons run in C: binary search over them)."""
    n = min(len(a), len(b))
    if list(a[:n]) == list(b[:n]):
        return n
    low, high = 0, n  # a[:low] == b[:low], a[:high] != b[:high]
    while high - low > 1:
        mid = (low + high) // 2
        if list(a[low:mid]) == list(b[low:mid]):
            low = mid
        else:
            high = mid
    return low
