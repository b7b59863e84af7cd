"""MLA layer and DeepSeek model pieces that end-to-end parity cannot pin down alone.

- the latent cache stores exactly `kv_lora_rank + qk_rope_head_dim` values per
  token and layer (no V tensor), which is the whole point of MLA;
- the weight-absorbed attention equals the textbook expanded form (keys and
  values decompressed per head) for a prefill followed by decode steps;
- multi-token-prediction layers of a V3 checkpoint load and are kept, and do
  not change the main model's output; the dummy loader fills them;
- configs we cannot run fail at parse time with a clear error;
- the DeepSeek presets: token-id-only without a rank file, Moonlight's special
  ids and chat markup (prefix-stable across agent turns).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from jinja2.sandbox import ImmutableSandboxedEnvironment
from safetensors.torch import load_file, save_file

from tests.checkpoints import make_deepseek_checkpoint
from tests.test_embedded_tokenizer import TOOLS, agent_conversation
from tokenspeed.batch.kv_storage import PagedKVStorage
from tokenspeed.errors import ModelNotSupported
from tokenspeed.executor.batch_builder import RowSpec, build_forward_batch
from tokenspeed.layers.mla import MLAAttention
from tokenspeed.layers.mla_config import MLAConfig
from tokenspeed.layers.rope_scaling import RopeConfig
from tokenspeed.layers.rotary_embedding import RotaryEmbedding
from tokenspeed.models import ModelConfig, build_model, load_weights
from tokenspeed.models.loader import WeightLoadError
from tokenspeed.models.presets import load_preset, materialize_preset, preset_dict
from tokenspeed.models.presets.kimi_tokens import KIMI_ADDED_TOKENS, KIMI_FIRST_SPECIAL_ID
from tokenspeed.models.presets.tokenizers import chat_template

PAGE_SIZE = 4
MLA = MLAConfig(q_lora_rank=None, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)


def _latent_storage(num_layers: int, num_pages: int, mla: MLAConfig = MLA) -> PagedKVStorage:
    return PagedKVStorage(
        num_layers=num_layers,
        num_pages=num_pages,
        page_size=PAGE_SIZE,
        num_kv_heads=1,
        head_dim=mla.cache_dim,
        v_head_dim=0,
        dtype=torch.float32,
        device="cpu",
    )


def test_latent_cache_holds_cache_dim_values_per_token() -> None:
    config = load_preset("deepseek-v2-lite")
    assert config.mla is not None and config.kv_cache_layout == (1, 512 + 64, 0)
    per_page = PagedKVStorage.bytes_per_page(
        num_layers=27, page_size=16, num_kv_heads=1, head_dim=576, v_head_dim=0, dtype=torch.bfloat16
    )
    assert per_page == 27 * 16 * 576 * 2  # vs 27*16*2*16*192*2 for the expanded K and V
    kv = _latent_storage(num_layers=2, num_pages=3)
    cache, v_cache = kv.layer(1)
    assert v_cache is None and kv.v == []
    assert tuple(cache.shape) == (3, PAGE_SIZE, 1, MLA.cache_dim)


def _layer(seed: int) -> MLAAttention:
    rotary = RotaryEmbedding(
        RopeConfig(theta=100.0), head_dim=MLA.qk_rope_head_dim, max_position_embeddings=64
    )
    layer = MLAAttention(hidden_size=40, num_heads=3, mla=MLA, rotary=rotary, scale=0.3)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in layer.named_parameters():
            noise = torch.randn(param.shape, generator=gen)
            param.copy_(1 + 0.1 * noise if "norm" in name else 0.2 * noise)
    return layer


def _expanded_attention(layer: MLAAttention, positions: torch.Tensor, hidden: torch.Tensor) -> torch.Tensor:
    """Causal MHA over the whole sequence with per-head keys and values decompressed from the latent."""
    m, heads, tokens = layer.mla, layer.num_heads, hidden.shape[0]
    q_nope, q_pe, rows = layer.project(positions, hidden)
    latent, k_pe = rows.split([m.kv_lora_rank, m.qk_rope_head_dim], dim=-1)
    kv = layer.kv_b_proj(latent).view(tokens, heads, m.qk_nope_head_dim + m.v_head_dim)
    k_nope, v = kv.split([m.qk_nope_head_dim, m.v_head_dim], dim=-1)
    q = torch.cat((q_nope, q_pe), dim=-1)
    k = torch.cat((k_nope, k_pe[:, None, :].expand(tokens, heads, m.qk_rope_head_dim)), dim=-1)
    scores = torch.einsum("thd,shd->hts", q, k) * layer.scale
    causal = torch.ones(tokens, tokens, dtype=torch.bool).tril()
    probs = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    out = torch.einsum("hts,shd->thd", probs, v).reshape(tokens, heads * m.v_head_dim)
    return layer.o_proj(out)


def test_absorbed_prefill_and_decode_equal_expanded_attention() -> None:
    layer = _layer(seed=0)
    tokens = 11
    hidden = torch.randn(tokens, 40, generator=torch.Generator().manual_seed(1))
    positions = torch.arange(tokens)
    expected = _expanded_attention(layer, positions, hidden)
    kv = _latent_storage(num_layers=1, num_pages=8)
    pages = [5, 2, 7]  # scattered, out of order
    got = []
    with torch.no_grad():
        prefill = build_forward_batch([RowSpec(list(range(6)), 0, pages)], PAGE_SIZE, logits_indices=[5])
        got.append(layer(positions[:6], hidden[:6], prefill.attn, kv.layer(0)[0]))
        for t in range(6, tokens):  # one decode step per remaining token
            step = build_forward_batch([RowSpec([0], t, pages)], PAGE_SIZE, logits_indices=[0])
            assert step.attn.max_query_len == 1
            got.append(layer(positions[t : t + 1], hidden[t : t + 1], step.attn, kv.layer(0)[0]))
    assert torch.allclose(torch.cat(got), expected, atol=1e-5, rtol=1e-4)
    # Only latent ‖ rotated k_pe is cached: the decompressed keys never are.
    _, _, rows = layer.project(positions, hidden)
    flat = kv.layer(0)[0].view(-1, MLA.cache_dim)
    slots = torch.tensor([pages[p // PAGE_SIZE] * PAGE_SIZE + p % PAGE_SIZE for p in range(tokens)])
    assert torch.allclose(flat[slots], rows, atol=1e-6)


def _with_mtp_layer(source: Path, target: Path) -> dict[str, torch.Tensor]:
    """A V3 checkpoint plus one MTP layer (`model.layers.2.*`, as DeepSeek-V3 ships layer 61)."""
    tensors = load_file(str(source / "model.safetensors"))
    gen = torch.Generator().manual_seed(5)
    mtp = {
        name.replace("model.layers.1.", "model.layers.2."): t.clone()
        for name, t in tensors.items()
        if name.startswith("model.layers.1.")
    }
    hidden, vocab = (
        tensors["model.embed_tokens.weight"].shape[1],
        tensors["model.embed_tokens.weight"].shape[0],
    )
    extra = {
        "enorm.weight": (hidden,),
        "hnorm.weight": (hidden,),
        "eh_proj.weight": (hidden, 2 * hidden),
        "shared_head.norm.weight": (hidden,),
        "shared_head.head.weight": (vocab, hidden),
        "embed_tokens.weight": (vocab, hidden),
    }
    mtp.update({f"model.layers.2.{name}": torch.randn(shape, generator=gen) for name, shape in extra.items()})
    target.mkdir(parents=True, exist_ok=True)
    save_file({**tensors, **mtp}, str(target / "model.safetensors"))
    config = json.loads((source / "config.json").read_text())
    (target / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    return mtp


def test_mtp_layers_load_are_kept_and_do_not_run(tmp_path: Path) -> None:
    base = make_deepseek_checkpoint("deepseek_v3", tmp_path / "base")
    mtp = _with_mtp_layer(base, tmp_path / "mtp")
    with_mtp = build_model(ModelConfig.from_pretrained(tmp_path / "mtp"))
    load_weights(with_mtp, tmp_path / "mtp")
    without = build_model(ModelConfig.from_pretrained(base))
    load_weights(without, base)

    layer = with_mtp.model.mtp_layers[0]
    assert len(with_mtp.model.layers) == 3 and with_mtp.model.num_layers == 2
    assert torch.equal(layer.eh_proj.weight, mtp["model.layers.2.eh_proj.weight"])
    assert torch.equal(layer.shared_head.head.weight, mtp["model.layers.2.shared_head.head.weight"])
    assert torch.equal(
        layer.mlp.gate.e_score_correction_bias, mtp["model.layers.2.mlp.gate.e_score_correction_bias"]
    )

    prompt = list(range(3, 20))
    outputs = []
    for model in (with_mtp, without):
        kv = _latent_storage(num_layers=2, num_pages=8, mla=model.config.mla)
        batch = build_forward_batch([RowSpec(prompt, 0, [3, 1, 4, 0, 2])], PAGE_SIZE, logits_indices=[16])
        with torch.no_grad():
            outputs.append(model.compute_logits(model(batch, kv)))
    assert torch.equal(outputs[0], outputs[1])


def test_checkpoint_without_mtp_tensors_loads_and_drops_the_layers(tmp_path: Path) -> None:
    """transformers' save_pretrained keeps num_nextn_predict_layers but writes no MTP tensors."""
    base = make_deepseek_checkpoint("deepseek_v3", tmp_path / "base")
    config = json.loads((base / "config.json").read_text())
    (base / "config.json").write_text(json.dumps({**config, "num_nextn_predict_layers": 1}))
    model = build_model(ModelConfig.from_pretrained(base))
    assert len(model.model.layers) == 3
    load_weights(model, base)
    assert len(model.model.layers) == 2 and model.model.mtp_layers == []
    assert model.optional_checkpoint_modules() == []


