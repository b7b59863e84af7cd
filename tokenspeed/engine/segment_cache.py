"""`SegmentTokenCache`: token ids of prompt text already tokenised, by the exact text.

An agent's turn k+1 repeats turn k's messages and adds a few, so a server
that tokenises every prompt from scratch spends most of that work on text it
tokenised a turn earlier: on a 50K-token coding-agent prompt, ~100 ms of CPU
before the request reaches the scheduler (and on the API process's worker
threads, which every other request shares). The chat template separates
messages with control tokens, and a tokenizer splits its input at those
before BPE, so the text between two of them tokenises the same wherever it
appears: `ControlTokenGuard.encode` looks each such segment up here and
tokenises only the new ones. The shared system prompt is one entry for
every session.

Bounded by tokens held (least recently used dropped first); the keys are the
segments themselves, so a hit is exact, never a hash collision. Thread-safe:
the server renders prompts on worker threads. Segments shorter than
`min_chars` are not kept, their tokenisation costs less than the bookkeeping.
"""

from __future__ import annotations

import threading
from array import array
from collections import OrderedDict

DEFAULT_TOKENIZER_CACHE_TOKENS = 8_000_000  # ~8 bytes a token (ids, and the text keys): ~64 MB
MIN_CACHED_CHARS = 256


class SegmentTokenCache:
    def __init__(self, capacity_tokens: int, min_chars: int = MIN_CACHED_CHARS) -> None:
        if capacity_tokens <= 0:
            raise ValueError(f"capacity_tokens must be positive, not {capacity_tokens}")
        self.capacity_tokens = capacity_tokens
        self.min_chars = min_chars
        self.num_tokens = 0
        self.hits = 0
        self.misses = 0
        self._entries: OrderedDict[str, array[int]] = OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self._entries)

    def get(self, text: str) -> list[int] | None:
        with self._lock:
            ids = self._entries.get(text)
            if ids is None:
                self.misses += 1
                return None
            self._entries.move_to_end(text)
            self.hits += 1
        return ids.tolist()

    def put(self, text: str, ids: list[int]) -> None:
        """Keep `ids` for `text` (unless it is short, or too large to share the cache with others)."""
        if len(text) < self.min_chars or len(ids) > self.capacity_tokens // 4:
            return
        stored = array("I", ids)
        with self._lock:
            old = self._entries.pop(text, None)
            if old is not None:
                self.num_tokens -= len(old)
            self._entries[text] = stored
            self.num_tokens += len(stored)
            while self.num_tokens > self.capacity_tokens:
                _, dropped = self._entries.popitem(last=False)
                self.num_tokens -= len(dropped)
