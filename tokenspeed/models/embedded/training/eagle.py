"""The EAGLE draft head of the `embedded` model: format, module, training loss.

Format (the public EAGLE-1/EAGLE-2 checkpoint layout, e.g. yuhuili/EAGLE-*),
folder `eagle/` beside the target's weights (`embedded_eagle_path()`):

- `config.json`: a Llama config with `num_hidden_layers: 1` and the target's
  `hidden_size`, `vocab_size`, head layout and `rope_theta` (architectures
  `["LlamaForCausalLM"]` as in the public heads), `"bias": true` (EAGLE's key:
  `fc` has a bias), and an `"eagle"` section restating the contract below.
- `model.safetensors` (bf16):
  `fc.weight` `[hidden, 2*hidden]`, `fc.bias` `[hidden]`;
  `layers.0.self_attn.{q,k,v,o}_proj.weight` (Llama attention: GQA, rotate-half
  rope, no q/k norm, no bias); `layers.0.post_attention_layernorm.weight`;
  `layers.0.mlp.{gate,up,down}_proj.weight`.
  There is no `layers.0.input_layernorm`, no final `norm`, no `embed_tokens`
  and no `lm_head`: the head reuses the target's embedding and LM head.

Draft step at position p (rope position p): with `f_p` the target's final
hidden state after its final norm (the LM head's input, transformers'
`last_hidden_state`) and `t_{p+1}` the token that follows,

    x = fc(cat([embed(t_{p+1}), f_p], -1))
    x = x + self_attn(x)                       # causal over the draft's own sequence
    f'_{p+1} = x + mlp(post_attention_layernorm(x))
    logits of t_{p+2} = target_lm_head(f'_{p+1})

`f'_{p+1}` stands in for `f_{p+1}` when drafting further tokens. Training is
EAGLE's: the target is frozen, the loss is smooth-L1 between `f'_{p+1}` and
`f_{p+1}` plus 0.1 x cross-entropy of the draft's token distribution against
the target's own distribution at p+1 (so the head learns to agree with the
target, which is what acceptance measures), with uniform noise on the input
features for robustness to its own drafted features. `EagleRecipe` holds the
weights; `RECIPES` names the ones compared in
`benchmarks/results/cpu/eagle_recipe_ab.md` (issue 14). There, at equal steps,
the peak learning rate was the lever (1e-3 -> 6e-3: top-1 +0.11, agreement
+0.14; the command's `--eagle-lr` is now 6e-3); a token weight of 1.0
(`token1`) helped only at the old 1e-3 and lost at 6e-3, and hard labels (the
text's t_{p+2}), no noise or a second, self-fed step did not help the first
draft, so the loss stays EAGLE-1's.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from tokenspeed.models.embedded.training.blocks import (
    GroupedQueryAttention,
    RMSNorm,
    SwiGLU,
    init_weights,
    rope_tables,
)


@dataclass(frozen=True, slots=True)
class EagleRecipe:
    """The loss of one training step (weights of its terms, and the feature noise)."""

    feature_weight: float = 1.0  # smooth-L1 between f'_{p+1} and f_{p+1}
    token_weight: float = 0.1  # cross-entropy of the draft against the target's distribution at p+1
    hard_token_weight: float = 0.0  # cross-entropy of the draft against the text's t_{p+2}
    feature_noise: float = 0.1  # half-width of the uniform noise added to the input features
    second_step_weight: float = 0.0  # the same loss on a second draft step fed the head's own features

    def to_dict(self) -> dict[str, float]:
        return {f: getattr(self, f) for f in self.__slots__}  # type: ignore[attr-defined]


EAGLE1_RECIPE = EagleRecipe()  # EAGLE-1's loss, the recipe of the first shipped head
RECIPES = {"eagle1": EAGLE1_RECIPE, "token1": EagleRecipe(token_weight=1.0)}
RECIPE = EAGLE1_RECIPE  # the training command's default


def eagle_config(target: Mapping[str, Any], intermediate_size: int) -> dict[str, Any]:
    """The draft head's config.json for `target` (the dense model's config)."""
    keys = ("vocab_size", "hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
            "max_position_embeddings", "rms_norm_eps", "rope_theta")
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        **{k: target[k] for k in keys},
        "intermediate_size": intermediate_size,
        "num_hidden_layers": 1,
        "hidden_act": "silu",
        "attention_bias": False,
        "bias": True,
        "tie_word_embeddings": True,
        "torch_dtype": "bfloat16",
        "eagle": {
            "version": 1,
            "fc_input": ["embed_tokens(t[p+1])", "target_hidden(p)"],
            "target_hidden": "final hidden state after the target's final norm (the LM head input)",
            "position": "p (the target hidden state's position)",
            "input_layernorm": False,
            "final_norm": False,
            "shared_with_target": ["model.embed_tokens.weight", "lm_head.weight"],
        },
    }


class EagleLayer(nn.Module):
    """EAGLE's decoder layer 0: no input norm (its input is `fc`'s output)."""

    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.self_attn = GroupedQueryAttention(config, qk_norm=False)
        self.post_attention_layernorm = RMSNorm(config["hidden_size"], config["rms_norm_eps"])
        self.mlp = SwiGLU(config["hidden_size"], config["intermediate_size"])

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.self_attn(x, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class EagleHead(nn.Module):
    def __init__(self, config: Mapping[str, Any]) -> None:
        super().__init__()
        self.config = dict(config)
        hidden = config["hidden_size"]
        self.fc = nn.Linear(2 * hidden, hidden, bias=bool(config.get("bias", True)))
        self.layers = nn.ModuleList([EagleLayer(config)])
        init_weights(self, 0.02, 1)

    def forward(self, next_embeds: torch.Tensor, features: torch.Tensor) -> torch.Tensor:
        """Predicted features f'_{p+1} `[batch, seq, hidden]` from embed(t_{p+1}) and f_p, positions 0.."""
        cos, sin = rope_tables(features.shape[1], self.config["head_dim"], float(self.config["rope_theta"]),
                               features.device)
        return self.layers[0](self.fc(torch.cat((next_embeds, features), -1)), cos, sin)

    def hf_state_dict(self) -> dict[str, torch.Tensor]:
        return {name: p.detach() for name, p in self.named_parameters()}

    def load_hf_state_dict(self, tensors: Mapping[str, torch.Tensor]) -> None:
        wanted = dict(self.named_parameters())
        if set(tensors) != set(wanted):
            raise ValueError(f"not an EAGLE head of this shape: {sorted(set(tensors) ^ set(wanted))}")
        with torch.no_grad():
            for name, param in wanted.items():
                param.copy_(tensors[name])


