"""`NativeSuffixAutomaton`: `suffix_automaton.SuffixAutomaton` in C (`native/suffix_automaton.c`), via ctypes.

Why: every token a request emits is indexed into its own automaton before its
next proposal, on the critical path of `next_plan`. In CPython that insert is
~2-3 us a token (one new state and, on copied text, about one clone), which at
64 drafting rows is most of a step's host time; in C it is tens of ns, and a
proposal costs a few foreign calls.

Same construction, counts and queries as the Python class, step for step (the
Python class stays the reference: `tests/test_spec_drafters.py` compares them
state by state and proposal by proposal). Built on first use with the system C
compiler (`$CC`, else `cc`) into `$TOKENSPEED_CACHE_DIR` (default
`~/.cache/tokenspeed`), keyed by the source's hash (`tokenspeed/kernels/native_build.py`); where no compiler works the
drafter falls back to the Python class (a warning, once). Off switch:
`TOKENSPEED_SUFFIX_NATIVE=0`.
"""

from __future__ import annotations

import ctypes
import logging
import os
from array import array
from collections.abc import Sequence
from pathlib import Path

from tokenspeed.kernels.native_build import NativeLibrary, build_library
from tokenspeed.spec.suffix_automaton import Match

logger = logging.getLogger("tokenspeed.spec")

_SOURCE = Path(__file__).parent / "native" / "suffix_automaton.c"


def native_enabled() -> bool:
    return os.environ.get("TOKENSPEED_SUFFIX_NATIVE", "1") != "0"


def load_library() -> ctypes.CDLL | None:
    """The compiled automaton (built once per source version), or None where it cannot be built."""
    return NATIVE.get()


def _build() -> Path:
    return build_library(_SOURCE, "suffix_automaton", ["-O2", "-std=c99"])


def _declare(lib: ctypes.CDLL) -> ctypes.CDLL:
    i64, ptr = ctypes.c_int64, ctypes.c_void_p
    signatures: dict[str, tuple[list[type], type | None]] = {
        "sa_new": ([i64], ptr),
        "sa_free": ([ptr], None),
        "sa_extend_all": ([ptr, ptr, i64], ctypes.c_int),
        "sa_end_document": ([ptr], ctypes.c_int),
        "sa_num_tokens": ([ptr], i64),
        "sa_num_states": ([ptr], i64),
        "sa_field": ([ptr, i64, i64], i64),
        "sa_step": ([ptr, i64, i64], i64),
        "sa_tail": ([ptr, ptr, ptr], None),
        "sa_advance": ([ptr, ptr, ptr, ptr, i64], None),
        "sa_speculate": ([ptr, i64, i64, i64, ctypes.c_double, ctypes.c_double, ptr, ptr], i64),
        "sa_speculate_tail": ([ptr, i64, ctypes.c_double, ctypes.c_double, ptr, ptr], i64),
        "sa_extend_speculate_tail": ([ptr, ptr, i64, i64, ctypes.c_double, ctypes.c_double, ptr, ptr], i64),
        "sa_advance_speculate": ([ptr, ptr, ptr, i64, i64, ctypes.c_double, ctypes.c_double, ptr, ptr], i64),
    }
    for name, (args, result) in signatures.items():
        function = getattr(lib, name)
        function.argtypes = args
        function.restype = result
    return lib


NATIVE = NativeLibrary(lambda: _declare(ctypes.CDLL(str(_build()))), logger,
                       "native suffix automaton unavailable; using the Python one", logging.WARNING)


