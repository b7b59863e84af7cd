"""Placement on real ranks: gloo process groups, the collective wrappers, the fused reduction's
reference, and the parallel layers loaded from sharded checkpoint slices, against one-rank torch.

Ranks are spawned CPU processes (`tests/distributed_ranks.py`); each rank
function runs many checks so the suite pays for few spawns. Every rank can
rebuild every other rank's inputs from seeds, so expectations are computed
locally and the ranks assert themselves.
"""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.nn.functional as F
from safetensors import safe_open

from tests.checkpoints import make_checkpoint
from tests.distributed_ranks import run_ranks
from tokenspeed.kernels.activation.reference import silu_and_mul_reference
from tokenspeed.kernels.comm.partial_sums import PartialSums
from tokenspeed.kernels.comm.reference import fused_allreduce_rmsnorm_reference
from tokenspeed.layers.parallel_embedding import ParallelLMHead, VocabParallelEmbedding
from tokenspeed.layers.parallel_linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.parallel.sharded_reader import ShardedCheckpointReader
from tokenspeed.placement.collectives import (
    all_gather,
    all_reduce,
    all_to_all,
    partial_sums,
    reduce_scatter,
)
from tokenspeed.placement.parallel_config import ParallelConfig, Topology
from tokenspeed.placement.placements import ParallelGroup
from tokenspeed.placement.process_groups import ParallelGroups, create_parallel_groups

ATTN_TP, ATTN_DP, DENSE_TP = ParallelGroup.ATTN_TP, ParallelGroup.ATTN_DP, ParallelGroup.DENSE_TP


def _inputs(world: int, shape: tuple[int, ...], seed: int = 100) -> list[torch.Tensor]:
    return [torch.randn(shape, generator=torch.Generator().manual_seed(seed + r)) for r in range(world)]


def _close(got: torch.Tensor, want: torch.Tensor, atol: float = 1e-6) -> None:
    torch.testing.assert_close(got, want, rtol=0, atol=atol)


def _checkpoint(folder: str, topology: Topology, rank: int) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """(this rank's slices through the sharded reader, the whole tensors as the oracle)."""
    config = ModelConfig.from_pretrained(folder)
    local = {name: tensor for name, tensor, _ in ShardedCheckpointReader(folder, config, topology, rank)}
    with safe_open(os.path.join(folder, "model.safetensors"), framework="pt") as f:
        full = {name: f.get_tensor(name) for name in list(f.keys())}
    return local, full


def _check_collectives(rank: int, world: int, groups: ParallelGroups) -> None:
    tp = groups[ATTN_TP]
    xs = _inputs(world, (6, 8))
    total = sum(xs[1:], xs[0])
    _close(all_reduce(xs[rank].clone(), tp), total, atol=0)
    assert torch.equal(all_gather(xs[rank], tp, dim=0), torch.cat(xs, 0))
    assert torch.equal(all_gather(xs[rank], tp, dim=-1), torch.cat(xs, -1))
    _close(reduce_scatter(xs[rank].clone(), tp, dim=0), total.chunk(world, 0)[rank], atol=0)
    _close(reduce_scatter(xs[rank].clone(), tp, dim=-1), total.chunk(world, -1)[rank], atol=0)
    # rank r sends 1 + (r + j) % 2 rows to rank j
    counts = [[1 + (r + j) % 2 for j in range(world)] for r in range(world)]
    pieces = [list(xs[r][: sum(counts[r])].split(counts[r])) for r in range(world)]
    received = all_to_all(xs[rank][: sum(counts[rank])], tp, counts[rank], [counts[j][rank] for j in range(world)])
    assert torch.equal(received, torch.cat([pieces[j][rank] for j in range(world)]))

    weight, residual = torch.randn(8), torch.randn(6, 8)
    for res in (None, residual):
        got = fused_allreduce_rmsnorm_reference(partial_sums(xs[rank].clone(), tp), weight, 1e-6, res)
        want = fused_allreduce_rmsnorm_reference(PartialSums.simulated(torch.stack(xs), rank), weight, 1e-6, res)
        for g, w in zip(got, want):
            _close(g, w, atol=0)