def test_checkpoint_with_part_of_an_mtp_layer_is_an_error(tmp_path: Path) -> None:
    base = make_deepseek_checkpoint("deepseek_v3", tmp_path / "base")
    _with_mtp_layer(base, tmp_path / "mtp")
    path = tmp_path / "mtp" / "model.safetensors"
    tensors = load_file(str(path))
    del tensors["model.layers.2.eh_proj.weight"]
    save_file(tensors, str(path))
    model = build_model(ModelConfig.from_pretrained(tmp_path / "mtp"))
    with pytest.raises(WeightLoadError, match=r"missing tensors: model\.layers\.2\.eh_proj\.weight"):
        load_weights(model, tmp_path / "mtp")


def test_dummy_weights_fill_mtp_layers(tmp_path: Path) -> None:
    base = make_deepseek_checkpoint("deepseek_v3", tmp_path / "base")
    config = json.loads((base / "config.json").read_text())
    model = build_model({**config, "num_nextn_predict_layers": 1})
    load_weights(model, None, load_format="dummy")
    layer = model.model.mtp_layers[0]
    assert torch.equal(layer.enorm.weight, torch.ones_like(layer.enorm.weight))
    for param in (layer.eh_proj.weight, layer.embed_tokens.weight, layer.mlp.experts.w13):
        assert torch.isfinite(param).all() and 0.01 < float(param.std()) < 0.03


