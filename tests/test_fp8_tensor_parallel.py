"""FP8 weights over two ranks (CPU, gloo, fp32) against one rank: block-FP8 checkpoints and online quantisation.

Each case runs the workloads of `tests/multi_rank_runs.py` on one rank and on
two, with the same FP8 weights: greedy tokens identical, log-probabilities
within 1e-5, through prefix hits, chunked prefill and preemption. That holds
only if every rank holds exactly its share of what one rank holds:

- block-FP8 checkpoints (DeepSeek-V3's format, `tests/fp8_checkpoints.py`):
  each rank reads its slice of every fp8 weight and the block scales that
  slice falls in; blocks (16, 128) keep the tiny Llama / Qwen3-MoE parts on
  block rows, DeepSeek-V3's (128, 128) are larger than every tiny part, so
  both ranks' halves fall inside one block; MLA's `kv_b_proj` is dequantised
  per rank. Dense TP (also with `modules_to_not_convert` leaving some layers
  bf16), experts over EP and split by their intermediate size (MoE TP), MLA
  heads split, and DP attention.
- online quantisation (`quantization="fp8"`, one scale per output row): a
  rank holding part of each row of `o_proj`, `down_proj` or an expert's `w2`
  must scale it by the whole row's amax, gathered from the other ranks.

The fp8 weights are shown in use on rank 0 (its own, smaller, fp8 parameters).
A checkpoint whose blocks a rank's share would cut is refused before any rank
starts, with the tensor named; `scale_slice` is checked on its own.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.fp8_checkpoints import assert_two_ranks_match_one, make_source, to_block_fp8
from tests.multi_rank_runs import engine
from tokenspeed.models.parallel.fp8_sharding import scale_slice
from tokenspeed.models.parallel.weight_sharding import TensorSlice, WeightShardingError

# case -> (family, block (None: online quantisation), expert parallel, DP attention)
CASES: dict[str, tuple[str, tuple[int, int] | None, bool, bool]] = {
    "llama_block": ("llama", (16, 128), False, False),
    "llama_block_not_convert": ("llama", (16, 128), False, False),  # with NOT_CONVERT
    "qwen3_moe_block_ep": ("qwen3_moe", (16, 128), True, False),
    "qwen3_moe_block_moe_tp": ("qwen3_moe", (16, 128), False, False),
    "deepseek_v3_block": ("deepseek_v3", (128, 128), False, False),
    "deepseek_v3_block_dp_attention": ("deepseek_v3", (128, 128), True, True),
    "llama_online": ("llama", None, False, False),
    "qwen3_moe_online_moe_tp": ("qwen3_moe", None, False, False),
    "deepseek_v3_online_ep": ("deepseek_v3", None, True, False),
}

# bf16 modules among fp8 ones (`modules_to_not_convert`), split over the ranks as usual
NOT_CONVERT = {"llama_block_not_convert": ("model.layers.0.self_attn", "mlp.down_proj")}


@pytest.fixture(scope="module")
def sources(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8_tp_sources")
    return {family: make_source(family, root / family) for family in ("llama", "qwen3_moe", "deepseek_v3")}


@pytest.mark.parametrize("case", sorted(CASES))
def test_fp8_weights_on_two_ranks_match_one(case: str, sources: dict[str, Path], tmp_path: Path) -> None:
    family, block, ep, dp_attention = CASES[case]
    folder = sources[family]
    options: dict[str, object] = {"quantization": "fp8"} if block is None else {}
    if block is not None:
        folder = tmp_path / "fp8"
        to_block_fp8(sources[family], folder, block=block, not_convert=NOT_CONVERT.get(case, ()))
    rank0_fp8 = assert_two_ranks_match_one(case, folder, ep, dp_attention, **options)
    assert not any("kv_b_proj" in name for name in rank0_fp8), "kv_b_proj must be dequantised for absorption"


def test_fp8_blocks_a_rank_would_cut_are_refused_before_any_rank_starts(
    sources: dict[str, Path], tmp_path: Path
) -> None:
    """24-row blocks: rank 1's q rows [32, 64) start inside block 1 and run into block 2. One rank loads it
    (its fused q/k/v keeps scales per row)."""
    folder = tmp_path / "fp8"
    to_block_fp8(sources["llama"], folder, block=(24, 128))
    with pytest.raises(WeightShardingError, match=r"q_proj.weight: a rank's rows \[32, 64\) start inside a 24-row"):
        engine(folder, 2, False)
    engine(folder, 1, False).shutdown()


@pytest.mark.parametrize(
    ("part", "shape", "block", "want"),
    [
        (TensorSlice(0, 256, 512), (1024, 512), (128, 128), TensorSlice(0, 2, 4)),  # on block rows
        (TensorSlice(0, 256, 300), (1024, 512), (128, 128), TensorSlice(0, 2, 3)),  # a partial last block
        (TensorSlice(0, 64, 128), (1024, 512), (128, 128), TensorSlice(0, 0, 1)),  # inside one block
        (TensorSlice(1, 32, 64), (96, 64), (128, 128), TensorSlice(1, 0, 1)),  # the block clipped to the weight
        (TensorSlice(1, 1024, 2048), (512, 4096), (128, 128), TensorSlice(1, 8, 16)),  # input columns
        (TensorSlice(), (96, 64), (128, 128), TensorSlice()),  # replicated: every scale
    ],
)
def test_scale_slice_gives_the_blocks_a_rank_reads(part, shape, block, want) -> None:
    assert scale_slice("w", part, shape, block) == want


def test_scale_slice_refuses_a_range_that_starts_inside_a_block_and_runs_past_it() -> None:
    with pytest.raises(WeightShardingError, match=r"experts.0.up_proj.weight: a rank's rows \[192, 384\).*"
                       "enable_expert_parallel"):
        scale_slice("model.layers.0.mlp.experts.0.up_proj.weight", TensorSlice(0, 192, 384), (768, 2048), (128, 128))
    with pytest.raises(WeightShardingError, match="input columns .* a tensor_parallel_size that splits its 1536"):
        scale_slice("o_proj.weight", TensorSlice(1, 192, 384), (2048, 1536), (128, 128))
