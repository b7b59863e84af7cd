"""Weight loader: sharded and single-file checkpoints, name checks, dummy weights, unknown architectures."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig, LlamaForCausalLM

from tokenspeed.errors import ModelNotSupported
from tokenspeed.models import ModelConfig, WeightLoadError, build_model, load_weights
from tokenspeed.models.loader import find_weight_files

TINY = dict(
    hidden_size=32,
    intermediate_size=48,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    vocab_size=64,
    max_position_embeddings=32,
)


@pytest.fixture(scope="module")
def hf_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**TINY)).eval()


@pytest.fixture(scope="module")
def single(hf_llama: LlamaForCausalLM, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("single")
    hf_llama.save_pretrained(folder)
    return folder


def _copy_with(src: Path, dst: Path, tensors: dict[str, torch.Tensor]) -> Path:
    dst.mkdir()
    (dst / "config.json").write_text((src / "config.json").read_text())
    save_file(tensors, str(dst / "model.safetensors"))
    return dst


def _ours(folder: Path) -> torch.nn.Module:
    return build_model(ModelConfig.from_pretrained(folder))


def test_sharded_checkpoint_loads_like_single_file(
    hf_llama: LlamaForCausalLM, single: Path, tmp_path: Path
) -> None:
    hf_llama.save_pretrained(tmp_path, max_shard_size="20KB")
    assert (tmp_path / "model.safetensors.index.json").is_file()
    assert len(find_weight_files(tmp_path)) > 1
    sharded, whole = _ours(tmp_path), _ours(single)
    load_weights(sharded, tmp_path, progress=True)
    load_weights(whole, single, load_format="safetensors")
    for (name, a), (_, b) in zip(sharded.named_parameters(), whole.named_parameters()):
        assert torch.equal(a, b), name
    # Fused parameters hold the HF parts in order.
    hf_attn = hf_llama.model.layers[1].self_attn
    qkv = sharded.model.layers[1].self_attn.qkv_proj.weight
    expected = torch.cat([hf_attn.q_proj.weight, hf_attn.k_proj.weight, hf_attn.v_proj.weight])
    assert torch.equal(qkv, expected)
    hf_mlp = hf_llama.model.layers[0].mlp
    gate_up = sharded.model.layers[0].mlp.gate_up_proj.weight
    assert torch.equal(gate_up, torch.cat([hf_mlp.gate_proj.weight, hf_mlp.up_proj.weight]))


def test_missing_tensor_is_named(single: Path, tmp_path: Path) -> None:
    tensors = load_file(str(single / "model.safetensors"))
    del tensors["model.layers.1.self_attn.k_proj.weight"]
    del tensors["model.norm.weight"]
    folder = _copy_with(single, tmp_path / "ckpt", tensors)
    with pytest.raises(
        WeightLoadError,
        match=r"missing tensors: model\.layers\.1\.self_attn\.k_proj\.weight, model\.norm\.weight",
    ):
        load_weights(_ours(folder), folder)


def test_unexpected_tensor_is_named_and_known_extras_are_skipped(single: Path, tmp_path: Path) -> None:
    tensors = load_file(str(single / "model.safetensors"))
    tensors["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(4)  # old checkpoints carry this
    tensors["model.layers.0.mystery.weight"] = torch.ones(2)
    folder = _copy_with(single, tmp_path / "ckpt", tensors)
    with pytest.raises(WeightLoadError, match=r"unexpected tensors: model\.layers\.0\.mystery\.weight$"):
        load_weights(_ours(folder), folder)


def test_tied_checkpoint_ignores_a_stray_lm_head(single: Path, tmp_path: Path) -> None:
    tensors = load_file(str(single / "model.safetensors"))
    assert "lm_head.weight" in tensors  # saved untied; the config below ties it
    folder = _copy_with(single, tmp_path / "ckpt", tensors)
    config = json.loads((folder / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    model = _ours(folder)
    load_weights(model, folder)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    assert torch.equal(model.lm_head.weight, tensors["model.embed_tokens.weight"])


def test_shape_mismatch_is_reported(single: Path, tmp_path: Path) -> None:
    tensors = load_file(str(single / "model.safetensors"))
    tensors["model.norm.weight"] = torch.ones(7)
    folder = _copy_with(single, tmp_path / "ckpt", tensors)
    with pytest.raises(WeightLoadError, match=r"model\.norm\.weight: checkpoint shape \(7,\)"):
        load_weights(_ours(folder), folder)


def test_folder_without_weights(single: Path, tmp_path: Path) -> None:
    (tmp_path / "config.json").write_text((single / "config.json").read_text())
    with pytest.raises(WeightLoadError, match="no safetensors weights"):
        load_weights(_ours(tmp_path), tmp_path)
    with pytest.raises(WeightLoadError, match="dummy"):
        load_weights(_ours(tmp_path), None)


def test_dummy_weights_are_deterministic_by_seed() -> None:
    config = ModelConfig.from_dict({"architectures": ["Qwen3ForCausalLM"], **TINY, "head_dim": 8})
    a, b, c = (build_model(config) for _ in range(3))
    load_weights(a, None, load_format="dummy", seed=5)
    load_weights(b, None, load_format="dummy", seed=5)
    load_weights(c, None, load_format="dummy", seed=6)
    for (name, pa), (_, pb), (_, pc) in zip(a.named_parameters(), b.named_parameters(), c.named_parameters()):
        assert torch.equal(pa, pb), name
        if "norm" in name:
            assert torch.equal(pa, torch.ones_like(pa)), name
        else:
            assert not torch.equal(pa, pc), name
    embed = a.model.embed_tokens.weight
    assert 0.015 < embed.std().item() < 0.025


def test_unknown_architecture_names_supported_ones() -> None:
    raw = {"architectures": ["GPT2LMHeadModel"], "n_embd": 8}
    with pytest.raises(
        ModelNotSupported,
        match="GPT2LMHeadModel.*LlamaForCausalLM.*MistralForCausalLM.*Qwen2ForCausalLM.*Qwen3ForCausalLM",
    ):
        ModelConfig.from_dict(raw)
    with pytest.raises(ModelNotSupported, match="supported architectures"):
        build_model(raw)


# Mixture-of-experts checkpoints: per-expert tensors stacked into `experts.w13` / `experts.w2`.
MOE_TINY = dict(TINY, num_experts=4, num_local_experts=4, num_experts_per_tok=2, moe_intermediate_size=16)


def _hf_moe(family: str) -> torch.nn.Module:
    from transformers import MixtralConfig, MixtralForCausalLM, Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    if family == "mixtral":
        return MixtralForCausalLM(MixtralConfig(**MOE_TINY)).eval()
    return Qwen3MoeForCausalLM(Qwen3MoeConfig(**MOE_TINY, head_dim=8)).eval()


@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_checkpoint_per_expert_and_stacked_layouts_load_the_same(family: str, tmp_path: Path) -> None:
    """`save_pretrained` writes one tensor per expert; v5's in-memory state dict stacks them. Both load."""
    hf = _hf_moe(family)
    hf.save_pretrained(tmp_path / "per_expert")
    names = load_file(str(tmp_path / "per_expert" / "model.safetensors"))
    block = "block_sparse_moe" if family == "mixtral" else "mlp"
    gate = "w1" if family == "mixtral" else "gate_proj"
    assert f"model.layers.0.{block}.experts.3.{gate}.weight" in names
    stacked = {name: t.contiguous() for name, t in hf.state_dict().items()}
    assert "model.layers.0.mlp.experts.gate_up_proj" in stacked
    folder = _copy_with(tmp_path / "per_expert", tmp_path / "stacked", stacked)

    a, b = _ours(tmp_path / "per_expert"), _ours(folder)
    load_weights(a, tmp_path / "per_expert")
    load_weights(b, folder)
    hf_experts = hf.model.layers[1].mlp.experts
    for model in (a, b):
        ours = model.model.layers[1].mlp
        assert torch.equal(ours.experts.w13, hf_experts.gate_up_proj)
        assert torch.equal(ours.experts.w2, hf_experts.down_proj)
        assert torch.equal(ours.gate.weight, hf.model.layers[1].mlp.gate.weight)


def test_moe_missing_and_unexpected_expert_tensors_use_checkpoint_names(tmp_path: Path) -> None:
    _hf_moe("mixtral").save_pretrained(tmp_path / "src")
    tensors = load_file(str(tmp_path / "src" / "model.safetensors"))
    del tensors["model.layers.1.block_sparse_moe.experts.2.w3.weight"]
    tensors["model.layers.0.block_sparse_moe.experts.4.w1.weight"] = torch.ones(16, 32)
    folder = _copy_with(tmp_path / "src", tmp_path / "ckpt", tensors)
    with pytest.raises(
        WeightLoadError,
        match=r"missing tensors: model\.layers\.1\.block_sparse_moe\.experts\.2\.w3\.weight; "
        r"unexpected tensors: model\.layers\.0\.block_sparse_moe\.experts\.4\.w1\.weight$",
    ):
        load_weights(_ours(folder), folder)
