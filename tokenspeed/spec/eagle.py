"""EAGLE-1/2 draft heads (`speculative_config={"method": "eagle", "model": PATH}`).

Format: the public EAGLE-1/EAGLE-2 layout (yuhuili/EAGLE-* checkpoints), which
our trained head of the `embedded` model also uses (`models/embedded/training/eagle.py`):
a folder with a Llama `config.json` (one layer; `"bias"`: whether `fc` has a
bias, default true) and `model.safetensors` or `pytorch_model.bin` holding
`fc.{weight,bias}` `[hidden, 2*hidden]`, `layers.0.self_attn.{q,k,v,o}_proj`,
`layers.0.post_attention_layernorm`, `layers.0.mlp.{gate,up,down}_proj`, and
optionally `embed_tokens.weight` (a copy of the target's; the target's is
used when absent) and an unused `layers.0.input_layernorm` (EAGLE's first
layer skips it). The LM head is always the target's.

One head step at position q (rope position q), f_q the target's final hidden
state after its final norm and t_{q+1} the token after it:

    x = fc(cat([embed(t_{q+1}), f_q]))
    x = x + self_attn(x)                     # causal over the head's own paged K/V
    f'_{q+1} = x + mlp(post_attention_layernorm(x))

`f'_{q+1}` drafts t_{q+2} through the target's LM head and stands in for
f_{q+1} further down the chain (`feature_drafter.py`).

EAGLE-3 (fused low/mid/high target layers, a draft vocabulary) needs the
target's intermediate hidden states, which the models do not expose yet; it
is refused with a clear error rather than run wrongly.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from torch import nn

from tokenspeed.errors import InvalidRequest
from tokenspeed.layers.attention import GQAAttention
from tokenspeed.layers.embedding import VocabEmbedding
from tokenspeed.layers.linear import Linear
from tokenspeed.layers.mlp import GatedMLP
from tokenspeed.layers.norm import RMSNorm
from tokenspeed.layers.rotary_embedding import RotaryEmbedding
from tokenspeed.models.config import ModelConfig
from tokenspeed.spec.feature_drafter import FeatureDrafter

if TYPE_CHECKING:
    from tokenspeed.batch.forward_batch import AttentionMetadata
    from tokenspeed.batch.kv_storage import PagedKVStorage
    from tokenspeed.executor.executor import Executor

_PACKED = {"q_proj": ("qkv_proj", "q"), "k_proj": ("qkv_proj", "k"), "v_proj": ("qkv_proj", "v"),
           "gate_proj": ("gate_up_proj", "gate"), "up_proj": ("gate_up_proj", "up")}
_UNUSED = ("layers.0.input_layernorm.weight", "norm.weight", "lm_head.weight")


class EagleLayer(nn.Module):
    """EAGLE's decoder layer 0: no input norm (its input is `fc`'s output)."""

    def __init__(self, config: ModelConfig, rotary: RotaryEmbedding, *, dtype: torch.dtype, device: torch.device):
        super().__init__()
        self.self_attn = GQAAttention(
            hidden_size=config.hidden_size, num_heads=config.num_heads, num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim, rotary=rotary, qkv_bias=config.qkv_bias, o_proj_bias=config.o_proj_bias,
            dtype=dtype, device=device,
        )
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.mlp = GatedMLP(config.hidden_size, config.intermediate_size, bias=config.mlp_bias, dtype=dtype,
                            device=device)

    def forward(self, positions: torch.Tensor, x: torch.Tensor, attn: AttentionMetadata,
                kv_layer: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        k_cache, v_cache = kv_layer
        assert v_cache is not None
        x = x + self.self_attn(positions, x, attn, k_cache, v_cache)
        out: torch.Tensor = x + self.mlp(self.post_attention_layernorm(x))
        return out


class EagleHead(nn.Module):
    def __init__(self, config: ModelConfig, *, fc_bias: bool, own_embedding: bool, dtype: torch.dtype,
                 device: torch.device) -> None:
        super().__init__()
        if config.num_layers != 1:
            raise InvalidRequest(f"an EAGLE-1/2 head has one layer, this config has {config.num_layers}")
        hidden = config.hidden_size
        self.config = config
        self.fc = Linear(2 * hidden, hidden, bias=fc_bias, dtype=dtype, device=device)
        self.rotary_emb = RotaryEmbedding(config.rope, head_dim=config.head_dim,
                                          max_position_embeddings=config.max_position_embeddings, dtype=dtype,
                                          device=device)
        self.layers = nn.ModuleList([EagleLayer(config, self.rotary_emb, dtype=dtype, device=device)])
        self.embed_tokens = (VocabEmbedding(config.vocab_size, hidden, dtype=dtype, device=device)
                             if own_embedding else None)

    def forward(self, positions: torch.Tensor, embeds: torch.Tensor, features: torch.Tensor,
                attn: AttentionMetadata, kv_layer: tuple[torch.Tensor, torch.Tensor | None]) -> torch.Tensor:
        x = self.fc(torch.cat([embeds, features.to(embeds.dtype)], dim=-1))
        out: torch.Tensor = self.layers[0](positions, x, attn, kv_layer)
        return out

    def load(self, tensors: Mapping[str, torch.Tensor]) -> None:
        """Copy a checkpoint's tensors in; every parameter must be given, no tensor may be left over."""
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        with torch.no_grad():
            for raw_name, tensor in tensors.items():
                name = raw_name.removeprefix("model.")
                if name in _UNUSED:
                    continue
                path, _, attr = name.rpartition(".")
                parent, _, leaf = path.rpartition(".")
                if leaf in _PACKED:
                    fused, shard = _PACKED[leaf]
                    module = self.get_submodule(f"{parent}.{fused}")
                    module.load_shard(attr, shard, tensor)  # type: ignore[operator]
                    loaded.add(f"{parent}.{fused}.{attr}[{shard}]")
                    continue
                if name not in params:
                    raise InvalidRequest(f"EAGLE head: unexpected tensor {raw_name!r}")
                if tuple(params[name].shape) != tuple(tensor.shape):
                    raise InvalidRequest(f"EAGLE head: {raw_name} has shape {tuple(tensor.shape)}, "
                                         f"expected {tuple(params[name].shape)}")
                params[name].copy_(tensor)
                loaded.add(name)
        expected: set[str] = set()
        for name in params:
            shards = getattr(self.get_submodule(name.rpartition(".")[0]), "shard_names", ())
            expected |= {f"{name}[{shard}]" for shard in shards} if shards else {name}
        missing = sorted(expected - loaded)
        if missing:
            raise InvalidRequest(f"EAGLE head: missing tensors {missing}")


