"""`HostKVTier` on the CPU: byte-exact round trips through host slots spread over lazily allocated chunks."""

from __future__ import annotations

import torch

from tokenspeed.batch.kv_storage import PagedKVStorage
from tokenspeed.executor.kv_tiers import HostKVTier
from tokenspeed.kvcache import CopyKind, CopyOp, KVLayout


def test_round_trip_across_chunks_and_runs() -> None:
    kv = PagedKVStorage(num_layers=2, num_pages=12, page_size=4, num_kv_heads=2, head_dim=8,
                        dtype=torch.float32, device="cpu")
    for tensor in [*kv.k, *kv.v]:
        tensor.copy_(torch.randn(tensor.shape))
    size = PagedKVStorage.bytes_per_page(num_layers=2, page_size=4, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    tier = HostKVTier(kv, KVLayout("t", "float32", 4, 2, size), 10, torch.device("cpu"), chunk_bytes=3 * size)
    assert tier.allocated_bytes == 0
    sources, slots = [0, 1, 2, 3, 7], [1, 2, 3, 4, 9]  # a run crossing the chunk boundary at slot 3
    before = [[t[p].clone() for t in [*kv.k, *kv.v]] for p in sources]
    tier.run(1, [CopyOp(i, CopyKind.DEVICE_TO_HOST, p, s, None) for i, (p, s) in enumerate(zip(sources, slots))])
    assert sorted(tier.finished(1)) == [(i, True) for i in range(5)]
    assert tier.allocated_bytes == 7 * size  # chunks 0 and 1 (3 slots each) and the last (1 slot); not 2
    targets = [11, 10, 5, 6, 4]
    tier.run(2, [CopyOp(10 + i, CopyKind.HOST_TO_DEVICE, p, s, None) for i, (p, s) in enumerate(zip(targets, slots))])
    assert len(tier.finished(2)) == 5
    for page, expected in zip(targets, before):
        for tensor, want in zip([*kv.k, *kv.v], expected):
            assert torch.equal(tensor[page], want)
    tier.close()
