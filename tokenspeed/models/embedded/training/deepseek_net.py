"""The trainable DeepSeek-V3 decoder of `embedded-moe`: MLA, noaux_tc MoE with a shared expert, MTP.

Names are DeepSeek-V3's checkpoint names, so the export loads in transformers
(`DeepseekV3ForCausalLM`, which skips the MTP layer) and in our engine
(which keeps it):

- layer i < `first_k_dense_replace`: dense `mlp.{gate,up,down}_proj`; later
  layers: `mlp.gate.weight`, `mlp.gate.e_score_correction_bias`,
  `mlp.experts.{e}.{gate,up,down}_proj.weight`, `mlp.shared_experts.*`;
- the MTP layer is `model.layers.{num_hidden_layers}`: a decoder layer plus
  `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, and, as in DeepSeek's
  checkpoints, its own copies `embed_tokens` and `shared_head.head` of the
  main embedding and LM head (shared while training, as the DeepSeek-V3
  report describes; `hf_state_dict(compact=True)` leaves the copies out).

MTP (DeepSeek-V3 report, section 2.2, one module): at position p, with `h_p`
the main model's final hidden state after the final norm (the LM head's
input, what vLLM and SGLang hand their MTP drafters) and `t_{p+1}` the next
token, `x = eh_proj([enorm(embed(t_{p+1})) ; hnorm(h_p)])` runs through the
MTP decoder layer (causal attention over the MTP layer's own sequence, rope
position p) and `shared_head.head(shared_head.norm(.))` predicts `t_{p+2}`.
It is trained jointly, loss = main + `mtp_loss_weight` x MTP (0.3, as
DeepSeek-V3 early in training), its gradient reaching the main model.
Unlike vLLM, no embedding is zeroed at position 0.

Routing is transformers' noaux_tc: sigmoid scores, the correction bias only
chooses (group top-2 sums, `topk_group` groups, top-k experts), the chosen
unbiased scores are renormalised and scaled by `routed_scaling_factor`. The
bias is not learned by gradient: after every step each expert's bias moves by
`rate` toward balance (up when under-loaded), DeepSeek-V3's auxiliary-loss-free
balancing. Every expert is computed densely and weighted by the sparse gate,
which equals sparse dispatch (non-chosen experts get weight 0) and is the
fastest form for eight tiny experts.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenspeed.models.embedded.training.blocks import (
    RMSNorm,
    SwiGLU,
    apply_rope,
    apply_rope_interleaved,
    causal_attention,
    init_weights,
    rope_tables,
)


class MLAttention(nn.Module):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config["rms_norm_eps"]
        self.heads = config["num_attention_heads"]
        self.nope, self.rope = config["qk_nope_head_dim"], config["qk_rope_head_dim"]
        self.v_dim, self.rank = config["v_head_dim"], config["kv_lora_rank"]
        self.interleaved = bool(config.get("rope_interleave", True))
        q_rank = config.get("q_lora_rank")
        q_out = self.heads * (self.nope + self.rope)
        if q_rank is None:
            self.q_proj = nn.Linear(hidden, q_out, bias=False)
        else:
            self.q_a_proj = nn.Linear(hidden, q_rank, bias=False)
            self.q_a_layernorm = RMSNorm(q_rank, eps)
            self.q_b_proj = nn.Linear(q_rank, q_out, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(hidden, self.rank + self.rope, bias=False)
        self.kv_a_layernorm = RMSNorm(self.rank, eps)
        self.kv_b_proj = nn.Linear(self.rank, self.heads * (self.nope + self.v_dim), bias=False)
        self.o_proj = nn.Linear(self.heads * self.v_dim, hidden, bias=False)
        self.scale = (self.nope + self.rope) ** -0.5

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q = self.q_proj(x) if hasattr(self, "q_proj") else self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q_pass, q_rot = q.view(batch, seq, self.heads, -1).transpose(1, 2).split([self.nope, self.rope], -1)
        kv_latent, k_rot = self.kv_a_proj_with_mqa(x).split([self.rank, self.rope], -1)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_latent)).view(batch, seq, self.heads, -1).transpose(1, 2)
        k_pass, value = kv.split([self.nope, self.v_dim], -1)
        rotate = apply_rope_interleaved if self.interleaved else apply_rope
        q_rot = rotate(q_rot, cos, sin)
        k_rot = rotate(k_rot.view(batch, 1, seq, self.rope), cos, sin).expand(batch, self.heads, seq, self.rope)
        out = causal_attention(
            torch.cat((q_pass, q_rot), -1), torch.cat((k_pass, k_rot), -1), value, self.scale
        )
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))


class Router(nn.Module):
    """`mlp.gate`: router weight `[E, hidden]` and the balancing bias (a buffer: not learned by gradient)."""

    e_score_correction_bias: torch.Tensor

    def __init__(self, num_experts: int, hidden: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_experts, hidden))
        self.register_buffer("e_score_correction_bias", torch.zeros(num_experts))


class DenseComputedMoE(nn.Module):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        hidden, self.inter = config["hidden_size"], config["moe_intermediate_size"]
        self.num_experts, self.top_k = config["n_routed_experts"], config["num_experts_per_tok"]
        self.groups = config.get("n_group") or 1
        self.topk_groups = config.get("topk_group") or 1
        self.renormalize = bool(config.get("norm_topk_prob", True))
        self.scaling = float(config.get("routed_scaling_factor", 1.0))
        self.gate = Router(self.num_experts, hidden)
        self.experts_gate_up = nn.Parameter(torch.empty(self.num_experts, 2 * self.inter, hidden))
        self.experts_down = nn.Parameter(torch.empty(self.num_experts, hidden, self.inter))
        shared = config.get("n_shared_experts") or 0
        self.shared_experts = SwiGLU(hidden, self.inter * shared) if shared else None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Per-token expert weights `[n, E]` (zero where not chosen) and the chosen ids `[n, k]`."""
        with torch.autocast(x.device.type, enabled=False):
            scores = F.linear(x.float(), self.gate.weight.float()).sigmoid()
            choice = scores + self.gate.e_score_correction_bias
            if self.groups > 1:
                n, per_group = x.shape[0], self.num_experts // self.groups
                group_scores = choice.view(n, self.groups, per_group).topk(2, dim=-1).values.sum(-1)
                kept = group_scores.topk(self.topk_groups, dim=-1, sorted=False).indices
                mask = torch.zeros_like(group_scores).scatter_(1, kept, 1.0)
                mask = mask.unsqueeze(-1).expand(n, self.groups, per_group).reshape(n, self.num_experts)
                choice = choice.masked_fill(mask == 0, float("-inf"))
            chosen = choice.topk(self.top_k, dim=-1, sorted=False).indices
            weights = scores.gather(1, chosen)
            if self.renormalize:
                weights = weights / (weights.sum(-1, keepdim=True) + 1e-20)
            weights = weights * self.scaling
            return torch.zeros_like(scores).scatter(1, chosen, weights), chosen

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(output, tokens routed to each expert `[E]`)."""
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        n, experts, inter = flat.shape[0], self.num_experts, self.inter
        weights, chosen = self.route(flat)
        gate_up = F.linear(flat, self.experts_gate_up.reshape(experts * 2 * inter, -1)).view(n, experts, 2 * inter)
        act = F.silu(gate_up[..., :inter]) * gate_up[..., inter:] * weights.unsqueeze(-1).to(gate_up.dtype)
        down = self.experts_down.permute(1, 0, 2).reshape(shape[-1], experts * inter)
        out = F.linear(act.reshape(n, experts * inter), down)
        if self.shared_experts is not None:
            out = out + self.shared_experts(flat)
        load = torch.zeros(experts, device=x.device).index_add_(
            0, chosen.reshape(-1), torch.ones(chosen.numel(), device=x.device)
        )
        return out.view(shape), load


class DeepseekLayer(nn.Module):
    def __init__(self, config: Mapping[str, Any], sparse: bool) -> None:
        super().__init__()
        hidden, eps = config["hidden_size"], config["rms_norm_eps"]
        self.input_layernorm = RMSNorm(hidden, eps)
        self.self_attn = MLAttention(config)
        self.post_attention_layernorm = RMSNorm(hidden, eps)
        self.mlp: nn.Module = DenseComputedMoE(config) if sparse else SwiGLU(hidden, config["intermediate_size"])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        x = x + self.self_attn(self.input_layernorm(x), cos, sin)
        if isinstance(self.mlp, DenseComputedMoE):
            out, load = self.mlp(self.post_attention_layernorm(x))
            return x + out, load
        return x + self.mlp(self.post_attention_layernorm(x)), None


class SharedHead(nn.Module):
    def __init__(self, hidden: int, eps: float) -> None:
        super().__init__()
        self.norm = RMSNorm(hidden, eps)


class MTPLayer(DeepseekLayer):
    def __init__(self, config: Mapping[str, Any], sparse: bool) -> None:
        super().__init__(config, sparse)
        hidden, eps = config["hidden_size"], config["rms_norm_eps"]
        self.enorm = RMSNorm(hidden, eps)
        self.hnorm = RMSNorm(hidden, eps)
        self.eh_proj = nn.Linear(2 * hidden, hidden, bias=False)
        self.shared_head = SharedHead(hidden, eps)


class DeepseekBackbone(nn.Module):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        n, dense = config["num_hidden_layers"], config.get("first_k_dense_replace", 0)
        self.embed_tokens = nn.Embedding(config["vocab_size"], config["hidden_size"])
        mtp_sparse = n - 1 >= dense  # routes as the last decoder layer (as the engine builds it)
        layers: list[nn.Module] = [DeepseekLayer(config, i >= dense) for i in range(n)]
        layers += [MTPLayer(config, mtp_sparse) for _ in range(config.get("num_nextn_predict_layers") or 0)]
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])


class DeepseekNet(nn.Module):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        if config.get("architectures") != ["DeepseekV3ForCausalLM"]:
            raise ValueError(f"not a DeepSeek-V3 config: {config.get('architectures')}")
        if config.get("rope_scaling") or (config.get("num_nextn_predict_layers") or 0) > 1:
            raise ValueError("the trainable DeepSeek net has default rope and at most one MTP layer")
        self.config = dict(config)
        self.num_layers = config["num_hidden_layers"]
        self.model = DeepseekBackbone(config)
        self.tied = bool(config.get("tie_word_embeddings", False))
        if not self.tied:
            self.lm_head = nn.Linear(config["hidden_size"], config["vocab_size"], bias=False)
        init_weights(self, config.get("initializer_range", 0.02), self.num_layers)

    @property
    def head_weight(self) -> torch.Tensor:
        return self.model.embed_tokens.weight if self.tied else self.lm_head.weight

    @property
    def mtp_layer(self) -> MTPLayer | None:
        extra = list(self.model.layers)[self.num_layers :]
        return extra[0] if extra and isinstance(extra[0], MTPLayer) else None

    def moe_blocks(self) -> list[DenseComputedMoE]:
        """MoE blocks in the order of the loads `forward_with_loads` and `mtp` return (main, then MTP)."""
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, DenseComputedMoE)]

    def _rope(self, length: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        theta = float(self.config.get("rope_theta", 10000.0))
        return rope_tables(length, self.config["qk_rope_head_dim"], theta, device)

    def forward_with_loads(self, ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        cos, sin = self._rope(ids.shape[1], ids.device)
        x = self.model.embed_tokens(ids)
        loads: list[torch.Tensor] = []
        for layer in list(self.model.layers)[: self.num_layers]:
            x, load = layer(x, cos, sin)
            if load is not None:
                loads.append(load)
        return self.model.norm(x), loads

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        """Final hidden states after the final norm (the LM head's input)."""
        return self.forward_with_loads(ids)[0]

    def mtp(self, hidden: torch.Tensor, next_ids: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor]]:
        """MTP hidden states (after `shared_head.norm`) for (h_p, t_{p+1}) pairs, and its expert loads."""
        layer = self.mtp_layer
        if layer is None:
            raise ValueError("this config has no MTP layer (num_nextn_predict_layers = 0)")
        cos, sin = self._rope(hidden.shape[1], hidden.device)
        x = layer.eh_proj(torch.cat((layer.enorm(self.model.embed_tokens(next_ids)), layer.hnorm(hidden)), -1))
        x, load = layer(x, cos, sin)
        return layer.shared_head.norm(x), [] if load is None else [load]

    @torch.no_grad()
    def balance_experts(self, loads: torch.Tensor, rate: float) -> None:
        """Auxiliary-loss-free balancing: bias += rate * sign(mean load - load), per MoE block (`loads` [blocks, E])."""
        for block, load in zip(self.moe_blocks(), loads):
            block.gate.e_score_correction_bias.add_(rate * torch.sign(load.mean() - load))

    def hf_state_dict(self, compact: bool = False) -> dict[str, torch.Tensor]:
        tensors: dict[str, torch.Tensor] = {}
        for name, value in [*self.named_parameters(), *self.named_buffers()]:
            prefix, _, leaf = name.rpartition(".")
            if leaf in ("experts_gate_up", "experts_down"):
                for e in range(value.shape[0]):
                    if leaf == "experts_gate_up":
                        gate, up = value[e].detach().chunk(2, dim=0)
                        tensors[f"{prefix}.experts.{e}.gate_proj.weight"] = gate
                        tensors[f"{prefix}.experts.{e}.up_proj.weight"] = up
                    else:
                        tensors[f"{prefix}.experts.{e}.down_proj.weight"] = value[e].detach()
            else:
                tensors[name] = value.detach()
        if self.mtp_layer is not None and not compact:
            tensors.update(self.mtp_shared_copies())
        return tensors

    def mtp_shared_copies(self) -> dict[str, torch.Tensor]:
        """The MTP layer's `embed_tokens` and `shared_head.head`: the main embedding and head, as DeepSeek stores them."""
        prefix = f"model.layers.{self.num_layers}"
        return {
            f"{prefix}.embed_tokens.weight": self.model.embed_tokens.weight.detach(),
            f"{prefix}.shared_head.head.weight": self.head_weight.detach(),
        }

    def load_hf_state_dict(self, tensors: Mapping[str, torch.Tensor]) -> None:
        own = self.hf_state_dict(compact=True)
        ignored = set(self.mtp_shared_copies()) | ({"lm_head.weight"} if self.tied else set())
        extra = sorted(set(tensors) - set(own) - ignored)
        missing = sorted(set(own) - set(tensors))
        if extra or missing:
            raise ValueError(f"checkpoint does not match DeepseekNet: missing {missing}, unexpected {extra}")
        with torch.no_grad():
            for name, value in [*self.named_parameters(), *self.named_buffers()]:
                prefix, _, leaf = name.rpartition(".")
                if leaf == "experts_gate_up":
                    for e in range(value.shape[0]):
                        value[e].copy_(torch.cat((tensors[f"{prefix}.experts.{e}.gate_proj.weight"],
                                                  tensors[f"{prefix}.experts.{e}.up_proj.weight"])))
                elif leaf == "experts_down":
                    for e in range(value.shape[0]):
                        value[e].copy_(tensors[f"{prefix}.experts.{e}.down_proj.weight"])
                else:
                    value.copy_(tensors[name])