def _step_loss(
    head: EagleHead,
    features: torch.Tensor,
    following: torch.Tensor,
    next_ids: torch.Tensor,
    truth: torch.Tensor,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    recipe: EagleRecipe,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """One draft step: features f_p `[b, n, h]` and tokens t_{p+1} predict f_{p+1} (`following`) and t_{p+2}.

    `truth` `[b, n - 1]` is t_{p+2} for all but the last position (whose t_{p+2} lies past the window).
    """
    predicted = head(F.embedding(next_ids, embed), features)
    feature_loss = F.smooth_l1_loss(predicted.float(), following.float())
    with torch.no_grad():
        target_probs = F.linear(following, lm_head).float().softmax(-1)
    draft_logprobs = F.linear(predicted, lm_head).float().log_softmax(-1)
    token_loss = -(target_probs * draft_logprobs).sum(-1).mean()
    loss = recipe.feature_weight * feature_loss + recipe.token_weight * token_loss
    metrics = {"feature_loss": feature_loss.detach(), "token_loss": token_loss.detach()}
    if recipe.hard_token_weight:
        hard = F.nll_loss(draft_logprobs[:, :-1].flatten(0, 1), truth.flatten())
        loss = loss + recipe.hard_token_weight * hard
        metrics["hard_token_loss"] = hard.detach()
    return loss, predicted, metrics


def eagle_loss(
    head: EagleHead,
    target_hidden: torch.Tensor,
    ids: torch.Tensor,
    embed: torch.Tensor,
    lm_head: torch.Tensor,
    noise: bool = True,
    recipe: EagleRecipe = RECIPE,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The recipe's loss on one batch; `target_hidden` `[b, s, h]` are the frozen target's features of `ids` `[b, s]`.

    The feature noise draws from torch's global generator (seeded by the command), which
    `torch.compile` supports, unlike an explicit generator. A second step (when weighted)
    feeds the head its own predicted features f'_{p+1} with the tokens t_{p+2}, as drafting
    token 2 onwards does, and is scored against f_{p+2} and t_{p+3}.
    """
    features, following = target_hidden[:, :-1], target_hidden[:, 1:]
    if noise and recipe.feature_noise:
        features = features + (2 * torch.rand_like(features) - 1) * recipe.feature_noise
    loss, predicted, metrics = _step_loss(head, features, following, ids[:, 1:], ids[:, 2:], embed, lm_head, recipe)
    if recipe.second_step_weight:
        second, _, second_metrics = _step_loss(head, predicted[:, :-1], target_hidden[:, 2:], ids[:, 2:], ids[:, 3:],
                                               embed, lm_head, recipe)
        loss = loss + recipe.second_step_weight * second
        metrics |= {f"second_{k}": v for k, v in second_metrics.items()}
    return loss, metrics
