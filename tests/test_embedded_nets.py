"""The trainable networks are the checkpoints' architectures: same logits as transformers, same names as shipped.

Each network gets random weights, is exported with `hf_state_dict` through
the same writer the training command uses, and transformers loads the folder;
logits must agree in fp32. The shipped configs must fit the size budget
(the models with their draft heads <= 16 MB in bf16 in all).
"""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tests.checkpoints import load_hf
from tokenspeed.models.embedded.materialize import (
    EAGLE_DIR,
    package_config,
    package_dir,
    write_model_folder,
)
from tokenspeed.models.embedded.training.deepseek_net import DeepseekNet
from tokenspeed.models.embedded.training.eagle import (
    EAGLE1_RECIPE,
    RECIPE,
    RECIPES,
    EagleHead,
    EagleRecipe,
    eagle_config,
    eagle_loss,
)
from tokenspeed.models.embedded.training.nets import build_net
from tokenspeed.models.embedded.training.qwen3_net import Qwen3Net
from tokenspeed.models.embedded.training.run import DEFAULT_EAGLE_RECIPE

SMALL_DENSE = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                   num_key_value_heads=2, head_dim=16, initializer_range=0.1)
SMALL_MOE = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=16, num_hidden_layers=3,
                 num_attention_heads=4, num_key_value_heads=4, q_lora_rank=32, kv_lora_rank=32,
                 qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, initializer_range=0.1)
MAX_SHIPPED_BYTES = 16_000_000


def _logits(net, ids):
    with torch.no_grad():
        return F.linear(net(ids), net.head_weight)


@pytest.mark.parametrize("name, small", [("embedded", SMALL_DENSE), ("embedded-moe", SMALL_MOE)])
def test_trainable_net_matches_transformers(tmp_path, name, small):
    torch.manual_seed(0)
    config = {**package_config(name), **small}
    net = build_net(config).eval()
    if isinstance(net, DeepseekNet):  # a zero bias would leave the correction path untested
        for block in net.moe_blocks():
            block.gate.e_score_correction_bias.copy_(0.3 * torch.randn(block.num_experts))
    write_model_folder(tmp_path, config, net.hf_state_dict())
    net.load_hf_state_dict({k: v.to(torch.bfloat16).float() for k, v in net.hf_state_dict().items()})
    ids = torch.randint(7, config["vocab_size"], (2, 48))
    with torch.no_grad():
        ours, theirs = _logits(net, ids), load_hf(tmp_path)(ids).logits
    assert (ours - theirs).abs().max() < 1e-4 * max(1.0, float(theirs.abs().max()))


def test_deepseek_export_has_deepseek_mtp_names_and_round_trips():
    torch.manual_seed(1)
    config = {**package_config("embedded-moe"), **SMALL_MOE}
    net = DeepseekNet(config)
    full, compact = net.hf_state_dict(), net.hf_state_dict(compact=True)
    mtp = f"model.layers.{config['num_hidden_layers']}"
    for leaf in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 "mlp.gate.e_score_correction_bias", "mlp.experts.0.gate_proj.weight", "self_attn.kv_b_proj.weight"):
        assert f"{mtp}.{leaf}" in compact, leaf
    copies = {f"{mtp}.embed_tokens.weight", f"{mtp}.shared_head.head.weight"}
    assert set(full) - set(compact) == copies
    assert "model.layers.0.mlp.gate_proj.weight" in full  # first_k_dense_replace = 1: layer 0 is dense
    other = DeepseekNet(config)
    other.load_hf_state_dict(full)
    ids = torch.randint(7, 4096, (1, 20))
    assert torch.equal(_logits(net, ids), _logits(other, ids))
    hidden = net(ids)
    assert torch.equal(net.mtp(hidden[:, :-1], ids[:, 1:])[0], other.mtp(hidden[:, :-1], ids[:, 1:])[0])