def read_tensors(folder: Path) -> dict[str, torch.Tensor]:
    """A head's tensors from `model.safetensors` (or shards) or the public heads' `pytorch_model.bin`."""
    files = sorted(folder.glob("*.safetensors"))
    if files:
        from safetensors.torch import load_file

        tensors: dict[str, torch.Tensor] = {}
        for path in files:
            tensors.update(load_file(str(path)))
        return tensors
    binary = folder / "pytorch_model.bin"
    if binary.is_file():
        loaded = torch.load(binary, map_location="cpu", weights_only=True)
        return dict(loaded)
    raise InvalidRequest(f"EAGLE head {folder}: no *.safetensors or pytorch_model.bin")


class EagleDrafter(FeatureDrafter):
    def __init__(self, executor: Executor, folder: str) -> None:
        path = Path(folder)
        if not (path / "config.json").is_file():
            raise InvalidRequest(f"speculative_config['model']: {folder} has no config.json (an EAGLE head folder)")
        raw = json.loads((path / "config.json").read_text())
        config = ModelConfig.from_dict(raw)
        target = executor.model_config
        if (config.hidden_size, config.vocab_size) != (target.hidden_size, target.vocab_size):
            raise InvalidRequest(
                f"EAGLE head {folder} (hidden {config.hidden_size}, vocab {config.vocab_size}) does not fit the "
                f"target (hidden {target.hidden_size}, vocab {target.vocab_size})")
        tensors = read_tensors(path)
        device, dtype = executor.device, executor.dtype
        self.head = EagleHead(config, fc_bias=bool(raw.get("bias", True)), own_embedding="embed_tokens.weight" in
                              {n.removeprefix("model.") for n in tensors}, dtype=dtype, device=device)
        self.head.load(tensors)
        self.head.eval()
        self.target = executor.model
        embedding = self.head.embed_tokens or executor.model.get_submodule("model.embed_tokens")
        assert isinstance(embedding, VocabEmbedding)
        self.embedding = embedding
        super().__init__(hidden_size=config.hidden_size,
                         kv_layout=(config.num_kv_heads, config.head_dim, config.head_dim),
                         page_size=executor.config.page_size, dtype=dtype, device=device,
                         kv_dtype=executor.kv_dtype)

    def step(self, positions: torch.Tensor, tokens: torch.Tensor, features: torch.Tensor, attn: AttentionMetadata,
             kv: PagedKVStorage) -> torch.Tensor:
        out: torch.Tensor = self.head(positions, self.embedding(tokens), features, attn, kv.layer(0))
        return out

    def logits(self, features: torch.Tensor) -> torch.Tensor:
        return self.target.compute_logits(features)