_TINY_V3 = dict(
    architectures=["DeepseekV3ForCausalLM"],
    model_type="deepseek_v3",
    vocab_size=64,
    hidden_size=32,
    intermediate_size=64,
    moe_intermediate_size=16,
    num_hidden_layers=2,
    num_attention_heads=2,
    kv_lora_rank=16,
    q_lora_rank=None,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=8,
    n_routed_experts=4,
    num_experts_per_tok=2,
    n_group=1,
    topk_group=1,
)


@pytest.mark.parametrize(
    ("change", "message"),
    [
        (dict(kv_lora_rank=None), "kv_lora_rank"),
        (dict(qk_rope_head_dim=5), "rope dim even"),
        (dict(v_head_dim=0), "positive"),
        (dict(attention_bias=True), "attention_bias"),
        (dict(topk_method="random"), "topk_method"),
        (dict(hidden_act="gelu"), "hidden_act"),
    ],
)
def test_bad_configs_fail_at_parse_time(change: dict[str, object], message: str) -> None:
    raw = {key: value for key, value in {**_TINY_V3, **change}.items() if value is not None}
    with pytest.raises(ModelNotSupported, match=message):
        ModelConfig.from_dict(raw)


def test_v3_defaults_follow_transformers() -> None:
    """Keys a V3 config.json may omit take transformers' DeepseekV3Config defaults."""
    config = ModelConfig.from_dict(_TINY_V3)
    assert config.mla is not None and config.mla.rope_interleaved and config.mla.num_mtp_layers == 0
    assert config.moe is not None
    assert (config.moe.renormalize, config.moe.routed_scaling_factor, config.moe.num_shared_experts) == (
        True,
        2.5,
        1,
    )
    assert config.moe.scoring == "sigmoid" and config.moe.has_correction_bias
    assert config.moe.sparse_layers == (False, False)  # first_k_dense_replace defaults to 3
    v2 = ModelConfig.from_dict(
        {
            **_TINY_V3,
            "architectures": ["DeepseekV2ForCausalLM"],
            "model_type": "deepseek_v2",
            "rope_interleave": False,
        }
    )
    assert v2.mla is not None and v2.mla.rope_interleaved  # V2 always rotates complex pairs
    assert v2.moe is not None and v2.moe.scoring == "softmax" and not v2.moe.has_correction_bias


