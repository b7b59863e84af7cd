"""Host drafters (n-gram prompt lookup, suffix decoding) against brute-force matchers.

Every structure here is incremental (a step indexes only new tokens), so the
property tests build texts token by token and compare after each step with a
matcher that rescans the whole text: counts, longest matches and the proposed
continuations must be identical, including the tie-breaks.
"""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenspeed.spec.native_automaton import NativeSuffixAutomaton, load_library
from tokenspeed.spec.ngram import NgramDrafter
from tokenspeed.spec.suffix import SuffixDrafter
from tokenspeed.spec.suffix_automaton import ROOT, SuffixAutomaton

# ---- brute force ---------------------------------------------------------------------------------


def occurrences(text: list[int], w: list[int]) -> int:
    return sum(1 for i in range(len(text) - len(w) + 1) if text[i : i + len(w)] == w)


def followers(text: list[int], w: list[int]) -> Counter[int]:
    """Tokens (never separators) that follow an occurrence of `w` in `text`."""
    n = len(w)
    return Counter(text[i + n] for i in range(len(text) - n) if text[i : i + n] == w and text[i + n] >= 0)


def brute_speculate(text: list[int], query: list[int], depth: int, max_tokens: int, factor: float,
                    min_prob: float) -> tuple[list[int], float]:
    matched = next((m for m in range(min(depth, len(query)), 0, -1) if followers(text, query[-m:])), 0)
    w = query[len(query) - matched :]
    tokens: list[int] = []
    prob, score = 1.0, 0.0
    while len(tokens) < min(max_tokens, int(matched * factor)):
        counts = followers(text, w)
        if not counts:
            break
        token, count = min(counts.items(), key=lambda item: (-item[1], item[0]))
        prob *= count / sum(counts.values())
        if prob < min_prob:
            break
        tokens.append(token)
        score += prob
        w = (w + [token])[-depth:]
    return tokens, score


def brute_ngram(tokens: list[int], min_n: int, max_n: int, k: int) -> list[int]:
    end = len(tokens)
    for n in range(max_n, min_n - 1, -1):
        for i in range(end - n - 1, -1, -1):  # the most recent occurrence that has a follower
            if tokens[i : i + n] == tokens[end - n :]:
                return tokens[i + n : i + n + k]
    return []


def state_of(automaton: SuffixAutomaton, w: list[int]) -> int:
    state = ROOT
    for token in w:
        state = automaton.step(state, token)
        assert state >= 0
    return state


# ---- suffix automaton -----------------------------------------------------------------------------

documents = st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=25), min_size=1, max_size=4)


@settings(max_examples=120, deadline=None, derandomize=True, database=None)
@given(docs=documents, depth=st.integers(1, 6), query=st.lists(st.integers(0, 3), max_size=12),
       factor=st.sampled_from([0.5, 1.0, 2.5]), min_prob=st.sampled_from([0.0, 0.1, 0.4]))
def test_automaton_counts_matches_and_continuations_equal_brute_force(
    docs: list[list[int]], depth: int, query: list[int], factor: float, min_prob: float
) -> None:
    automaton = SuffixAutomaton(depth)
    text: list[int] = []
    for doc in docs:
        for token in doc:
            automaton.extend(token)
            text.append(token)
            # Online: after every token, every substring of at most depth + 1 tokens has its exact count.
            for length in range(1, min(depth + 1, len(text)) + 1):
                for start in range(len(text) - length + 1):
                    w = text[start : start + length]
                    assert automaton.count(state_of(automaton, w)) == occurrences(text, w)
        automaton.end_document()
        text.append(-2 - (len([t for t in text if t < 0])))
        assert automaton.num_tokens == len(text)
    match = automaton.match(query)
    longest = next((m for m in range(min(depth, len(query)), 0, -1) if occurrences(text, query[-m:])), 0)
    assert match.length == longest
    assert automaton.speculate(match, 8, factor, min_prob) == brute_speculate(text, query, depth, 8, factor, min_prob)
    tail = automaton.tail()  # the text queried against itself
    assert automaton.speculate(tail, 8, factor, min_prob) == brute_speculate(text, text, depth, 8, factor, min_prob)


