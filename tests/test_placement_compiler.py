"""The placement compiler's op lists: which collective it puts where, on which group, for how many bytes.

Models are the shipped presets (real shapes, config only) and the tiny test
configs; the printed plans are held to golden text in
`test_placement_command.py`.
"""

from __future__ import annotations

import pytest

from tokenspeed.models.config import ModelConfig
from tokenspeed.models.presets import load_preset
from tokenspeed.placement.compiler import CompiledPlan, OpKind, compile_plan
from tokenspeed.placement.model_graph import describe_model
from tokenspeed.placement.module_specs import ModuleKind
from tokenspeed.placement.parallel_config import ParallelConfig
from tokenspeed.placement.placements import ParallelGroup, Partial, Replicate, Shard, format_layout

ATTN_TP, ATTN_DP, DENSE_TP, MOE = (
    ParallelGroup.ATTN_TP,
    ParallelGroup.ATTN_DP,
    ParallelGroup.DENSE_TP,
    ParallelGroup.MOE_TP_EP,
)
FUSED, COMPUTE = OpKind.FUSED_ALLREDUCE_RMSNORM, OpKind.COMPUTE


def _plan(config: ModelConfig, parallel: ParallelConfig, dtype_bytes: int = 2) -> CompiledPlan:
    return compile_plan(describe_model(config), parallel.validate_for_model(config), dtype_bytes=dtype_bytes)


def _steps(plan: CompiledPlan, layer: int | None) -> list[tuple[str, str, str | None]]:
    """(op, module kind, group) per op of one layer."""
    return [
        (op.kind.value, op.module.kind.value, op.group.value if op.group else None)
        for op in plan.layer_ops(layer)
    ]


def test_llama_at_tp2_is_fused_norm_attention_fused_norm_mlp_with_reductions_deferred():
    config = load_preset("llama-3.1-8b")
    plan = _plan(config, ParallelConfig(tensor_parallel_size=2))
    for layer in range(config.num_layers):
        assert _steps(plan, layer) == [
            ("fused_allreduce_rmsnorm", "norm", "DENSE_TP"),
            ("compute", "attention", None),
            ("fused_allreduce_rmsnorm", "norm", "ATTN_TP"),
            ("compute", "dense_mlp", None),
        ]
        attention, mlp = plan.layer_ops(layer)[1], plan.layer_ops(layer)[3]
        assert attention.layout == (Partial(ATTN_TP),) and mlp.layout == (Partial(DENSE_TP),)  # left pending
    assert OpKind.ALL_REDUCE not in {op.kind for op in plan.ops}  # every reduction fused into a norm
    assert _steps(plan, None) == [
        ("compute", "embedding", None),  # vocab-parallel: a partial sum, reduced by layer 0's norm
        ("fused_allreduce_rmsnorm", "norm", "DENSE_TP"),
        ("compute", "lm_head", None),
        ("all_gather", "lm_head", "DENSE_TP"),  # vocab-sharded logits to every rank
    ]
    fused = plan.layer_ops(0)[0]
    assert fused.group_size == 2 and fused.bytes_per_token == 4096 * 2  # ring: 2(n-1)/n of a bf16 row
    logits = plan.ops[-1]
    assert logits.dim == -1 and logits.bytes_per_token == 128256 * 4 // 2 and logits.layout == ()


@pytest.mark.parametrize("preset", ["llama-3.1-8b", "qwen3-30b-a3b", "deepseek-v2-lite"])
def test_world_size_one_has_no_collective(preset: str):
    config = load_preset(preset)
    plan = _plan(config, ParallelConfig())
    assert plan.collectives() == () and plan.bytes_per_token() == 0
    assert [op.kind for op in plan.ops] == [COMPUTE] * len(plan.graph.modules)
    assert [op.module for op in plan.ops] == list(plan.graph.modules)
    assert all(op.layout == () for op in plan.ops)


def test_moe_with_expert_parallelism_all_reduces_the_experts_partial_sum():
    config = load_preset("qwen3-30b-a3b")  # 128 experts, top-8, every layer sparse
    plan = _plan(config, ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=True))
    assert plan.topology.moe_ep == 4 and plan.topology.moe_tp == 1
    assert _steps(plan, 1) == [
        ("fused_allreduce_rmsnorm", "norm", "MOE_TP_EP"),  # the previous layer's experts, summed over EP
        ("compute", "attention", None),
        ("fused_allreduce_rmsnorm", "norm", "ATTN_TP"),
        ("compute", "moe", None),
    ]
    assert plan.layer_ops(1)[3].layout == (Partial(MOE),)
    mixed = _plan(config, ParallelConfig(tensor_parallel_size=4, enable_expert_parallel=True, expert_parallel_size=2))
    assert (mixed.topology.moe_ep, mixed.topology.moe_tp) == (2, 2)
    assert _steps(mixed, 1) == _steps(plan, 1)  # EP x TP still leaves one partial sum over the world


