"""`SparseMoE` on its own: what it computes, and how checkpoint tensors reach its parameters.

The parity tests cover Qwen3-MoE and Mixtral end to end; DeepSeek's pieces
(sigmoid scoring, expert groups, the correction bias that steers the choice
but not the weight, the scaling factor, shared experts) are pinned here
against a per-token loop written from the DeepSeek-V3 definition, so the
DeepSeek models inherit a layer already known to be right.
"""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file
from torch import nn

from tokenspeed.layers.mlp import GatedMLP
from tokenspeed.layers.moe import MIXTRAL_EXPERT_NAMES, SparseMoE
from tokenspeed.layers.moe_config import MoEConfig
from tokenspeed.models import WeightLoadError, build_model, load_preset, load_weights
from tokenspeed.models.llama import DenseDecoderForCausalLM
from tokenspeed.models.moe_decoder import Qwen3MoeForCausalLM
from tokenspeed.models.presets import tokenizers as pt
from tokenspeed.models.registry import _BUILDERS

HIDDEN, INTER, EXPERTS = 16, 8, 8
DEEPSEEK_LIKE = MoEConfig(
    num_experts=EXPERTS,
    top_k=2,
    moe_intermediate_size=INTER,
    scoring="sigmoid",
    renormalize=True,
    num_groups=4,
    topk_groups=2,
    group_scoring="top2_sum",
    has_correction_bias=True,
    routed_scaling_factor=2.5,
    num_shared_experts=2,
    sparse_layers=(True,),
)


class Block(nn.Module):
    """The smallest module the loader accepts: one `mlp` with the dense model's q/k/v and gate/up packing."""

    packed_modules = DenseDecoderForCausalLM.packed_modules

    def __init__(self, moe: MoEConfig, **kwargs: object) -> None:
        super().__init__()
        self.mlp = SparseMoE(HIDDEN, moe, **kwargs)  # type: ignore[arg-type]


def _checkpoint(
    moe: MoEConfig, seed: int = 0, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj"
):
    """HF-spelled per-expert tensors for `Block(moe)`."""
    gen = torch.Generator().manual_seed(seed)

    def rand(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen)

    tensors = {"mlp.gate.weight": rand(moe.num_experts, HIDDEN)}
    if moe.has_correction_bias:
        tensors["mlp.gate.e_score_correction_bias"] = rand(moe.num_experts)
    for e in range(moe.num_experts):
        tensors[f"mlp.experts.{e}.{gate}.weight"] = rand(INTER, HIDDEN)
        tensors[f"mlp.experts.{e}.{up}.weight"] = rand(INTER, HIDDEN)
        tensors[f"mlp.experts.{e}.{down}.weight"] = rand(HIDDEN, INTER)
    shared = moe.num_shared_experts * INTER
    if shared:
        tensors["mlp.shared_experts.gate_proj.weight"] = rand(shared, HIDDEN)
        tensors["mlp.shared_experts.up_proj.weight"] = rand(shared, HIDDEN)
        tensors["mlp.shared_experts.down_proj.weight"] = rand(HIDDEN, shared)
    return tensors


def _save(tensors: dict[str, torch.Tensor], folder: Path) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(folder / "model.safetensors"))
    return folder