@settings(max_examples=60, deadline=None, derandomize=True, database=None)
@given(text=st.lists(st.integers(0, 2), min_size=1, max_size=40), query=st.lists(st.integers(0, 2), max_size=40),
       depth=st.integers(1, 5))
def test_incremental_match_is_the_longest_suffix_after_every_token(text: list[int], query: list[int],
                                                                  depth: int) -> None:
    automaton = SuffixAutomaton(depth)
    automaton.extend_all(text)
    match = automaton.match([])
    for i, token in enumerate(query):
        match.advance(automaton, token)
        seen = query[: i + 1]
        longest = next((m for m in range(min(depth, len(seen)), 0, -1) if occurrences(text, seen[-m:])), 0)
        assert match.length == longest
        assert automaton.state_len(match.state) >= match.length  # the state holds the matched string


def test_separators_stop_matches_and_are_never_proposed() -> None:
    automaton = SuffixAutomaton(8)
    automaton.extend_all([1, 2, 3])
    automaton.end_document()
    automaton.extend_all([1, 2, 3])
    tokens, _ = automaton.speculate(automaton.match([1, 2, 3]), 4, 1.0, 0.0)
    assert tokens == []  # both occurrences of 1 2 3 end a document: nothing followed them
    assert automaton.speculate(automaton.match([1, 2]), 4, 1.0, 0.0)[0] == [3]


def test_a_repetitive_text_keeps_counting_in_bounded_work() -> None:
    """The counted chain is at most depth + 2 states, whatever the repetition (here 2000 equal tokens)."""
    automaton = SuffixAutomaton(4)
    for _ in range(2000):
        automaton.extend(7)
    assert automaton.count(state_of(automaton, [7, 7, 7])) == 1998
    assert automaton.speculate(automaton.tail(), 3, 1.0, 0.0) == ([7, 7, 7], 3.0)


# ---- n-gram -------------------------------------------------------------------------------------


@settings(max_examples=150, deadline=None, derandomize=True, database=None)
@given(prompt=st.lists(st.integers(0, 3), min_size=1, max_size=30),
       chunks=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=4), max_size=8),
       sizes=st.tuples(st.integers(1, 4), st.integers(0, 3)), k=st.integers(0, 6))
def test_ngram_equals_brute_force_at_every_step(prompt: list[int], chunks: list[list[int]], sizes: tuple[int, int],
                                               k: int) -> None:
    min_n, max_n = sizes[0], sizes[0] + sizes[1]
    drafter = NgramDrafter(min_n, max_n)
    output: list[int] = []
    for chunk in [[], *chunks]:  # accepted tokens arrive 1..k+1 at a time
        output.extend(chunk)
        proposed = drafter.propose("r", prompt, output, k)
        assert proposed == brute_ngram(prompt + output, min_n, max_n, k)
    drafter.release("r", prompt, output)
    assert drafter.num_requests == 0


def test_ngram_prefers_the_longest_then_the_most_recent_match() -> None:
    drafter = NgramDrafter(1, 3)
    prompt = [5, 1, 2, 9, 9, 4, 1, 2, 8, 3, 2, 7, 1, 2]
    # 1 2 occurs at 1 and 6 (followed by 9 and 8): the most recent wins; "4 1 2" never matched.
    assert drafter.propose("r", prompt, [], 3) == [8, 3, 2]
    assert drafter.propose("s", [1, 2, 3, 0, 2, 3, 1, 2, 3], [], 2) == [0, 2]  # 3-gram "1 2 3" beats "2 3"


def test_ngram_rejects_bad_sizes() -> None:
    with pytest.raises(ValueError):
        NgramDrafter(3, 2)
    with pytest.raises(ValueError):
        NgramDrafter(0, 2)


# ---- suffix decoding --------------------------------------------------------------------------------


