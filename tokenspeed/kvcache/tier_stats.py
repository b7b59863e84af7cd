"""Plain records of the KV tiers for the metrics layer and `/debug/kv`.

`TierCounters` only ever grow (Prometheus counters map onto them one to one);
`TierStats` is a snapshot: the books of every tier (gauges) plus a copy of the
counters. Pages count pages; bytes count what copies confirmed as moved.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import Any


@dataclass(slots=True)
class TierCounters:
    pages_spilled: int = 0  # device -> host write-backs of cached pages, confirmed
    pages_spilled_to_disk: int = 0  # host -> disk write-backs, confirmed
    host_hit_pages: int = 0  # prefix-match pages loaded host -> device instead of recomputed
    disk_hit_pages: int = 0  # prefetched pages read from disk and verified
    disk_bad_files: int = 0  # disk reads or writes that failed (missing, truncated, corrupt, foreign): misses
    pages_retracted: int = 0  # private pages a retraction moved device -> host
    pages_retracted_full: int = 0  # computed pages of the retracted requests (what a full retraction moves)
    pages_retract_lost: int = 0  # private pages a retraction could not save (no host room): recomputed
    pages_restored: int = 0  # pages a restore loaded host -> device
    pages_reacquired: int = 0  # pages a restore found still on the device (no copy)
    retention_evictions: int = 0  # retained pages evicted before their expiry (device)
    device_drops: int = 0  # cached device pages evicted while no host copy existed (a host tier does)
    host_drops: int = 0  # cached host slots evicted while no disk copy existed (a disk tier does)
    bytes_device_to_host: int = 0
    bytes_host_to_device: int = 0
    bytes_host_to_disk: int = 0
    bytes_disk_to_host: int = 0


@dataclass(slots=True, frozen=True)
class TierBooks:
    """One pool's pages: `free + owned + cached + draining == total`."""

    total: int
    free: int
    owned: int  # referenced: request block tables (device) or retracted requests (host)
    cached: int  # unreferenced, indexed, evictable
    draining: int  # unreferenced, unindexed, a copy still reads it
    retained: int  # of `cached`: still protected by a session's retention
    pinned: int  # pages a copy in flight reads or writes (any of the above but free)
    pending: int  # of `pinned`: being written, not readable yet


@dataclass(slots=True, frozen=True)
class DiskBooks:
    files: int
    used_bytes: int
    budget_bytes: int
    pending: int  # files being written


@dataclass(slots=True, frozen=True)
class TierStats:
    device: TierBooks
    host: TierBooks | None
    disk: DiskBooks | None
    copies_in_flight: int
    counters: TierCounters = field(default_factory=TierCounters)


def snapshot(counters: TierCounters) -> TierCounters:
    return replace(counters)


def as_report(stats: TierStats, page_size: int) -> dict[str, Any]:
    """`stats` as plain dicts (for IPC, `/debug/kv` and the metrics), with the page size to turn pages into tokens."""
    report = asdict(stats)
    report["page_size"] = page_size
    return report
