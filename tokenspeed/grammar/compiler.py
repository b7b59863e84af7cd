"""`GrammarCompiler`: a request's grammar, compiled in a worker thread and cached by its key.

Compiling a grammar means precomputing, for every grammar state, which of the
vocabulary's tokens may follow: milliseconds for a small schema, much more
for a large schema on a 150K vocabulary. It never runs on the engine loop: a
request's compilation starts when it arrives, in a small thread pool, and
the scheduler keeps the request waiting (`Scheduler.submit(ready=False)`)
while other requests run. Results are kept in an LRU keyed by
`StructuredOutputsParams.cache_key()`, so the 100 requests of an agent that
all use one schema compile it once; requests asking for a grammar that is
still compiling share the one compilation. A grammar that fails to compile
is not cached: its requests fail with `InvalidRequest` (HTTP 400).

The tokenizer (for xgrammar's `TokenizerInfo`: each token's bytes) is loaded
by the first compilation, in the worker, so an engine that never sees a
constrained request never pays for it.

Grammar kinds map to xgrammar as follows: `json` -> JSON schema (strict:
no properties or items the schema does not name; length-bounded strings
made exact, `json_schema.py`), `json_object` -> the schema
`{"type": "object"}` (any properties), `regex`, `choice` -> an EBNF
alternation of the literal strings, `grammar` -> EBNF (root rule `root`),
`structural_tag` -> xgrammar's structural tag (JSON text).
"""

from __future__ import annotations

import json
import logging
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import xgrammar

from tokenspeed.errors import InvalidRequest
from tokenspeed.grammar.json_schema import exact_string_lengths, exact_structural_tag
from tokenspeed.scheduler.structured_outputs import StructuredOutputsParams

logger = logging.getLogger("tokenspeed.grammar")

DEFAULT_CACHE_SIZE = 256  # compiled grammars kept
DEFAULT_CACHE_BYTES = 512 << 20  # and at most this much of them (a large schema on a 150K vocabulary: MBs)
DEFAULT_THREADS = 2


class GrammarCompiler:
    def __init__(
        self,
        load_tokenizer: Callable[[], Any],
        vocab_size: int,
        stop_token_ids: Sequence[int] = (),
        *,
        cache_size: int = DEFAULT_CACHE_SIZE,
        cache_bytes: int = DEFAULT_CACHE_BYTES,
        threads: int = DEFAULT_THREADS,
    ) -> None:
        """`load_tokenizer` returns the model's Hugging Face tokenizer (called once, in a worker);
        `vocab_size` is the model's (the logits' width, which may exceed the tokenizer's)."""
        self._load_tokenizer = load_tokenizer
        self.vocab_size = vocab_size
        self._stop_token_ids = list(stop_token_ids)
        self._cache_size = cache_size
        self._cache_bytes = cache_bytes
        self._sizes: dict[str, int] = {}  # bytes of each compiled grammar in the cache
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="tokenspeed-grammar")
        self._lock = threading.Lock()  # the cache
        self._build_lock = threading.Lock()  # the xgrammar compiler, built by the first compilation
        self._cache: OrderedDict[str, Future[xgrammar.CompiledGrammar]] = OrderedDict()
        self._compiler: xgrammar.GrammarCompiler | None = None
        self.hits = 0
        self.misses = 0

    def compile(self, spec: StructuredOutputsParams) -> Future[xgrammar.CompiledGrammar]:
        """The compiled grammar of `spec`, at once when cached, else when the worker is done."""
        key = spec.cache_key()
        with self._lock:
            future = self._cache.get(key)
            if future is not None:
                self._cache.move_to_end(key)
                self.hits += 1
                return future
            self.misses += 1
            future = self._pool.submit(self._compile, spec)
            self._cache[key] = future
            self._evict()
        future.add_done_callback(lambda done: self._on_done(key, done))
        return future

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    def _on_done(self, key: str, future: Future[xgrammar.CompiledGrammar]) -> None:
        """A failure leaves the cache; a success is weighed against the byte bound."""
        failed = future.cancelled() or future.exception() is not None
        with self._lock:
            if self._cache.get(key) is not future:
                return
            if failed:
                del self._cache[key]
            else:
                self._sizes[key] = future.result().memory_size_bytes
                self._evict()

    def _evict(self) -> None:
        """Drop least recently used grammars past either bound (the newest one always stays)."""
        while len(self._cache) > 1 and (
            len(self._cache) > self._cache_size or sum(self._sizes.values()) > self._cache_bytes
        ):
            key, _ = self._cache.popitem(last=False)
            self._sizes.pop(key, None)

    def _xgrammar_compiler(self) -> xgrammar.GrammarCompiler:
        with self._build_lock:  # the first compilations may race to build it: one does
            if self._compiler is None:
                tokenizer = self._load_tokenizer()
                if tokenizer is None:
                    raise InvalidRequest("Structured output needs the model's tokenizer, and this engine has none.")
                info = xgrammar.TokenizerInfo.from_huggingface(
                    tokenizer, vocab_size=self.vocab_size, stop_token_ids=self._stop_token_ids or None
                )
                # Our LRU is the cache; xgrammar's own would keep a second copy of every grammar.
                self._compiler = xgrammar.GrammarCompiler(info, max_threads=1, cache_enabled=False)
            return self._compiler

    def _compile(self, spec: StructuredOutputsParams) -> xgrammar.CompiledGrammar:
        compiler = self._xgrammar_compiler()
        kind = spec.kind
        try:
            if kind == "json":
                return compiler.compile_json_schema(
                    json.dumps(exact_string_lengths(spec.schema())), any_whitespace=spec.any_whitespace,
                    strict_mode=True,
                )
            if kind == "json_object":
                return compiler.compile_json_schema(
                    '{"type": "object"}', any_whitespace=spec.any_whitespace, strict_mode=False
                )
            if kind == "regex":
                assert spec.regex is not None
                return compiler.compile_regex(spec.regex)
            if kind == "choice":
                assert spec.choice is not None
                return compiler.compile_grammar(choice_grammar(spec.choice))
            if kind == "grammar":
                assert spec.grammar is not None
                return compiler.compile_grammar(spec.grammar)
            assert spec.structural_tag is not None
            return compiler.compile_structural_tag(json.dumps(exact_structural_tag(json.loads(spec.structural_tag))))
        except InvalidRequest:
            raise
        except Exception as exc:  # xgrammar raises RuntimeError / ValueError / its own types on bad input
            raise InvalidRequest(f"The {_NAMES[kind]} cannot be compiled: {_first_line(exc)}") from None


_NAMES = {
    "json": "JSON schema", "json_object": "JSON object grammar", "regex": "regex", "choice": "choice list",
    "grammar": "EBNF grammar", "structural_tag": "structural tag",
}


def choice_grammar(choices: Sequence[str]) -> str:
    """EBNF whose sentences are exactly `choices` (JSON string escapes are EBNF string escapes)."""
    return "root ::= " + " | ".join(json.dumps(c, ensure_ascii=False) for c in choices)


_LOG_PREFIX = re.compile(r"^\[[\d:]+\] \S+:\d+: ")  # xgrammar's "[14:58:39] /path/file.cc:94: "


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return _LOG_PREFIX.sub("", text.splitlines()[0])[:500]
