"""Every checkpoint tensor of a model (HF name and shape), derived from its config alone.

`tokenspeed placement` sizes what each rank holds for models whose weights are
not on the machine (presets of 8B-685B parameters), so it cannot read
safetensors headers nor build the model. The names are the checkpoints' own
(`block_sparse_moe` for Mixtral, per-expert tensors, MTP layers after the
decoder), so the same `weight_sharding.rule_for` serves this inventory and
the sharded reader; the tests hold the inventory to the headers of real
`save_pretrained` checkpoints of every family.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from tokenspeed.layers.moe_config import MoEConfig
    from tokenspeed.models.config import ModelConfig


@dataclass(frozen=True, slots=True)
class TensorInfo:
    name: str
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        count = 1
        for n in self.shape:
            count *= n
        return count


def checkpoint_tensors(config: ModelConfig) -> list[TensorInfo]:
    """The tensors a checkpoint of `config` holds (MTP layers included; a tied LM head is not stored)."""
    hidden, vocab = config.hidden_size, config.vocab_size
    out = [TensorInfo("model.embed_tokens.weight", (vocab, hidden)), TensorInfo("model.norm.weight", (hidden,))]
    if not config.tie_word_embeddings:
        out.append(TensorInfo("lm_head.weight", (vocab, hidden)))
    num_mtp = config.mla.num_mtp_layers if config.mla is not None else 0
    for i in range(config.num_layers + num_mtp):
        prefix = f"model.layers.{i}"
        out += [
            TensorInfo(f"{prefix}.input_layernorm.weight", (hidden,)),
            TensorInfo(f"{prefix}.post_attention_layernorm.weight", (hidden,)),
        ]
        out += _attention(config, f"{prefix}.self_attn")
        # an MTP layer routes like the last decoder layer
        layer = min(i, config.num_layers - 1)
        moe = config.moe
        if moe is not None and moe.is_sparse(layer):
            block = "block_sparse_moe" if config.model_type == "mixtral" else "mlp"
            out += _moe(config, moe, f"{prefix}.{block}")
        else:
            out += _mlp(f"{prefix}.mlp", hidden, config.intermediate_size, config.mlp_bias)
        if i >= config.num_layers:
            out += [
                TensorInfo(f"{prefix}.embed_tokens.weight", (vocab, hidden)),
                TensorInfo(f"{prefix}.enorm.weight", (hidden,)),
                TensorInfo(f"{prefix}.hnorm.weight", (hidden,)),
                TensorInfo(f"{prefix}.eh_proj.weight", (hidden, 2 * hidden)),
                TensorInfo(f"{prefix}.shared_head.norm.weight", (hidden,)),
                TensorInfo(f"{prefix}.shared_head.head.weight", (vocab, hidden)),
            ]
    return out


def _attention(config: ModelConfig, prefix: str) -> list[TensorInfo]:
    hidden, heads = config.hidden_size, config.num_heads
    mla = config.mla
    if mla is not None:
        out = []
        if mla.q_lora_rank is None:
            out.append(TensorInfo(f"{prefix}.q_proj.weight", (heads * mla.qk_head_dim, hidden)))
        else:
            out += [
                TensorInfo(f"{prefix}.q_a_proj.weight", (mla.q_lora_rank, hidden)),
                TensorInfo(f"{prefix}.q_a_layernorm.weight", (mla.q_lora_rank,)),
                TensorInfo(f"{prefix}.q_b_proj.weight", (heads * mla.qk_head_dim, mla.q_lora_rank)),
            ]
        return out + [
            TensorInfo(f"{prefix}.kv_a_proj_with_mqa.weight", (mla.cache_dim, hidden)),
            TensorInfo(f"{prefix}.kv_a_layernorm.weight", (mla.kv_lora_rank,)),
            TensorInfo(
                f"{prefix}.kv_b_proj.weight", (heads * (mla.qk_nope_head_dim + mla.v_head_dim), mla.kv_lora_rank)
            ),
            TensorInfo(f"{prefix}.o_proj.weight", (hidden, heads * mla.v_head_dim)),
        ]
    q, kv = config.q_size, config.kv_size
    out = [
        TensorInfo(f"{prefix}.q_proj.weight", (q, hidden)),
        TensorInfo(f"{prefix}.k_proj.weight", (kv, hidden)),
        TensorInfo(f"{prefix}.v_proj.weight", (kv, hidden)),
        TensorInfo(f"{prefix}.o_proj.weight", (hidden, q)),
    ]
    if config.qkv_bias:
        out += [
            TensorInfo(f"{prefix}.q_proj.bias", (q,)),
            TensorInfo(f"{prefix}.k_proj.bias", (kv,)),
            TensorInfo(f"{prefix}.v_proj.bias", (kv,)),
        ]
    if config.o_proj_bias:
        out.append(TensorInfo(f"{prefix}.o_proj.bias", (hidden,)))
    if config.qk_norm:
        out += [
            TensorInfo(f"{prefix}.q_norm.weight", (config.head_dim,)),
            TensorInfo(f"{prefix}.k_norm.weight", (config.head_dim,)),
        ]
    return out


def _mlp(prefix: str, hidden: int, intermediate: int, bias: bool = False) -> list[TensorInfo]:
    out = [
        TensorInfo(f"{prefix}.gate_proj.weight", (intermediate, hidden)),
        TensorInfo(f"{prefix}.up_proj.weight", (intermediate, hidden)),
        TensorInfo(f"{prefix}.down_proj.weight", (hidden, intermediate)),
    ]
    if bias:
        out += [
            TensorInfo(f"{prefix}.gate_proj.bias", (intermediate,)),
            TensorInfo(f"{prefix}.up_proj.bias", (intermediate,)),
            TensorInfo(f"{prefix}.down_proj.bias", (hidden,)),
        ]
    return out


def _moe(config: ModelConfig, moe: MoEConfig, prefix: str) -> list[TensorInfo]:
    hidden, inter = config.hidden_size, moe.moe_intermediate_size
    gate, up, down = ("w1", "w3", "w2") if config.model_type == "mixtral" else ("gate_proj", "up_proj", "down_proj")
    out = [TensorInfo(f"{prefix}.gate.weight", (moe.num_experts, hidden))]
    if moe.has_correction_bias:
        out.append(TensorInfo(f"{prefix}.gate.e_score_correction_bias", (moe.num_experts,)))
    for e in range(moe.num_experts):
        out += [
            TensorInfo(f"{prefix}.experts.{e}.{gate}.weight", (inter, hidden)),
            TensorInfo(f"{prefix}.experts.{e}.{up}.weight", (inter, hidden)),
            TensorInfo(f"{prefix}.experts.{e}.{down}.weight", (hidden, inter)),
        ]
    if moe.num_shared_experts:
        out += _mlp(f"{prefix}.shared_experts", hidden, moe.num_shared_experts * inter)
    return out
