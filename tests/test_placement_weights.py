"""Sharded weights: the inventory matches real checkpoints, each rank reads only its share, measured.

The byte counts are measured outside the reader: `safe_open` is wrapped so
that reading a whole tensor fails the test and every slice read is counted.
Each rank must read 1/N of every split tensor plus the replicated ones, and
the ranks' slices together must rebuild every tensor exactly.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import pytest
import torch
from safetensors import safe_open

from tests.checkpoints import make_checkpoint, make_deepseek_checkpoint
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.parallel import sharded_reader
from tokenspeed.models.parallel.footprint import kv_bytes_per_token, weights_per_rank
from tokenspeed.models.parallel.sharded_reader import ShardedCheckpointReader
from tokenspeed.models.parallel.weight_inventory import checkpoint_tensors
from tokenspeed.models.parallel.weight_sharding import WeightKind, WeightShardingError, rule_for
from tokenspeed.models.presets import load_preset
from tokenspeed.placement.parallel_config import ParallelConfig, Topology
from tokenspeed.placement.placements import ParallelGroup


@pytest.fixture(scope="module")
def more_checkpoints(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("placement-checkpoints")
    folders = {family: make_checkpoint(family, root / family) for family in ("qwen3_moe", "mixtral")}
    for family in ("deepseek_v3", "deepseek_v2_greedy"):
        folders[family] = make_deepseek_checkpoint(family, root / family)
    return folders


def _header(folder: Path) -> dict[str, tuple[int, ...]]:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        return {name: tuple(f.get_slice(name).get_shape()) for name in list(f.keys())}


def test_inventory_matches_the_checkpoints_of_every_family(checkpoints, more_checkpoints):
    for family, folder in {**checkpoints, **more_checkpoints}.items():
        inventory = {t.name: t.shape for t in checkpoint_tensors(ModelConfig.from_pretrained(folder))}
        assert inventory == _header(folder), family


def test_rules_per_weight_kind():
    llama = load_preset("llama-3.1-8b")
    topology = ParallelConfig(tensor_parallel_size=16).topology()  # 16 ranks > 8 kv heads
    expect = {
        "model.embed_tokens.weight": (WeightKind.VOCAB, ParallelGroup.DENSE_TP),
        "lm_head.weight": (WeightKind.VOCAB, ParallelGroup.DENSE_TP),
        "model.layers.3.self_attn.q_proj.weight": (WeightKind.COLUMN, ParallelGroup.ATTN_TP),
        "model.layers.3.self_attn.k_proj.weight": (WeightKind.KV_HEADS, ParallelGroup.ATTN_TP),
        "model.layers.3.self_attn.o_proj.weight": (WeightKind.ROW, ParallelGroup.ATTN_TP),
        "model.layers.3.mlp.gate_proj.weight": (WeightKind.COLUMN, ParallelGroup.DENSE_TP),
        "model.layers.3.mlp.down_proj.weight": (WeightKind.ROW, ParallelGroup.DENSE_TP),
        "model.layers.3.input_layernorm.weight": (WeightKind.REPLICATED, None),
    }
    for name, (kind, group) in expect.items():
        rule = rule_for(name, llama, topology)
        assert (rule.kind, rule.group) == (kind, group), name
    from tokenspeed.models.parallel.weight_sharding import slice_for_rank

    k_rule = rule_for("model.layers.0.self_attn.k_proj.weight", llama, topology)
    heads = [slice_for_rank("k", k_rule, (1024, 4096), topology, r).start // 128 for r in range(16)]
    assert heads == [r // 2 for r in range(16)]  # kv head h on ranks 2h and 2h+1, the ranks of its q heads
    v3 = load_preset("moonlight-16b-a3b")
    dp = ParallelConfig(tensor_parallel_size=4, enable_dp_attention=True, data_parallel_size=4).topology()
    for name in ("model.embed_tokens.weight", "model.layers.1.self_attn.kv_b_proj.weight",
                 "model.layers.1.self_attn.kv_a_proj_with_mqa.weight", "model.layers.1.mlp.gate.weight"):
        assert rule_for(name, v3, dp).kind is WeightKind.REPLICATED, name
    assert rule_for("model.layers.1.mlp.experts.7.down_proj.weight", v3, dp).kind is WeightKind.EXPERT_ROW
    shared = rule_for("model.layers.1.mlp.shared_experts.up_proj.weight", v3, dp)
    assert (shared.kind, shared.group) == (WeightKind.COLUMN, ParallelGroup.MOE_TP_EP)
    with pytest.raises(WeightShardingError, match="no sharding rule for checkpoint tensor 'model.mystery.weight'"):
        rule_for("model.mystery.weight", llama, topology)
    with pytest.raises(WeightShardingError, match="per-expert tensors"):
        rule_for("model.layers.1.mlp.experts.gate_up_proj", v3, dp)


class _CountingSlice:
    def __init__(self, inner: Any, counter: dict[str, int]) -> None:
        self.inner, self.counter = inner, counter

    def get_shape(self) -> list[int]:
        return list(self.inner.get_shape())

    def __getitem__(self, index: Any) -> torch.Tensor:
        tensor = self.inner[index]
        self.counter["bytes"] += tensor.numel() * tensor.element_size()
        return tensor


class _CountingFile:
    """safe_open that counts the bytes of every slice read and refuses whole-tensor reads."""

    def __init__(self, path: str, framework: str, counter: dict[str, int]) -> None:
        self.inner = safe_open(path, framework=framework)
        self.counter = counter

    def __enter__(self) -> _CountingFile:
        self.inner.__enter__()
        return self

    def __exit__(self, *exc: object) -> None:
        self.inner.__exit__(*exc)

    def keys(self) -> list[str]:
        return list(self.inner.keys())

    def get_slice(self, name: str) -> _CountingSlice:
        return _CountingSlice(self.inner.get_slice(name), self.counter)

    def get_tensor(self, name: str) -> torch.Tensor:
        raise AssertionError(f"the sharded reader materialised the whole tensor {name}")


def _read_all_ranks(folder: Path, topology: Topology, monkeypatch: pytest.MonkeyPatch):
    config = ModelConfig.from_pretrained(folder)
    per_rank = []
    for rank in range(topology.world_size):
        counter = {"bytes": 0}
        monkeypatch.setattr(
            sharded_reader, "safe_open", lambda path, framework, c=counter: _CountingFile(path, framework, c)
        )
        reader = ShardedCheckpointReader(folder, config, topology, rank)
        slices = {name: (tensor, part) for name, tensor, part in reader}
        assert counter["bytes"] == reader.stats.bytes_read  # the reader's own count agrees with the measure
        per_rank.append((slices, reader.stats, counter["bytes"]))
    return config, per_rank


def _split_totals(folder: Path, config: ModelConfig, topology: Topology) -> tuple[int, int]:
    """(bytes of the tensors split over ranks, bytes of those every rank holds whole), from the headers."""
    split = whole = 0
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for name in list(f.keys()):
            size = 4 * math.prod(f.get_slice(name).get_shape())  # the test checkpoints are fp32
            if rule_for(name, config, topology).sharded:
                split += size
            else:
                whole += size
    return split, whole


def _assert_slices_rebuild_every_tensor(folder: Path, per_rank: list) -> None:
    with safe_open(str(folder / "model.safetensors"), framework="pt") as f:
        for name in list(f.keys()):
            full = f.get_tensor(name)
            held = {}
            for slices, _, _ in per_rank:
                if name in slices:
                    tensor, part = slices[name]
                    held[(part.dim, part.start, part.stop)] = tensor
            (dim, _, _), *_ = held
            if dim is None:
                assert torch.equal(held[(None, 0, 0)], full), name
                continue
            ordered = [held[key] for key in sorted(held, key=lambda k: k[1])]
            assert torch.equal(torch.cat(ordered, dim=dim), full), name


def test_each_rank_reads_its_share_at_tp2(checkpoints, monkeypatch):
    folder = checkpoints["llama"]
    topology = ParallelConfig(tensor_parallel_size=2).topology()
    config, per_rank = _read_all_ranks(folder, topology, monkeypatch)
    split, whole = _split_totals(folder, config, topology)
    assert whole and split > 10 * whole
    for _, stats, measured in per_rank:
        assert stats.sharded_bytes == split // 2 and stats.replicated_bytes == whole
        assert measured == split // 2 + whole
    _assert_slices_rebuild_every_tensor(folder, per_rank)
    footprint = weights_per_rank(config, topology, dtype_bytes=4)
    assert [(w.sharded_bytes, w.replicated_bytes) for w in footprint] == [(split // 2, whole)] * 2


def test_expert_parallel_ranks_never_read_other_ranks_experts(more_checkpoints, monkeypatch):
    folder = more_checkpoints["qwen3_moe"]  # 8 experts in layers 0 and 2 (layer 1 dense)
    topology = ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=True).topology()
    config, per_rank = _read_all_ranks(folder, topology, monkeypatch)
    split, whole = _split_totals(folder, config, topology)
    for rank, (slices, stats, measured) in enumerate(per_rank):
        experts = {int(n.split(".")[5]) for n in slices if ".experts." in n}
        assert experts == set(range(4 * rank, 4 * rank + 4))
        assert stats.tensors_skipped == 2 * 4 * 3  # 2 sparse layers x 4 experts x gate/up/down
        assert measured == split // 2 + whole
    _assert_slices_rebuild_every_tensor(folder, per_rank)
    footprint = weights_per_rank(config, topology, dtype_bytes=4)
    assert [w.total_bytes for w in footprint] == [m for _, _, m in per_rank]


def test_dp_attention_replicates_mla_attention_and_splits_experts(more_checkpoints, monkeypatch):
    folder = more_checkpoints["deepseek_v3"]
    topology = ParallelConfig(
        tensor_parallel_size=2, enable_dp_attention=True, data_parallel_size=2, enable_expert_parallel=True
    ).topology()
    config, per_rank = _read_all_ranks(folder, topology, monkeypatch)
    split, whole = _split_totals(folder, config, topology)
    for slices, _, measured in per_rank:
        for name, (_, part) in slices.items():
            if ".self_attn." in name or "embed_tokens" in name:
                assert part.dim is None, name  # whole requests per rank: whole attention weights
        assert measured == split // 2 + whole
    _assert_slices_rebuild_every_tensor(folder, per_rank)
    footprint = weights_per_rank(config, topology, dtype_bytes=4)
    assert [w.total_bytes for w in footprint] == [m for _, _, m in per_rank]


def test_kv_bytes_per_rank():
    llama = load_preset("llama-3.1-8b")  # 32 layers, 8 kv heads of 128
    assert kv_bytes_per_token(llama, ParallelConfig(tensor_parallel_size=2).topology(), 2) == 32 * 2 * 4 * 128 * 2
    assert kv_bytes_per_token(llama, ParallelConfig(tensor_parallel_size=16).topology(), 2) == 32 * 2 * 1 * 128 * 2
    lite = load_preset("deepseek-v2-lite")  # 27 layers, latent 512 + rope 64: whole on every rank
    for parallel in (ParallelConfig(tensor_parallel_size=4),
                     ParallelConfig(tensor_parallel_size=4, enable_dp_attention=True, data_parallel_size=4)):
        assert kv_bytes_per_token(lite, parallel.topology(), 2) == 27 * 576 * 2
