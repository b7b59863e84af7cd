"""Disk tier (L3): page file format, checksums, byte budget, restart, prefetch (real files, no scheduler)."""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import pytest

from tests.kv_tier_sim import (
    MemoryStore,
    TierSim,
    check_contents,
    decode,
    encode,
    layout,
    page_tokens_by_hash,
)
from tokenspeed.kvcache import CopyKind, CopyOp, DiskTier, KVCache, KVTierConfig, Tier
from tokenspeed.kvcache.page_file import HEADER_BYTES, decode_page, encode_header, page_file_name
from tokenspeed.kvcache.prefix_index import chain_hash

PS = 2
LAYOUT = layout(PS)
PAGES = [[1, 2], [3, 4], [5, 6]]


def hashes(pages: list[list[int]]) -> list[bytes]:
    found, parent = [], None
    for page in pages:
        parent = chain_hash(parent, page)
        found.append(parent)
    return found


def test_page_file_reads_back_only_when_whole_intact_and_ours() -> None:
    page_hash = chain_hash(None, [1, 2])
    payload = encode([1, 2])
    blob = encode_header(LAYOUT, page_hash, payload) + payload
    assert len(blob) == LAYOUT.file_bytes == HEADER_BYTES + 16
    assert decode_page(LAYOUT, page_hash, blob) == payload
    assert decode_page(LAYOUT, page_hash, blob[:-1]) is None, "truncated"
    assert decode_page(LAYOUT, page_hash, blob + b"\0") is None, "trailing bytes"
    for position in (0, 10, 30, 60, HEADER_BYTES - 1, HEADER_BYTES, len(blob) - 1):
        flipped = bytearray(blob)
        flipped[position] ^= 0x40
        assert decode_page(LAYOUT, page_hash, bytes(flipped)) is None, f"bit flip at {position}"
    assert decode_page(LAYOUT, chain_hash(None, [1, 3]), blob) is None, "a file renamed to another page"
    other_dtype = dataclasses.replace(LAYOUT, dtype="float16")
    assert decode_page(other_dtype, page_hash, blob) is None, "a page of another layout"


def disk_cache(directory: Path, disk_files: int, host_slots: int = 4, num_pages: int = 3) -> KVCache:
    tiers = KVTierConfig(
        layout=LAYOUT,
        host_kv_cache_bytes=host_slots * LAYOUT.bytes_per_page,
        kv_cache_dir=str(directory),
        kv_cache_dir_bytes=disk_files * LAYOUT.file_bytes,
    )
    return KVCache(num_pages, PS, tiers=tiers)


def spill_to_disk(kv: KVCache, sim: TierSim, tokens: list[int]) -> None:
    """Compute `tokens`, then write them back to the host and on to disk."""
    table = kv.new_block_table()
    kv.allocate(table, kv.pages_for(len(tokens)))
    sim.compute(table.pages, tokens, 0, len(tokens))
    kv.publish(table, tokens, len(tokens))
    table.release()
    kv.writeback(max_pages=8)
    sim.finish_all()
    kv.writeback(max_pages=0, max_disk_pages=8)
    sim.finish_all()


def forget_upper_tiers(kv: KVCache) -> None:
    """Evict every cached device page and host slot (what other sessions' traffic would do)."""
    kv.allocate(grab := kv.new_block_table(), kv.num_pages)
    grab.release()
    assert kv.host is not None
    kv.host.pool.allocate(slots := kv.host.pool.num_pages)
    for slot in range(slots):
        kv.host.pool.decref(slot)


def test_pages_travel_device_host_disk_and_back(tmp_path: Path) -> None:
    kv = disk_cache(tmp_path, disk_files=4)
    sim = TierSim(kv)
    tokens = [1, 2, 3, 4, 5, 6]
    spill_to_disk(kv, sim, tokens)
    directory = tmp_path / LAYOUT.fingerprint().hex()
    assert sorted(os.listdir(directory)) == sorted(page_file_name(h) for h in hashes(PAGES))
    forget_upper_tiers(kv)
    assert [loc.tier for loc in kv.lookup(tokens, 3)] == [Tier.DISK] * 3
    assert len(kv.match_prefix(tokens, 3)) == 0, "disk hits are prefetched to the host, never read by a match"
    assert kv.prefetch(tokens, 3) == 3
    assert [loc.ready for loc in kv.lookup(tokens, 3)] == [False] * 3, "host slots being read from disk"
    sim.finish_all()
    assert kv.counters.disk_hit_pages == 3 and kv.counters.bytes_disk_to_host == 3 * LAYOUT.bytes_per_page
    table = kv.match_prefix(tokens + [7], 3)
    sim.finish_all()
    assert [sim.device[p] for p in table.pages] == PAGES
    table.release()
    check_contents(sim, page_tokens_by_hash([tokens], PS))
    kv.check_invariants()


