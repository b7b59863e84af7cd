"""Paged KV-cache bookkeeping: page pool, ownership handles, chained-hash prefix index.

Pure Python (no torch): it only decides which page ids hold which tokens; the
executor owns the device tensors those ids index.
"""

from __future__ import annotations

from tokenspeed.kvcache.block_table import BlockTable
from tokenspeed.kvcache.errors import KVCacheError, OutOfPages, PageRefError, StaleBlockTable
from tokenspeed.kvcache.events import KVEvent, KVEventLog, PagesRemoved, PagesStored
from tokenspeed.kvcache.kv_cache import KVCache, KVCacheStats
from tokenspeed.kvcache.page_pool import PagePool
from tokenspeed.kvcache.prefix_index import PrefixIndex, chain_hash

__all__ = [
    "BlockTable",
    "KVCache",
    "KVCacheError",
    "KVCacheStats",
    "KVEvent",
    "KVEventLog",
    "OutOfPages",
    "PagePool",
    "PagesRemoved",
    "PagesStored",
    "PageRefError",
    "PrefixIndex",
    "StaleBlockTable",
    "chain_hash",
]