def test_deepseek_presets_are_token_id_only_without_rank_files(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENSPEED_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TOKENSPEED_KIMI_TIKTOKEN", raising=False)
    for preset in ("deepseek-v2-lite", "moonlight-16b-a3b"):
        folder = materialize_preset(preset)
        assert sorted(p.name for p in folder.iterdir()) == ["config.json"]


def test_kimi_special_tokens_fit_the_moonlight_config() -> None:
    tokens = [t for t, _ in KIMI_ADDED_TOKENS]
    assert len(tokens) == 256 == len(set(tokens))
    config = preset_dict("moonlight-16b-a3b")
    assert config["vocab_size"] == KIMI_FIRST_SPECIAL_ID + 256
    assert tokens[config["eos_token_id"] - KIMI_FIRST_SPECIAL_ID] == "<|im_end|>"
    assert tokens[config["bos_token_id"] - KIMI_FIRST_SPECIAL_ID] == "[BOS]"
    assert tokens[163601 - KIMI_FIRST_SPECIAL_ID] == "<|im_middle|>"


def test_moonlight_template_markup_and_prefix_stable() -> None:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    template = env.from_string(chat_template("moonlight-16b-a3b"))
    hello = template.render(messages=[{"role": "user", "content": "hi"}], add_generation_prompt=True)
    assert hello == (
        "<|im_system|>system<|im_middle|>You are a helpful assistant<|im_end|>"
        "<|im_user|>user<|im_middle|>hi<|im_end|><|im_assistant|>assistant<|im_middle|>"
    )
    messages = agent_conversation()
    for tools in (TOOLS, None):
        previous = ""
        for k in range(1, len(messages) + 1):
            text = template.render(messages=messages[:k], tools=tools, add_generation_prompt=False)
            assert text.startswith(previous), f"turn {k} rewrote earlier turns"
            previous = text
    assert '"name": "read_file"' in previous


def test_decode_sized_logits_stream_the_head_through_the_decode_gemm(tmp_path: Path) -> None:
    """DeepSeek-family models take the LM head's decode GEMV as the dense ones do (on a GPU that kernel is
    the streaming GEMV): up to its row bound the head runs through it, beyond through `LMHead`."""
    from tokenspeed.kernels.gemm.reference import gemv_reference

    model = build_model(ModelConfig.from_pretrained(make_deepseek_checkpoint("deepseek_v3", tmp_path)))
    calls: list[int] = []
    model._lm_head_gemm = lambda x, w, **kw: calls.append(x.shape[0]) or gemv_reference(x, w, **kw)
    model._lm_head_max_tokens = 4
    hidden = torch.randn(6, model.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        for rows in (3, 6):
            logits = model.compute_logits(hidden[:rows])
            assert logits.dtype == torch.float32
            torch.testing.assert_close(logits, model.lm_head(hidden[:rows]).float())
    assert calls == [3]