@settings(max_examples=80, deadline=None, derandomize=True, database=None)
@given(finished=st.lists(st.tuples(st.lists(st.integers(0, 3), min_size=1, max_size=10),
                                   st.lists(st.integers(0, 3), max_size=15)), max_size=4),
       prompt=st.lists(st.integers(0, 3), min_size=1, max_size=20),
       chunks=st.lists(st.lists(st.integers(0, 3), min_size=1, max_size=3), max_size=6),
       depth=st.integers(1, 6), k=st.integers(1, 6), native=st.booleans())
def test_suffix_drafter_equals_brute_force_over_own_text_and_corpus(
    finished: list[tuple[list[int], list[int]]], prompt: list[int], chunks: list[list[int]], depth: int, k: int,
    native: bool,
) -> None:
    drafter = SuffixDrafter(max_depth=depth, max_spec_factor=1.0, min_token_prob=0.1, native=native)
    corpus: list[int] = []
    for i, (old_prompt, old_output) in enumerate(finished):
        drafter.propose(f"old{i}", [9 + i, *old_prompt], [], k)  # 9 + i: no prompt continues another
        drafter.release(f"old{i}", [9 + i, *old_prompt], old_output)
        if old_output:
            corpus += [*old_output, -2 - len([t for t in corpus if t < 0])]
    output: list[int] = []
    for chunk in [[], *chunks]:
        output.extend(chunk)
        own = prompt + output
        expected, best = brute_speculate(own, own, depth, k, 1.0, 0.1)
        tokens, score = brute_speculate(corpus, own, depth, k, 1.0, 0.1)
        if score > best:
            expected = tokens
        assert drafter.propose("new", prompt, output, k) == expected
    assert drafter.num_handovers == 0


def test_suffix_drafter_hands_a_session_index_to_the_next_turn() -> None:
    drafter = SuffixDrafter(max_depth=8)
    system = list(range(100, 140))
    turn1 = [*system, 1, 2, 3]
    answer = [50, 51, 52, 53, 54, 55, 56, 57]
    drafter.propose("t1", turn1, [], 4)
    drafter.propose("t1", turn1, answer[:4], 4)
    drafter.release("t1", turn1, answer)
    # Turn 2 carries turn 1 (re-rendered: the template adds 60 after the answer) and a new message.
    turn2 = [*turn1, *answer, 60, 7, 8, 50, 51, 52]
    assert drafter.propose("t2", turn2, [], 4) == [53, 54, 55]  # 3 matched tokens x spec factor 1.0
    assert drafter.num_handovers == 1
    index = drafter._requests["t2"]
    assert index.tokens == turn2 and index.automaton.num_tokens == len(turn2)  # only the delta was indexed
    # A retry of turn 1's prompt diverges from the retained text (its answer): a separator, then the new text.
    drafter.release("t2", turn2, [])
    drafter.propose("t1b", turn1, [], 4)
    assert drafter.num_handovers == 2
    assert drafter.propose("t1b", turn1, [50, 51], 4) == [52, 53, 54, 55]
    # An unrelated prompt builds its own index.
    drafter.propose("other", [7] * 30, [], 4)
    assert drafter.num_handovers == 2


def test_suffix_drafter_learns_from_other_requests_outputs() -> None:
    drafter = SuffixDrafter(max_depth=8)
    call = [70, 71, 72, 73, 74, 75]
    drafter.release("a", [1, 2], [*call, 9])
    assert drafter.propose("b", [3, 4, 70, 71], [], 5) == [72, 73]  # match length 2 x factor 1.0
    assert drafter.propose("b", [3, 4, 70, 71], [72, 73], 5) == [74, 75, 9]


def test_suffix_corpus_is_bounded() -> None:
    drafter = SuffixDrafter(max_depth=4, corpus_tokens=100, max_corpus_documents=1000)
    for i in range(50):
        drafter.release(f"r{i}", [1], [i % 7, 3, 4, 5, 6, 7, 8, 9, 10])
        assert drafter.corpus_size <= 100 + 10
    documents = SuffixDrafter(max_depth=4, max_corpus_documents=4)
    for i in range(9):
        documents.release(f"r{i}", [1], [i])
    assert sum(g.num_documents for g in documents._generations) <= 4