def _check_llama_layers(rank: int, groups: ParallelGroups, folder: str) -> None:
    """Tiny Llama (hidden 64, 4 heads, 2 kv heads of 16, intermediate 128, vocab 384, tied) at TP=2."""
    local, full = _checkpoint(folder, groups.topology, rank)
    tp, dense = groups[ATTN_TP], groups[DENSE_TP]
    layer = "model.layers.0"
    ids = torch.randint(3, 384, (7,), generator=torch.Generator().manual_seed(5))

    embed = VocabParallelEmbedding(384, 64, dense)
    embed.weight.data.copy_(local["model.embed_tokens.weight"])
    h = embed(ids)
    assert torch.equal(h, F.embedding(ids, full["model.embed_tokens.weight"]))  # adding zeros is exact

    qkv = QKVParallelLinear(64, head_dim=16, num_heads=4, num_kv_heads=2, group=tp)
    for part in "qkv":
        qkv.load_shard("weight", part, local[f"{layer}.self_attn.{part}_proj.weight"])
    q, k, v = qkv.split_output(qkv(h))
    heads = slice(rank * 32, (rank + 1) * 32)  # 2 query heads and 1 kv head of 16 per rank
    kv_heads = slice(rank * 16, (rank + 1) * 16)
    _close(q, F.linear(h, full[f"{layer}.self_attn.q_proj.weight"])[:, heads])
    _close(k, F.linear(h, full[f"{layer}.self_attn.k_proj.weight"])[:, kv_heads])
    _close(v, F.linear(h, full[f"{layer}.self_attn.v_proj.weight"])[:, kv_heads])

    o_proj = RowParallelLinear(64, 64, tp)
    o_proj.weight.data.copy_(local[f"{layer}.self_attn.o_proj.weight"])
    heads_out = torch.randn(7, 64, generator=torch.Generator().manual_seed(6))  # stands for attention output
    _close(o_proj(heads_out[:, heads]), F.linear(heads_out, full[f"{layer}.self_attn.o_proj.weight"]))

    gate_up = ColumnParallelLinear(64, {"gate": 128, "up": 128}, dense)
    down = RowParallelLinear(128, 64, dense)
    gate_up.load_shard("weight", "gate", local[f"{layer}.mlp.gate_proj.weight"])
    gate_up.load_shard("weight", "up", local[f"{layer}.mlp.up_proj.weight"])
    down.weight.data.copy_(local[f"{layer}.mlp.down_proj.weight"])
    gate = F.linear(h, full[f"{layer}.mlp.gate_proj.weight"])
    up = F.linear(h, full[f"{layer}.mlp.up_proj.weight"])
    _close(down(silu_and_mul_reference(gate_up(h))), F.linear(F.silu(gate) * up, full[f"{layer}.mlp.down_proj.weight"]))

    gathered = ColumnParallelLinear(64, {"gate": 128, "up": 128}, dense, gather_output=True)
    gathered.load_state_dict(gate_up.state_dict())
    _close(gathered(h), torch.cat([gate, up], dim=-1))

    head = ParallelLMHead(384, 64, dense, tied_to=embed)
    _close(head(h), F.linear(h, full["model.embed_tokens.weight"]).float())


