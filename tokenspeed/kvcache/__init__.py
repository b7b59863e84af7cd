"""Paged KV-cache bookkeeping: page pools, ownership handles, chained-hash prefix index, tiers.

Pure Python (no torch): it only decides which page ids (device pages, host
slots, disk files) hold which tokens and which copies move them; the executor
owns the tensors and files those ids name, and moves the bytes.
"""

from __future__ import annotations

from tokenspeed.kvcache.block_table import BlockTable
from tokenspeed.kvcache.copy_ops import CopyKind, CopyOp, UnknownCopy
from tokenspeed.kvcache.disk_tier import DiskTier
from tokenspeed.kvcache.errors import KVCacheError, OutOfPages, PageRefError, StaleBlockTable
from tokenspeed.kvcache.events import KVEvent, KVEventLog, PagesRemoved, PagesStored
from tokenspeed.kvcache.kv_cache import DEFAULT_SESSION_TTL, HostTier, KVCache, KVCacheStats, KVTierConfig
from tokenspeed.kvcache.page_file import DirectoryStore, KVLayout, PageFileStore, StoredFile
from tokenspeed.kvcache.page_pool import PagePool
from tokenspeed.kvcache.prefix_index import PrefixIndex, chain_hash
from tokenspeed.kvcache.retraction import Restored, Retraction
from tokenspeed.kvcache.tier_stats import DiskBooks, TierBooks, TierCounters, TierStats
from tokenspeed.kvcache.tier_transfers import PageLocation, Tier

__all__ = [
    "DEFAULT_SESSION_TTL",
    "BlockTable",
    "CopyKind",
    "CopyOp",
    "DirectoryStore",
    "DiskBooks",
    "DiskTier",
    "HostTier",
    "KVCache",
    "KVCacheError",
    "KVCacheStats",
    "KVEvent",
    "KVEventLog",
    "KVLayout",
    "KVTierConfig",
    "OutOfPages",
    "PageFileStore",
    "PageLocation",
    "PagePool",
    "PagesRemoved",
    "PagesStored",
    "PageRefError",
    "PrefixIndex",
    "Restored",
    "Retraction",
    "StaleBlockTable",
    "StoredFile",
    "Tier",
    "TierBooks",
    "TierCounters",
    "TierStats",
    "UnknownCopy",
    "chain_hash",
]