def test_suffix_retention_is_bounded() -> None:
    drafter = SuffixDrafter(max_depth=4, max_retained=3, max_retained_tokens=10_000)
    for i in range(10):
        drafter.propose(f"r{i}", [i, i, i], [], 2)
        drafter.release(f"r{i}", [i, i, i], [1])
    assert len(drafter._retained) == 3 and drafter.num_requests == 0


needs_native = pytest.mark.skipif(load_library() is None, reason="no C compiler for the native suffix automaton")


@needs_native
@settings(max_examples=120, deadline=None, derandomize=True, database=None)
@given(pieces=st.lists(st.tuples(st.lists(st.integers(0, 5), max_size=12), st.integers(0, 40), st.integers(0, 30),
                                 st.booleans()), min_size=1, max_size=12),
       depth=st.integers(1, 8), queries=st.lists(st.lists(st.integers(0, 5), max_size=12), max_size=4),
       k=st.integers(1, 10), factor=st.sampled_from([0.5, 1.0, 3.0]), min_prob=st.sampled_from([0.0, 0.1, 0.5]))
def test_native_automaton_equals_the_python_one_state_by_state(
    pieces: list[tuple[list[int], int, int, bool]], depth: int, queries: list[list[int]], k: int, factor: float,
    min_prob: float,
) -> None:
    """The C automaton (`native_automaton.py`) builds the Python one's states, links, counts and transitions,
    and answers the same tails, matches and proposals, on texts that copy their own earlier spans."""
    python, native = SuffixAutomaton(depth), NativeSuffixAutomaton(depth)
    text: list[int] = []
    for fresh, start, length, separate in pieces:
        chunk = fresh + text[start : start + length]  # new tokens, then a copy of an earlier span
        text += chunk
        if start % 2:
            python.extend_all(chunk)
            native.extend_all(chunk)
        else:  # the drafter's fused catch-up and proposal
            assert python.extend_speculate_tail(chunk, k, factor, min_prob) == \
                native.extend_speculate_tail(chunk, k, factor, min_prob)
        if separate:
            python.end_document()
            native.end_document()
        assert python.speculate_tail(k, factor, min_prob) == native.speculate_tail(k, factor, min_prob)
    assert (python.num_states, python.num_tokens) == (native.num_states, native.num_tokens)
    for state in range(python.num_states):
        assert python.state_len(state) == native.state_len(state)
        assert python.state_link(state) == native.state_link(state)
        assert python.count(state) == native.count(state)
        for token, _ in python.followers(state):
            assert python.step(state, token) == native.step(state, token)
        assert native.step(state, 6) == python.step(state, 6) == -1
    for query in [*queries, text[-12:]]:
        a, b = python.match(query), native.match(query)
        assert (a.state, a.length) == (b.state, b.length)
        assert python.speculate(a, k, factor, min_prob) == native.speculate(b, k, factor, min_prob)
        python.advance(a, query)
        native.advance(b, query)
        assert (a.state, a.length) == (b.state, b.length)
        assert python.advance_speculate(a, query[:5], k, factor, min_prob) == \
            native.advance_speculate(b, query[:5], k, factor, min_prob)
        assert (a.state, a.length) == (b.state, b.length)


@needs_native
def test_suffix_drafter_native_switch() -> None:
    assert SuffixDrafter(native=True).native and not SuffixDrafter(native=False).native
    python = SuffixDrafter(max_depth=8, native=False)
    native = SuffixDrafter(max_depth=8, native=True)
    text = [1, 2, 3, 4, 5, 1, 2, 3, 4, 6, 1, 2, 3]
    for drafter in (python, native):
        drafter.release("a", [9], [1, 2, 3, 4, 7, 1, 2])
    for end in range(1, len(text) + 1):
        assert python.propose("r", text[:4], text[4:end], 6) == native.propose("r", text[:4], text[4:end], 6)