def test_dp_attention_gathers_tokens_before_the_moe_and_reduce_scatters_after():
    config = load_preset("deepseek-v2-lite")  # layer 0 dense, then MoE; MLA attention
    parallel = ParallelConfig(tensor_parallel_size=4, enable_dp_attention=True, data_parallel_size=4)
    plan = _plan(config, parallel)
    tokens = (Shard(0, ATTN_DP),)
    assert _steps(plan, 0) == [
        ("compute", "norm", None),
        ("compute", "mla_attention", None),  # whole requests per rank: no reduction at all
        ("compute", "norm", None),
        ("all_gather", "dense_mlp", "ATTN_DP"),
        ("compute", "dense_mlp", None),
    ]
    assert _steps(plan, 1) == [
        ("reduce_scatter", "norm", "DENSE_TP"),  # each rank keeps the sum of its own tokens only
        ("compute", "norm", None),
        ("compute", "mla_attention", None),
        ("compute", "norm", None),
        ("all_gather", "moe", "ATTN_DP"),
        ("compute", "moe", None),
    ]
    assert plan.layer_ops(1)[2].layout == tokens
    gather, scatter = plan.layer_ops(1)[4], plan.layer_ops(2)[0]
    assert gather.dim == scatter.dim == 0 and scatter.group is MOE
    assert gather.bytes_per_token == scatter.bytes_per_token == 2048 * 2 * 3 // 4


def test_all_to_all_moe_dispatches_and_combines_inside_the_layer():
    config = load_preset("deepseek-v2-lite")
    parallel = ParallelConfig(
        tensor_parallel_size=4,
        enable_dp_attention=True,
        data_parallel_size=4,
        enable_expert_parallel=True,
        all2all_backend="alltoall",
    )
    plan = _plan(config, parallel)
    steps = _steps(plan, 2)
    assert steps == [
        ("compute", "norm", None),
        ("compute", "mla_attention", None),
        ("compute", "norm", None),
        ("all_to_all", "moe", "MOE_TP_EP"),
        ("compute", "moe", None),
        ("all_to_all", "moe", "MOE_TP_EP"),
    ]
    dispatch, combine = plan.layer_ops(2)[3], plan.layer_ops(2)[5]
    assert (dispatch.detail, combine.detail) == ("dispatch", "combine")
    # each rank sends its quarter of the tokens to 6 experts, 3/4 of them remote: 6 * 3/16 rows per token
    assert dispatch.bytes_per_token == 2048 * 2 * 6 * 3 // 16


def test_two_by_two_mesh_reduces_over_tp_then_scatters_over_dp():
    config = load_preset("deepseek-v2-lite")
    parallel = ParallelConfig(
        tensor_parallel_size=4, enable_dp_attention=True, data_parallel_size=2, enable_expert_parallel=True
    )
    plan = _plan(config, parallel)
    assert _steps(plan, 2)[:4] == [
        ("all_reduce", "norm", "ATTN_TP"),
        ("reduce_scatter", "norm", "ATTN_DP"),
        ("compute", "norm", None),
        ("compute", "mla_attention", None),
    ]
    assert plan.layer_ops(2)[3].layout == (Shard(0, ATTN_DP), Partial(ATTN_TP))
    assert format_layout(plan.layer_ops(2)[3].layout) == "Shard(0, ATTN_DP) + Partial(ATTN_TP)"
    assert _steps(plan, 2)[4][:3] == ("fused_allreduce_rmsnorm", "norm", "ATTN_TP")


def test_tiny_test_families_compile_with_every_norm_fused_and_seeing_complete_values():
    from tests.checkpoints import FAMILIES

    for family in ("llama", "qwen2", "qwen3", "mistral", "qwen3_moe", "mixtral"):
        spec = {k: v for k, v in FAMILIES[family].items() if k != "config"}
        raw = {"model_type": family, "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 3,
               "vocab_size": 384, "max_position_embeddings": 256, **spec}
        config = ModelConfig.from_dict(raw)
        plan = _plan(config, ParallelConfig(tensor_parallel_size=2, enable_expert_parallel=config.moe is not None))
        norms = [op for op in plan.ops if op.module.kind is ModuleKind.NORM]
        assert len(norms) == 2 * 3 + 1
        assert all(op.kind is FUSED and op.layout == () for op in norms)
    assert format_layout((Replicate(DENSE_TP),)) == "Replicate"