class NativeSuffixAutomaton:
    """The `SuffixAutomaton` interface the suffix drafter uses (plus state fields for the tests)."""

    __slots__ = ("max_depth", "num_tokens", "_lib", "_handle", "_pair", "_pair_at", "_score", "_score_at", "_out", "_out_at")

    def __init__(self, max_depth: int) -> None:
        if max_depth < 1:
            raise ValueError(f"max_depth must be at least 1, got {max_depth}")
        lib = load_library()
        if lib is None:
            raise RuntimeError("the native suffix automaton could not be built")
        self.max_depth = max_depth
        self.num_tokens = 0  # tokens extended, separators included (kept here: no foreign call to read it)
        self._lib = lib
        self._handle = lib.sa_new(max_depth)
        if not self._handle:
            raise MemoryError("sa_new")
        self._pair = (ctypes.c_int64 * 2)()
        self._pair_at = ctypes.addressof(self._pair)
        self._score = ctypes.c_double()
        self._score_at = ctypes.addressof(self._score)
        self._out = (ctypes.c_int64 * 64)()
        self._out_at = ctypes.addressof(self._out)

    def __del__(self) -> None:
        handle = getattr(self, "_handle", None)
        if handle:
            self._lib.sa_free(handle)
            self._handle = None

    @property
    def num_states(self) -> int:
        return int(self._lib.sa_num_states(self._handle))

    def extend(self, token: int) -> None:
        self.extend_all((token,))

    def extend_all(self, tokens: Sequence[int]) -> None:
        if not tokens:
            return
        buffer = array("q", tokens)
        if self._lib.sa_extend_all(self._handle, buffer.buffer_info()[0], len(buffer)) != 0:
            raise MemoryError("native suffix automaton: out of memory")
        self.num_tokens += len(buffer)

    def end_document(self) -> None:
        if self._lib.sa_end_document(self._handle) != 0:
            raise MemoryError("native suffix automaton: out of memory")
        self.num_tokens += 1

    def step(self, state: int, token: int) -> int:
        return int(self._lib.sa_step(self._handle, state, token))

    def state_len(self, state: int) -> int:
        return int(self._lib.sa_field(self._handle, 0, state))

    def state_link(self, state: int) -> int:
        return int(self._lib.sa_field(self._handle, 1, state))

    def count(self, state: int) -> int:
        return int(self._lib.sa_field(self._handle, 2, state))

    def tail(self) -> Match:
        pair = self._pair
        self._lib.sa_tail(self._handle, self._pair_at, self._pair_at + 8)
        return Match(pair[0], pair[1])

    def match(self, tokens: list[int]) -> Match:
        found = Match()
        self.advance(found, tokens[-self.max_depth :])
        return found

    def advance(self, match: Match, tokens: Sequence[int]) -> None:
        """`match.advance(self, token)` for each of `tokens`."""
        if not tokens:
            return
        pair = self._pair
        pair[0], pair[1] = match.state, match.length
        buffer = array("q", tokens)
        self._lib.sa_advance(self._handle, self._pair_at, self._pair_at + 8, buffer.buffer_info()[0], len(buffer))
        match.state, match.length = pair[0], pair[1]

    def speculate_tail(self, max_tokens: int, max_spec_factor: float, min_token_prob: float
                       ) -> tuple[list[int], float]:
        """`speculate(tail(), ...)` in one foreign call."""
        if max_tokens > len(self._out):
            self._out = (ctypes.c_int64 * max_tokens)()
            self._out_at = ctypes.addressof(self._out)
        n = self._lib.sa_speculate_tail(self._handle, max(0, max_tokens), max_spec_factor, min_token_prob,
                                        self._out_at, self._score_at)
        return self._out[:n], self._score.value

    def extend_speculate_tail(self, tokens: Sequence[int], max_tokens: int, max_spec_factor: float,
                              min_token_prob: float) -> tuple[list[int], float]:
        """`extend_all(tokens)` then `speculate_tail(...)`, in one foreign call."""
        self._fit(max_tokens)
        buffer = array("q", tokens)
        n = self._lib.sa_extend_speculate_tail(self._handle, buffer.buffer_info()[0], len(buffer), max(0, max_tokens),
                                               max_spec_factor, min_token_prob, self._out_at, self._score_at)
        if n < 0:
            raise MemoryError("native suffix automaton: out of memory")
        self.num_tokens += len(buffer)
        return self._out[:n], self._score.value

    def advance_speculate(self, match: Match, tokens: Sequence[int], max_tokens: int, max_spec_factor: float,
                          min_token_prob: float) -> tuple[list[int], float]:
        """`advance(match, tokens)` then `speculate(match, ...)`, in one foreign call."""
        self._fit(max_tokens)
        pair = self._pair
        pair[0], pair[1] = match.state, match.length
        buffer = array("q", tokens)
        n = self._lib.sa_advance_speculate(self._handle, self._pair_at, buffer.buffer_info()[0], len(buffer),
                                           max(0, max_tokens), max_spec_factor, min_token_prob, self._out_at,
                                           self._score_at)
        match.state, match.length = pair[0], pair[1]
        return self._out[:n], self._score.value

    def _fit(self, max_tokens: int) -> None:
        if max_tokens > len(self._out):
            self._out = (ctypes.c_int64 * max_tokens)()
            self._out_at = ctypes.addressof(self._out)

    def speculate(self, match: Match, max_tokens: int, max_spec_factor: float, min_token_prob: float
                  ) -> tuple[list[int], float]:
        if max_tokens > len(self._out):
            self._out = (ctypes.c_int64 * max_tokens)()
            self._out_at = ctypes.addressof(self._out)
        n = self._lib.sa_speculate(self._handle, match.state, match.length, max(0, max_tokens), max_spec_factor,
                                   min_token_prob, self._out_at, self._score_at)
        return self._out[:n], self._score.value
