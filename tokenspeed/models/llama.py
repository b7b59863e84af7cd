"""The dense decoder shared by Llama, Mistral, Qwen2 and Qwen3.

These four differ only in flags that `ModelConfig` already resolved (q/k/v
bias, q/k norm, sliding windows, tied embeddings, rope scaling), so one class
serves them all and a fix lands everywhere at once. Module names mirror HF's
(`model.layers.N.self_attn...`) so checkpoint names map one-to-one, except the
fused projections listed in `packed_modules`.

The residual stream is carried beside the hidden state and added inside the
next norm (fused add+norm), which is where fast kernels and the tensor-parallel
all-reduce want it.

`DecoderModel` (embedding, rope, layer loop, final norm) and
`DecoderForCausalLM` (that plus the LM head) also serve DeepSeek
(`deepseek.py`), which brings its own MLA layers and MTP layers.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Callable
from typing import TYPE_CHECKING, ClassVar

import torch
from torch import nn

from tokenspeed.layers.attention import GQAAttention
from tokenspeed.layers.linear import select_decode_gemm
from tokenspeed.layers.mlp import GatedMLP
from tokenspeed.layers.norm import RMSNorm
from tokenspeed.layers.rotary_embedding import RotaryEmbedding
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.interface import CausalLM
from tokenspeed.models.parallel.vocab import build_embedding, build_lm_head

if TYPE_CHECKING:
    from tokenspeed.batch.forward_batch import AttentionMetadata, ForwardBatch
    from tokenspeed.batch.kv_storage import PagedKVStorage


class DecoderLayer(nn.Module):
    def __init__(
        self,
        config: ModelConfig,
        index: int,
        rotary: RotaryEmbedding,
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)
        self.self_attn = GQAAttention(
            hidden_size=config.hidden_size,
            num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads,
            head_dim=config.head_dim,
            rotary=rotary,
            qkv_bias=config.qkv_bias,
            o_proj_bias=config.o_proj_bias,
            qk_norm_eps=config.rms_norm_eps if config.qk_norm else None,
            sliding_window=config.sliding_windows[index],
            dtype=dtype,
            device=device,
        )
        self.post_attention_layernorm = RMSNorm(
            config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device
        )
        self.mlp = self.build_mlp(config, index, dtype=dtype, device=device)
        # Decode-sized steps run the layer as four weight kernels with the norms and residual adds
        # fused in (see `forward`); only a GatedMLP has the fused form, so MoE layers keep the plain one.
        self._fused_decode_max_tokens = self.fused_decode_limit()

    def fused_decode_limit(self) -> int:
        """Most rows the fused decode form serves (-1: none); FP8 weights recompute it (`fp8_model`)."""
        if not isinstance(self.mlp, GatedMLP):
            return -1
        return min(self.self_attn.decode_max_tokens, self.mlp.decode_max_tokens)

    def build_mlp(
        self, config: ModelConfig, index: int, *, dtype: torch.dtype, device: torch.device
    ) -> nn.Module:
        """The feed-forward block of layer `index`; MoE models override this and nothing else."""
        return GatedMLP(
            config.hidden_size, config.intermediate_size, bias=config.mlp_bias, dtype=dtype, device=device
        )

    def forward(
        self,
        positions: torch.Tensor,
        hidden: torch.Tensor,
        residual: torch.Tensor | None,
        attn: AttentionMetadata,
        kv_layer: tuple[torch.Tensor, torch.Tensor],
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(hidden, residual), whose sum is the residual stream; residual None: hidden is the stream.

        At most `_fused_decode_max_tokens` rows take the fused decode form: the
        norms run in the QKV and gate/up kernels' prologues, the residual adds
        in the o_proj and down kernels' epilogues, and the stream comes back
        whole (residual None). Otherwise the add is fused into the next norm.
        """
        if hidden.shape[0] <= self._fused_decode_max_tokens:
            stream = hidden if residual is None else hidden + residual
            mid = self.self_attn(
                positions, stream, attn, *kv_layer, input_norm=self.input_layernorm, residual=stream
            )
            return self.mlp.forward_decode(mid, norm=self.post_attention_layernorm, residual=mid), None
        if residual is None:
            residual = hidden
            hidden = self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        hidden = self.self_attn(positions, hidden, attn, *kv_layer)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class DecoderModel(nn.Module):
    """Embedding, rope, the decoder layers and the final norm; shared by every decoder-only model.

    Subclasses (DeepSeek) choose the rope width and extend `build_layers`;
    layers past `num_layers` (DeepSeek's MTP layers) are built but not run.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype,
        device: torch.device,
        layer_class: Callable[..., nn.Module] = DecoderLayer,
        rope_head_dim: int | None = None,
    ) -> None:
        super().__init__()
        self.num_layers = config.num_layers
        self.embed_tokens = build_embedding(config.vocab_size, config.hidden_size, dtype=dtype, device=device)
        self.rotary_emb = RotaryEmbedding(
            config.rope,
            head_dim=config.head_dim if rope_head_dim is None else rope_head_dim,
            max_position_embeddings=config.max_position_embeddings,
            dtype=dtype,
            device=device,
        )
        self.layers = nn.ModuleList(self.build_layers(config, layer_class, dtype=dtype, device=device))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype=dtype, device=device)

    def build_layers(
        self,
        config: ModelConfig,
        layer_class: Callable[..., nn.Module],
        *,
        dtype: torch.dtype,
        device: torch.device,
    ) -> list[nn.Module]:
        """The `num_layers` decoder layers, `layer_class(config, i, rotary, dtype=, device=)` each."""
        return [
            layer_class(config, i, self.rotary_emb, dtype=dtype, device=device)
            for i in range(config.num_layers)
        ]

    def forward(self, batch: ForwardBatch, kv: PagedKVStorage) -> torch.Tensor:
        hidden = self.embed_tokens(batch.input_ids)
        residual: torch.Tensor | None = None
        for index in range(self.num_layers):
            hidden, residual = self.layers[index](
                batch.positions, hidden, residual, batch.attn, kv.layer(index)
            )
        if residual is None:  # no layers, or decode layers that return the whole stream
            return self.norm(hidden)
        hidden, _ = self.norm(hidden, residual)
        return hidden


class DecoderForCausalLM(CausalLM):
    """A `DecoderModel` (`build_model`) and an LM head, tied to the embedding where the config says so."""

    def __init__(
        self, config: ModelConfig, *, dtype: torch.dtype = torch.float32, device: torch.device | str = "cpu"
    ) -> None:
        super().__init__()
        device = torch.device(device)
        self.config = config
        self.dtype = dtype
        self.model = self.build_model(config, dtype=dtype, device=device)
        self.lm_head = build_lm_head(
            config.vocab_size,
            config.hidden_size,
            tied_to=self.model.embed_tokens if config.tie_word_embeddings else None,
            dtype=dtype,
            device=device,
        )
        # Decode-sized batches stream the 0.5-1 GB head through the GEMV kernel, which writes the
        # fp32 logits directly (rounded through the activation dtype, as `LMHead` returns them).
        self._lm_head_gemm, self._lm_head_max_tokens = select_decode_gemm("decode", device=device, dtype=dtype)

    @abstractmethod
    def build_model(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> DecoderModel:
        """The decoder stack, stored as `self.model` (checkpoint names `model.*`)."""

    def forward(self, batch: ForwardBatch, kv: PagedKVStorage) -> torch.Tensor:
        return self.model(batch, kv)

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        if hidden.shape[0] <= self._lm_head_max_tokens:
            return self._lm_head_gemm(hidden, self.lm_head.weight, out_dtype=torch.float32)  # type: ignore[misc]
        return self.lm_head(hidden)


class DenseDecoderForCausalLM(DecoderForCausalLM):
    """Llama-family causal LM; see the module docstring for what it covers."""

    layer_class: ClassVar[type[DecoderLayer]] = DecoderLayer
    packed_modules: ClassVar[dict[str, tuple[str, str]]] = {
        "q_proj": ("qkv_proj", "q"),
        "k_proj": ("qkv_proj", "k"),
        "v_proj": ("qkv_proj", "v"),
        "gate_proj": ("gate_up_proj", "gate"),
        "up_proj": ("gate_up_proj", "up"),
    }

    def build_model(self, config: ModelConfig, *, dtype: torch.dtype, device: torch.device) -> DecoderModel:
        return DecoderModel(config, dtype=dtype, device=device, layer_class=self.layer_class)