def test_expert_balancing_moves_the_bias_toward_under_loaded_experts():
    net = DeepseekNet({**package_config("embedded-moe"), **SMALL_MOE})
    experts = net.moe_blocks()[0].num_experts
    loads = torch.zeros(len(net.moe_blocks()), experts)
    loads[:, 0] = 10.0  # expert 0 takes everything
    net.balance_experts(loads, 0.01)
    bias = net.moe_blocks()[0].gate.e_score_correction_bias
    assert bias[0] < 0 and bool((bias[1:] > 0).all())


def test_eagle_head_has_the_documented_layout_and_learns():
    torch.manual_seed(2)
    target = Qwen3Net({**package_config("embedded"), **SMALL_DENSE})
    config = eagle_config(target.config, 64)
    head = build_net(config, draft=True)
    assert isinstance(head, EagleHead)
    names = set(head.hf_state_dict())
    assert {"fc.weight", "fc.bias", "layers.0.post_attention_layernorm.weight", "layers.0.mlp.down_proj.weight",
            "layers.0.self_attn.q_proj.weight", "layers.0.self_attn.o_proj.weight"} <= names
    assert not any("input_layernorm" in n or "embed_tokens" in n or "lm_head" in n or n == "norm.weight"
                   for n in names)
    ids = torch.randint(7, 4096, (2, 24))
    hidden = target(ids).detach()
    optimizer = torch.optim.AdamW(head.parameters(), lr=3e-3)
    losses = []
    for _ in range(30):
        loss, _ = eagle_loss(head, hidden, ids, target.model.embed_tokens.weight.detach(),
                             target.head_weight.detach(), noise=False)
        loss.backward()
        optimizer.step()
        optimizer.zero_grad()
        losses.append(float(loss))
    assert losses[-1] < 0.8 * losses[0]


def test_eagle_loss_terms_of_a_recipe():
    """Each term of `EagleRecipe` counts with its weight; the EAGLE-1 recipe is feature + 0.1 x soft CE."""
    torch.manual_seed(3)
    target = Qwen3Net({**package_config("embedded"), **SMALL_DENSE})
    head = EagleHead(eagle_config(target.config, 64))
    ids = torch.randint(7, 4096, (2, 16))
    hidden = target(ids).detach()
    embed, lm_head = target.model.embed_tokens.weight.detach(), target.head_weight.detach()
    loss, parts = eagle_loss(head, hidden, ids, embed, lm_head, noise=False, recipe=EAGLE1_RECIPE)
    assert torch.allclose(loss, parts["feature_loss"] + 0.1 * parts["token_loss"])
    full = EagleRecipe(feature_weight=0.5, token_weight=1.0, hard_token_weight=0.25, second_step_weight=0.5)
    loss, parts = eagle_loss(head, hidden, ids, embed, lm_head, noise=False, recipe=full)
    first = 0.5 * parts["feature_loss"] + parts["token_loss"] + 0.25 * parts["hard_token_loss"]
    second = 0.5 * parts["second_feature_loss"] + parts["second_token_loss"] + 0.25 * parts["second_hard_token_loss"]
    assert torch.allclose(loss, first + 0.5 * second)
    loss.backward()
    assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in head.parameters())
    assert RECIPES[DEFAULT_EAGLE_RECIPE] == RECIPE


def test_shipped_configs_fit_the_size_budget():
    """bf16 bytes of what the repository carries: the models with their draft heads <= 16 MB in all."""
    dense = package_config("embedded")
    draft = package_config("embedded", draft=True)
    assert draft == json.loads(json.dumps(eagle_config(dense, draft["intermediate_size"])))
    assert (package_dir() / EAGLE_DIR / "config.json").is_file()
    with torch.device("meta"):
        sizes = {
            "embedded": Qwen3Net(dense).hf_state_dict() | {f"eagle.{k}": v for k, v in EagleHead(draft).hf_state_dict().items()},
            "embedded-moe": DeepseekNet(package_config("embedded-moe")).hf_state_dict(compact=True),
        }
    total = sum(2 * t.numel() for tensors in sizes.values() for t in tensors.values())
    assert total <= MAX_SHIPPED_BYTES, {name: 2 * sum(t.numel() for t in ts.values()) for name, ts in sizes.items()}
