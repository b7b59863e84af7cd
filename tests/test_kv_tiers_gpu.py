"""KV tiers on the GPU: pinned host slots, side-stream copies, and the engine under a tight device pool.

The copies must be byte-exact whatever the slot order (runs of consecutive
slots are single DMA copies, the rest page by page) and must never race the
compute stream: a page written by a step and retracted in the next one is
read after that step, a page loaded for a step is read by it only after the
load (the kvcache keeps a source pinned until its copy is confirmed). The engine tests run fp32 so that a batch composition changed by
memory pressure cannot move a greedy choice; tokens must equal the
unpressured run, with CUDA graphs and overlap on.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.checkpoints import make_checkpoint, prompts
from tokenspeed import LLM, SamplingParams
from tokenspeed.batch.kv_storage import PagedKVStorage
from tokenspeed.executor.kv_tiers import HostKVTier
from tokenspeed.kvcache import CopyKind, CopyOp, KVLayout

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
TIGHT = dict(num_kv_pages=10, max_model_len=128, page_size=16, dtype="float32")


def storage(dtype: torch.dtype, pages: int = 40) -> tuple[PagedKVStorage, KVLayout]:
    kv = PagedKVStorage(num_layers=3, num_pages=pages, page_size=16, num_kv_heads=2, head_dim=64,
                        dtype=dtype, device="cuda")
    for tensor in [*kv.k, *kv.v]:
        tensor.copy_(torch.randn(tensor.shape, device="cuda").to(dtype))
    size = PagedKVStorage.bytes_per_page(num_layers=3, page_size=16, num_kv_heads=2, head_dim=64, dtype=dtype)
    return kv, KVLayout("test", str(dtype), 16, 3, size)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_copies_round_trip_byte_exact_through_pinned_slots(dtype: torch.dtype) -> None:
    kv, layout = storage(dtype)
    tier = HostKVTier(kv, layout, 32, torch.device("cuda"))
    assert tier.allocated_bytes == 0  # rows are pinned on first use
    sources = [3, 4, 5, 9, 17, 30, 31]
    slots = [0, 1, 2, 10, 7, 20, 21]  # runs and singles
    before = [[t[p].clone() for t in [*kv.k, *kv.v]] for p in sources]
    tier.run(1, [CopyOp(i, CopyKind.DEVICE_TO_HOST, p, s, None) for i, (p, s) in enumerate(zip(sources, slots))])
    assert sorted(op for op, ok in tier.finished(1)) == list(range(len(sources)))
    for tensor in [*kv.k, *kv.v]:  # confirmed: the sources may be reused (kvcache pins them until then)
        tensor[sources] = 0
    targets = [33, 34, 35, 36, 1, 2, 38]
    tier.run(2, [CopyOp(100 + i, CopyKind.HOST_TO_DEVICE, p, s, None) for i, (p, s) in enumerate(zip(targets, slots))])
    assert len(tier.finished(2)) == len(targets)
    for page, expected in zip(targets, before):
        for tensor, want in zip([*kv.k, *kv.v], expected):
            assert torch.equal(tensor[page], want)
    tier.close()


def test_a_disk_round_trip_and_a_corrupt_file(tmp_path: Path) -> None:
    kv, layout = storage(torch.bfloat16)
    tier = HostKVTier(kv, layout, 8, torch.device("cuda"), kv_cache_dir=str(tmp_path))
    page_hash = bytes(range(16))
    tier.run(1, [CopyOp(1, CopyKind.DEVICE_TO_HOST, 5, 0, page_hash)])
    tier.finished(1)
    tier.run(2, [CopyOp(2, CopyKind.HOST_TO_DISK, -1, 0, page_hash, "p.kvpage")])
    assert tier.finished(2, wait_all=True) == [(2, True)]
    tier.run(3, [CopyOp(3, CopyKind.DISK_TO_HOST, -1, 1, page_hash, "p.kvpage")])
    assert tier.finished(3, wait_all=True) == [(3, True)]
    assert torch.equal(tier.rows(0)[0], tier.rows(1)[0]) and tier.rows(0).is_pinned()
    path = next(tmp_path.rglob("p.kvpage"))
    data = bytearray(path.read_bytes())
    data[-3] ^= 1
    path.write_bytes(bytes(data))
    tier.run(4, [CopyOp(4, CopyKind.DISK_TO_HOST, -1, 2, page_hash, "p.kvpage")])
    assert tier.finished(4, wait_all=True) == [(4, False)]
    tier.close()


@pytest.fixture(scope="module")
def folder(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return make_checkpoint("llama", tmp_path_factory.mktemp("kv_tiers_gpu") / "llama")


def workload() -> list[list[int]]:
    shared = prompts(1, seed=21, min_len=48, max_len=48)[0]
    own = prompts(6, seed=4, min_len=10, max_len=40)
    return [shared + p for p in own[:4]] + own[4:]


def generate(llm: LLM, batch: list[list[int]]) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY)]


@pytest.mark.parametrize("mode", ["retract", "recompute"])
def test_engine_under_pressure_gives_the_unpressured_tokens(folder: Path, mode: str) -> None:
    expected = generate(LLM(str(folder), skip_tokenizer_init=True, page_size=16, max_model_len=128,
                            dtype="float32"), workload())
    llm = LLM(str(folder), skip_tokenizer_init=True, host_kv_cache_bytes=64 << 20, preemption_mode=mode, **TIGHT)
    assert llm.core.executor.cuda_graphs_enabled  # type: ignore[attr-defined]
    assert generate(llm, workload()) == expected
    for other in prompts(3, seed=9, min_len=100, max_len=100):  # flush the device pool to the host
        generate(llm, [other])
    assert generate(llm, workload()) == expected  # now from host hits
    counters = llm.core.scheduler.kv.counters
    assert counters.host_hit_pages > 0 and counters.pages_spilled > 0
    assert (llm.core.scheduler.num_retractions > 0) == (mode == "retract")
    llm.shutdown()