def _swiglu(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def _deepseek_v3_loop(x: torch.Tensor, t: dict[str, torch.Tensor], moe: MoEConfig) -> torch.Tensor:
    """DeepSeek-V3 `noaux_tc` routing + shared experts, one token at a time."""
    out = torch.zeros_like(x)
    per_group = moe.num_experts // moe.num_groups
    for i, token in enumerate(x):
        scores = torch.sigmoid(F.linear(token, t["mlp.gate.weight"]))
        choice = scores + t["mlp.gate.e_score_correction_bias"]
        group_scores = choice.view(moe.num_groups, per_group).topk(2).values.sum(-1)
        keep = group_scores.topk(moe.topk_groups).indices
        masked = torch.full_like(choice, float("-inf"))
        for g in keep.tolist():
            masked[g * per_group : (g + 1) * per_group] = choice[g * per_group : (g + 1) * per_group]
        ids = masked.topk(moe.top_k).indices
        weights = scores[ids] / scores[ids].sum() * moe.routed_scaling_factor
        for w, e in zip(weights, ids.tolist()):
            expert = [t[f"mlp.experts.{e}.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj")]
            out[i] += w * _swiglu(token, *expert)
        shared = [t[f"mlp.shared_experts.{p}.weight"] for p in ("gate_proj", "up_proj", "down_proj")]
        out[i] += _swiglu(token, *shared)
    return out


def test_deepseek_style_block_loads_and_matches_a_per_token_loop(tmp_path: Path) -> None:
    tensors = _checkpoint(DEEPSEEK_LIKE)
    block = Block(DEEPSEEK_LIKE)
    assert isinstance(block.mlp.shared_experts, GatedMLP)
    assert block.mlp.gate.e_score_correction_bias is not None
    load_weights(block, _save(tensors, tmp_path / "ckpt"))
    assert torch.equal(block.mlp.gate.e_score_correction_bias, tensors["mlp.gate.e_score_correction_bias"])
    assert block.mlp.gate.e_score_correction_bias.dtype == torch.float32
    assert torch.equal(block.mlp.experts.w13[5, INTER:], tensors["mlp.experts.5.up_proj.weight"])
    assert torch.equal(block.mlp.experts.w2[7], tensors["mlp.experts.7.down_proj.weight"])

    x = torch.randn(24, HIDDEN, generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        got = block.mlp(x)
    torch.testing.assert_close(got, _deepseek_v3_loop(x, tensors, DEEPSEEK_LIKE), rtol=1e-4, atol=1e-4)
    # The correction bias must steer the choice: without it, some token routes differently.
    with torch.no_grad():
        block.mlp.gate.e_score_correction_bias.zero_()
        assert not torch.allclose(block.mlp(x), got, atol=1e-3)


def test_block_without_shared_experts_or_bias_has_no_such_parameters() -> None:
    moe = MoEConfig(EXPERTS, 2, INTER, "softmax", True, sparse_layers=(True,))
    names = {name for name, _ in Block(moe).named_parameters()}
    assert names == {"mlp.gate.weight", "mlp.experts.w13", "mlp.experts.w2"}


def test_missing_expert_tensor_is_named_in_checkpoint_spelling(tmp_path: Path) -> None:
    tensors = _checkpoint(DEEPSEEK_LIKE)
    del tensors["mlp.experts.3.up_proj.weight"]
    del tensors["mlp.gate.e_score_correction_bias"]
    tensors["mlp.experts.8.up_proj.weight"] = torch.ones(INTER, HIDDEN)  # one expert too many
    tensors["mlp.experts.2.w1.weight"] = torch.ones(INTER, HIDDEN)  # Mixtral spelling in a Qwen-style block
    folder = _save(tensors, tmp_path / "ckpt")
    with pytest.raises(WeightLoadError) as error:
        load_weights(Block(DEEPSEEK_LIKE), folder)
    message = str(error.value)
    assert "missing tensors: mlp.experts.3.up_proj.weight, mlp.gate.e_score_correction_bias;" in message
    assert message.endswith("unexpected tensors: mlp.experts.2.w1.weight, mlp.experts.8.up_proj.weight")


def test_mixtral_expert_names_and_wrong_shapes(tmp_path: Path) -> None:
    moe = MoEConfig(EXPERTS, 2, INTER, "softmax", True, sparse_layers=(True,))
    tensors = _checkpoint(moe, gate="w1", up="w3", down="w2")
    block = Block(moe, expert_names=MIXTRAL_EXPERT_NAMES)
    load_weights(block, _save(tensors, tmp_path / "ok"))
    assert torch.equal(block.mlp.experts.w13[1, :INTER], tensors["mlp.experts.1.w1.weight"])
    assert torch.equal(block.mlp.experts.w13[1, INTER:], tensors["mlp.experts.1.w3.weight"])
    assert torch.equal(block.mlp.experts.w2[1], tensors["mlp.experts.1.w2.weight"])

    tensors["mlp.experts.4.w3.weight"] = torch.ones(INTER + 1, HIDDEN)
    with pytest.raises(WeightLoadError, match=r"mlp\.experts\.4\.w3\.weight: expert 4 up: expected shape"):
        load_weights(block, _save(tensors, tmp_path / "bad"))


def test_qwen3_moe_dummy_weights_and_dense_layers() -> None:
    raw = dict(
        architectures=["Qwen3MoeForCausalLM"],
        hidden_size=HIDDEN,
        intermediate_size=24,
        num_hidden_layers=3,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=8,
        vocab_size=32,
        num_experts=EXPERTS,
        num_experts_per_tok=2,
        moe_intermediate_size=INTER,
        decoder_sparse_step=1,
        mlp_only_layers=[0],
    )
    model = build_model(raw)
    assert isinstance(model, Qwen3MoeForCausalLM)
    kinds = [type(layer.mlp).__name__ for layer in model.model.layers]
    assert kinds == ["GatedMLP", "SparseMoE", "SparseMoE"]
    assert model.model.layers[0].mlp.down_proj.weight.shape == (HIDDEN, 24)
    load_weights(model, None, load_format="dummy", seed=3)
    w13 = model.model.layers[1].mlp.experts.w13
    assert w13.shape == (EXPERTS, 2 * INTER, HIDDEN) and 0.015 < w13.std().item() < 0.025


def test_qwen3_30b_a3b_preset_describes_the_published_model() -> None:
    """Qwen3-30B-A3B's model card: 30.5B parameters, 3.3B activated, 48 layers, 128 experts, 8 active."""
    config = load_preset("qwen3-30b-a3b")
    assert _BUILDERS[config.architecture] is Qwen3MoeForCausalLM
    moe = config.moe
    assert moe is not None and (moe.num_experts, moe.top_k, moe.renormalize) == (128, 8, True)
    assert moe.sparse_layers == (True,) * 48 and config.qk_norm
    attention = config.hidden_size * (2 * config.q_size + 2 * config.kv_size)
    expert = 3 * config.hidden_size * moe.moe_intermediate_size
    router = moe.num_experts * config.hidden_size
    embeddings = 2 * config.vocab_size * config.hidden_size
    total = embeddings + config.num_layers * (attention + router + moe.num_experts * expert)
    active = embeddings + config.num_layers * (attention + router + moe.top_k * expert)
    assert abs(total / 1e9 - 30.5) < 0.1, total
    assert abs(active / 1e9 - 3.3) < 0.1, active
    # Same tokenizer and chat template as Qwen3-8B, so benchmarks see real prompt lengths.
    assert replace(pt.SPECS["qwen3-30b-a3b"], preset="qwen3-8b") == pt.SPECS["qwen3-8b"]
    assert pt.chat_template("qwen3-30b-a3b") == pt.chat_template("qwen3-8b")