@pytest.mark.parametrize("damage", ["truncate", "flip", "delete", "foreign"])
def test_a_damaged_file_is_a_miss_and_is_forgotten(tmp_path: Path, damage: str) -> None:
    kv = disk_cache(tmp_path, disk_files=4)
    sim = TierSim(kv)
    tokens = [1, 2, 3, 4, 5, 6]
    spill_to_disk(kv, sim, tokens)
    forget_upper_tiers(kv)
    victim = tmp_path / LAYOUT.fingerprint().hex() / page_file_name(hashes(PAGES)[1])
    blob = victim.read_bytes()
    if damage == "truncate":
        victim.write_bytes(blob[: len(blob) // 2])
    elif damage == "flip":
        victim.write_bytes(blob[:-1] + bytes([blob[-1] ^ 1]))
    elif damage == "delete":
        victim.unlink()
    else:  # another page's file under this name
        victim.write_bytes((tmp_path / LAYOUT.fingerprint().hex() / page_file_name(hashes(PAGES)[2])).read_bytes())
    kv.prefetch(tokens, 3)
    sim.finish_all()
    assert kv.counters.disk_hit_pages == 2 and kv.counters.disk_bad_files == 1
    assert not victim.exists()
    assert [loc.tier for loc in kv.lookup(tokens, 3)] == [Tier.HOST], "the walk stops at the bad page"
    table = kv.match_prefix(tokens + [7], 3)
    sim.finish_all()
    assert len(table) == 1 and sim.device[table.page_at(0)] == PAGES[0]  # the rest is recomputed
    table.release()
    kv.check_invariants()


def test_restart_adopts_files_and_cleans_leftovers(tmp_path: Path) -> None:
    kv = disk_cache(tmp_path, disk_files=4)
    spill_to_disk(kv, TierSim(kv), [1, 2, 3, 4, 5, 6])
    directory = tmp_path / LAYOUT.fingerprint().hex()
    (directory / (page_file_name(hashes(PAGES)[0]) + ".123.tmp")).write_bytes(b"half")  # a killed writer
    (directory / "notes.txt").write_bytes(b"x")
    (directory / page_file_name(chain_hash(None, [9, 9]))).write_bytes(b"short")
    restarted = disk_cache(tmp_path, disk_files=4)
    assert restarted.disk is not None and len(restarted.disk) == 3
    assert sorted(os.listdir(directory)) == sorted(page_file_name(h) for h in hashes(PAGES))
    assert restarted.prefetch([1, 2, 3, 4, 5, 6], 3) == 3
    sim = TierSim(restarted)
    sim.finish_all()
    check_contents(sim, page_tokens_by_hash([[1, 2, 3, 4, 5, 6]], PS))
    smaller = disk_cache(tmp_path, disk_files=2)  # a smaller budget evicts the oldest files on start
    assert smaller.disk is not None and len(smaller.disk) == 2
    assert len(os.listdir(directory)) == 2


def test_another_layout_in_the_same_directory_sees_nothing(tmp_path: Path) -> None:
    kv = disk_cache(tmp_path, disk_files=4)
    spill_to_disk(kv, TierSim(kv), [1, 2, 3, 4])
    other = DiskTier.open(str(tmp_path), dataclasses.replace(LAYOUT, model="other"), 4 * LAYOUT.file_bytes)
    assert len(other) == 0 and not other.contains(hashes(PAGES)[0])


def test_the_byte_budget_evicts_least_recently_used_files() -> None:
    store = MemoryStore()
    disk = DiskTier(store, LAYOUT, budget_bytes=2 * LAYOUT.file_bytes + LAYOUT.file_bytes // 2)
    assert disk.capacity == 2
    first, second, third = hashes(PAGES)
    for page_hash in (first, second):
        assert disk.reserve(page_hash) is not None
        disk.land(page_hash)
    disk.pin(first)  # a read makes it recently used (and unevictable while it runs)
    assert disk.reserve(third) == page_file_name(third)
    assert disk.eviction_order() == [first, third]
    assert disk.reserve(chain_hash(None, [0, 0])) is None, "one file is being read, the other written"
    disk.unpin(first)
    disk.check_invariants()


def test_a_failed_write_is_forgotten() -> None:
    tiers = KVTierConfig(LAYOUT, host_kv_cache_bytes=2 * LAYOUT.bytes_per_page, kv_cache_dir_bytes=2 * LAYOUT.file_bytes)
    kv = KVCache(2, PS, tiers=tiers, disk_store=MemoryStore())
    sim = TierSim(kv)
    table = kv.new_block_table()
    kv.allocate(table, 1)
    sim.compute(table.pages, [1, 2], 0, 2)
    kv.publish(table, [1, 2], 2)
    table.release()
    kv.writeback(max_pages=1)
    sim.finish_all()
    kv.writeback(max_pages=0, max_disk_pages=1)
    (op,) = sim.take()
    assert op.kind is CopyKind.HOST_TO_DISK
    kv.complete(op.op_id, ok=False)  # e.g. the disk is full
    assert kv.disk is not None and len(kv.disk) == 0 and kv.counters.disk_bad_files == 1
    kv.check_invariants()


def test_write_payload_refuses_a_page_of_the_wrong_size() -> None:
    disk = DiskTier(MemoryStore(), LAYOUT, budget_bytes=LAYOUT.file_bytes)
    name = disk.reserve(hashes(PAGES)[0])
    op = CopyOp(1, CopyKind.HOST_TO_DISK, -1, 0, hashes(PAGES)[0], name)
    with pytest.raises(ValueError, match="holds 16 bytes"):
        disk.write_payload(op, b"123")
    disk.write_payload(op, encode([1, 2]))
    payload = disk.read_payload(op)
    assert payload is not None and decode(payload) == [1, 2]