def _check_replicated_kv(rank: int, groups: ParallelGroups, folder: str) -> None:
    """Tiny Qwen2 (8 heads of 8, ONE kv head, q/k/v bias) at TP=2: both ranks hold the whole kv head."""
    local, full = _checkpoint(folder, groups.topology, rank)
    tp, prefix = groups[ATTN_TP], "model.layers.1.self_attn"
    qkv = QKVParallelLinear(64, head_dim=8, num_heads=8, num_kv_heads=1, group=tp, bias=True)
    assert qkv.num_local_kv_heads == 1
    for part in "qkv":
        for param in ("weight", "bias"):
            qkv.load_shard(param, part, local[f"{prefix}.{part}_proj.{param}"])
    h = torch.randn(5, 64, generator=torch.Generator().manual_seed(7))
    q, k, v = qkv.split_output(qkv(h))
    heads = slice(rank * 32, (rank + 1) * 32)
    _close(q, F.linear(h, full[f"{prefix}.q_proj.weight"], full[f"{prefix}.q_proj.bias"])[:, heads])
    _close(k, F.linear(h, full[f"{prefix}.k_proj.weight"], full[f"{prefix}.k_proj.bias"]))
    _close(v, F.linear(h, full[f"{prefix}.v_proj.weight"], full[f"{prefix}.v_proj.bias"]))


def _two_ranks(rank: int, world: int, llama: str, qwen2: str) -> dict[str, object]:
    topology = ParallelConfig(tensor_parallel_size=world).topology()
    groups = create_parallel_groups(topology, rank)
    _check_collectives(rank, world, groups)
    _check_llama_layers(rank, groups, llama)
    _check_replicated_kv(rank, groups, qwen2)
    return {kind.value: (groups[kind].ranks, groups[kind].rank) for kind in ParallelGroup}


def test_collectives_and_parallel_layers_on_two_gloo_ranks(tmp_path):
    llama = make_checkpoint("llama", tmp_path / "llama")
    qwen2 = make_checkpoint("qwen2", tmp_path / "qwen2")
    results = run_ranks(_two_ranks, str(llama), str(qwen2), world_size=2)
    for rank, groups in enumerate(results):
        assert groups["ATTN_TP"] == ((0, 1), rank) and groups["DENSE_TP"] == ((0, 1), rank)
        assert groups["ATTN_DP"] == ((rank,), 0)


def _mesh(rank: int, world: int) -> dict[str, object]:
    """2 attention-DP groups of 2 TP ranks: the reduction the compiler emits for Partial(world) -> tokens."""
    topology = ParallelConfig(tensor_parallel_size=4, enable_dp_attention=True, data_parallel_size=2).topology()
    groups = create_parallel_groups(topology, rank)
    assert groups[DENSE_TP].process_group is groups[ParallelGroup.MOE_TP_EP].process_group
    xs = _inputs(world, (4, 8))
    total = sum(xs[1:], xs[0])
    dp_index = topology.coordinate(ATTN_DP, rank)
    mine = reduce_scatter(all_reduce(xs[rank].clone(), groups[ATTN_TP]), groups[ATTN_DP], dim=0)
    _close(mine, total.chunk(2, 0)[dp_index])
    _close(all_gather(mine, groups[ATTN_DP], dim=0), total)
    return {kind.value: groups[kind].ranks for kind in (ATTN_TP, ATTN_DP)}


def test_four_rank_mesh_groups_and_the_two_step_reduction():
    results = run_ranks(_mesh, world_size=4)
    assert [r["ATTN_TP"] for r in results] == [(0, 1), (0, 1), (2, 3), (2, 3)]
    assert [r["ATTN_DP"] for r in results] == [(0, 2), (1, 3), (0, 2), (1, 3)]


def _rank_one_fails(rank: int, world: int) -> None:
    if rank == 1:
        raise RuntimeError("rank 1 gives up")
    all_reduce(torch.ones(1), create_parallel_groups(ParallelConfig(2).topology(), rank)[DENSE_TP])


def test_a_failing_rank_fails_the_test_at_once_and_leaves_no_process():
    start = time.monotonic()
    with pytest.raises(AssertionError, match="rank 1 gives up"):
        run_ranks(_rank_one_fails, world_size=2, timeout_s=60)
    assert time.monotonic() - start < 30  # rank 0, stuck in its all-reduce, was killed rather than awaited
    import multiprocessing

    assert not [p for p in multiprocessing.active_children() if p.is_alive()]
