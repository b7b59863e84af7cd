"""Tests for the committed assets of TokenSpeed's embedded default model.

Why: with no model argument TokenSpeed serves a tiny local model, and its
tokenizer/chat template are what the whole serving path (detokenisation,
tool-call and reasoning parsers, prefix cache) runs through.  These tests pin
the properties that path relies on: lossless byte-level round trips, atomic
special tokens with fixed ids, real compression of code, consistent eos ids
between tokenizer and model config, and a chat template whose rendering of a
conversation only ever grows by appending (so agent turns reuse the cache).
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Any

import jinja2
import pytest
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer
from transformers import AutoTokenizer

# Located by path (not import) so these checks need neither torch nor the rest of the package.
EMBEDDED = Path(__file__).resolve().parents[1] / "tokenspeed" / "models" / "embedded"
SPECIAL_IDS = {
    "<|endoftext|>": 0,
    "<|im_start|>": 1,
    "<|im_end|>": 2,
    "<think>": 3,
    "</think>": 4,
    "<tool_call>": 5,
    "</tool_call>": 6,
}

CODE_SAMPLE = '''\
from __future__ import annotations

import dataclasses
from collections import OrderedDict


@dataclasses.dataclass
class PageTable:
    """Maps request ids to the KV-cache pages they own."""

    page_size: int
    free_pages: list[int] = dataclasses.field(default_factory=list)
    owners: dict[str, list[int]] = dataclasses.field(default_factory=dict)

    def allocate(self, request_id: str, num_tokens: int) -> list[int]:
        needed = (num_tokens + self.page_size - 1) // self.page_size
        if needed > len(self.free_pages):
            raise RuntimeError(f"out of pages: need {needed}, have {len(self.free_pages)}")
        pages = [self.free_pages.pop() for _ in range(needed)]
        self.owners.setdefault(request_id, []).extend(pages)
        return pages

    def release(self, request_id: str) -> None:
        for page in self.owners.pop(request_id, []):
            self.free_pages.append(page)


class LRUCache(OrderedDict):
    def __init__(self, capacity: int = 128) -> None:
        super().__init__()
        self.capacity = capacity

    def get(self, key, default=None):
        if key not in self:
            return default
        self.move_to_end(key)
        return self[key]

    def put(self, key, value) -> None:
        self[key] = value
        self.move_to_end(key)
        while len(self) > self.capacity:
            self.popitem(last=False)


def main(argv: list[str] | None = None) -> int:
    table = PageTable(page_size=16, free_pages=list(range(1024)))
    for i in range(8):
        table.allocate(f"req-{i}", num_tokens=100 * (i + 1))
    print(sum(len(v) for v in table.owners.values()), "pages in use")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
'''

ROUND_TRIP_TEXTS = [
    CODE_SAMPLE,
    "def f(x):\n\treturn x  \r\n\n\n    # trailing spaces   \n",
    "  leading spaces and trailing ",
    "héllo wörld — naïve café, Ελληνικά, Русский, 中文字符, 日本語のテキスト, 한국어",
    "emoji 🚀👩‍💻🇯🇵 and combining e\u0301 and RTL مرحبا بالعالم שלום",
    "control \x00\x01\x7f chars, zero-width \u200b\u200d, BOM \ufeff, replacement \ufffd",
    'json {"a": [1, 2.5e-3, null], "b": "\\u00e9"} and <tags attr="1"/>',
    "",
    " ",
    "\n",
]

TOOLS: list[dict[str, Any]] = [
    {
        "type": "function",
        "function": {
            "name": "read_file",
            "description": "Read a file from the workspace.",
            "parameters": {
                "type": "object",
                "properties": {"path": {"type": "string", "description": "Path <relative> & 'quoted'"}},
                "required": ["path"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "run",
            "description": "Run a shell command.",
            "parameters": {
                "type": "object",
                "properties": {"cmd": {"type": "string"}, "timeout": {"type": "integer"}},
                "required": ["cmd"],
            },
        },
    },
]


def agent_conversation() -> list[dict[str, Any]]:
    """A 5-exchange agent transcript with reasoning, tool calls and tool results."""
    return [
        {"role": "system", "content": "You are a coding agent."},
        # 1
        {"role": "user", "content": "What is in setup.py?"},
        {
            "role": "assistant",
            "reasoning_content": "I should read the file.",
            "content": "",
            "tool_calls": [
                {"type": "function", "function": {"name": "read_file", "arguments": {"path": "setup.py"}}}
            ],
        },
        {"role": "tool", "content": "from setuptools import setup\nsetup()\n"},
        {
            "role": "assistant",
            "reasoning_content": "\nIt is a stub.\n",
            "content": "It only calls `setup()`.",
        },
        # 2
        {
            "role": "user",
            "content": [{"type": "text", "text": "Run the tests, "}, {"type": "text", "text": "please."}],
        },
        {
            "role": "assistant",
            "reasoning_content": "Two commands.",
            "content": "Running them now.",
            "tool_calls": [
                {"type": "function", "function": {"name": "run", "arguments": '{"cmd": "pytest -q"}'}},
                {
                    "type": "function",
                    "function": {"name": "run", "arguments": {"cmd": "ruff check", "timeout": 60}},
                },
            ],
        },
        {"role": "tool", "content": "3 passed"},
        {"role": "tool", "content": "All checks passed!"},
        {"role": "assistant", "content": "Tests and lint pass."},
        # 3
        {"role": "user", "content": "Thanks. Any unicode issues? 中文 🚀"},
        {"role": "assistant", "reasoning_content": "None seen.", "content": " None that I can see."},
        # 4
        {"role": "user", "content": "Show the first line."},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [{"name": "read_file", "arguments": {"path": "a.py"}}],
        },
        {"role": "tool", "content": "import os"},
        {"role": "assistant", "content": "`import os`"},
        # 5
        {"role": "user", "content": "Done."},
        {"role": "assistant", "reasoning_content": "Wrap up.", "content": "Bye!"},
    ]


@pytest.fixture(scope="module")
def raw() -> Tokenizer:
    return Tokenizer.from_file(str(EMBEDDED / "tokenizer.json"))


@pytest.fixture(scope="module")
def hf() -> Any:
    return AutoTokenizer.from_pretrained(str(EMBEDDED))


def render(hf: Any, messages: list[dict[str, Any]], *, gen: bool = False, tools: Any = TOOLS) -> str:
    return hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=gen)


def test_files_present_and_small() -> None:
    for name in ("tokenizer.json", "tokenizer_config.json", "config.json", "chat_template.jinja"):
        assert (EMBEDDED / name).is_file(), name
    assert (EMBEDDED / "tokenizer.json").stat().st_size < 400_000


def test_vocab_and_special_ids(raw: Tokenizer, hf: Any) -> None:
    assert raw.get_vocab_size() == 4096
    assert len(hf) == 4096
    for tok, idx in SPECIAL_IDS.items():
        assert raw.token_to_id(tok) == idx
        assert raw.encode(tok).ids == [idx]
        assert raw.encode(f"x{tok}y").ids.count(idx) == 1
        assert hf.convert_tokens_to_ids(tok) == idx
        assert hf.encode(tok, add_special_tokens=False) == [idx]


def test_hf_special_token_attributes(hf: Any) -> None:
    assert hf.eos_token == "<|im_end|>" and hf.eos_token_id == 2
    assert hf.pad_token == "<|endoftext|>" and hf.pad_token_id == 0
    assert hf.bos_token is None
    assert hf.model_max_length == 4096
    # No BOS/EOS is inserted implicitly.
    assert hf.encode("hi") == hf.encode("hi", add_special_tokens=False)


def test_markup_tokens_survive_skip_special_tokens(hf: Any) -> None:
    text = "<|im_start|>assistant\n<think>\nr\n</think>\n\n<tool_call>\n{}\n</tool_call><|im_end|>"
    ids = hf.encode(text, add_special_tokens=False)
    assert hf.decode(ids) == text
    assert (
        hf.decode(ids, skip_special_tokens=True)
        == "assistant\n<think>\nr\n</think>\n\n<tool_call>\n{}\n</tool_call>"
    )


def test_model_config_matches_tokenizer(raw: Tokenizer) -> None:
    cfg = json.loads((EMBEDDED / "config.json").read_text())
    assert cfg["architectures"] == ["Qwen3ForCausalLM"] and cfg["model_type"] == "qwen3"
    assert cfg["vocab_size"] == raw.get_vocab_size()
    assert cfg["bos_token_id"] is None
    eos = cfg["eos_token_id"]
    eos_ids = eos if isinstance(eos, list) else [eos]
    assert eos_ids[0] == raw.token_to_id("<|im_end|>")
    assert set(eos_ids) <= {raw.token_to_id("<|im_end|>"), raw.token_to_id("<|endoftext|>")}
    assert cfg["num_attention_heads"] * cfg["head_dim"] == 256 == cfg["hidden_size"]
    assert cfg["num_attention_heads"] % cfg["num_key_value_heads"] == 0
    assert cfg["tie_word_embeddings"] is True
    assert cfg["max_position_embeddings"] == 4096


@pytest.mark.parametrize("text", ROUND_TRIP_TEXTS)
def test_round_trip_exact(raw: Tokenizer, hf: Any, text: str) -> None:
    ids = raw.encode(text).ids
    assert raw.decode(ids, skip_special_tokens=False) == text
    assert hf.encode(text, add_special_tokens=False) == ids
    assert hf.decode(ids) == text


def test_round_trip_random_unicode(raw: Tokenizer) -> None:
    rng = random.Random(1234)
    pools = [(0x20, 0x7E), (0xA0, 0x24F), (0x370, 0x4FF), (0x4E00, 0x4FFF), (0x1F300, 0x1F64F), (0x0, 0x1F)]
    for _ in range(200):
        chars = []
        for _ in range(rng.randint(0, 60)):
            lo, hi = rng.choice(pools)
            chars.append(chr(rng.randint(lo, hi)))
        text = "".join(chars)
        assert raw.decode(raw.encode(text).ids) == text


def test_incremental_decode_is_byte_exact(raw: Tokenizer) -> None:
    # Streaming detokenisers decode per token; concatenated token bytes must equal the text.
    text = "naïve 中文 🚀 code: print('ok')\n"
    ids = raw.encode(text).ids
    byte_decoder = {c: b for b, c in _bytes_to_unicode().items()}
    data = b"".join(bytes(byte_decoder[c] for c in raw.id_to_token(i)) for i in ids)
    assert data.decode("utf-8") == text


def _bytes_to_unicode() -> dict[int, str]:
    bs = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs)))


def test_code_compresses(raw: Tokenizer) -> None:
    samples = [CODE_SAMPLE, Path(__file__).read_text(encoding="utf-8")]
    for sample in samples:
        ratio = len(raw.encode(sample).ids) / len(sample)
        assert ratio < 0.45, ratio


def test_chat_template_shipped_in_config(hf: Any) -> None:
    cfg = json.loads((EMBEDDED / "tokenizer_config.json").read_text())
    assert cfg["chat_template"] == (EMBEDDED / "chat_template.jinja").read_text(encoding="utf-8")
    assert hf.chat_template == cfg["chat_template"]


def test_chat_template_renders_tools_calls_and_reasoning(hf: Any) -> None:
    msgs = agent_conversation()
    out = render(hf, msgs[:5])
    assert out.startswith("<|im_start|>system\nYou are a coding agent.\n\n# Tools\n")
    assert "<tools>\n" + json.dumps(TOOLS[0], ensure_ascii=False) + "\n" in out
    assert '<tool_call>\n{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>' in out
    assert "<|im_start|>user\nWhat is in setup.py?<|im_end|>\n" in out
    assert (
        "<|im_start|>assistant\n<think>\nI should read the file.\n</think>\n\n"
        '<tool_call>\n{"name": "read_file", "arguments": {"path": "setup.py"}}\n</tool_call><|im_end|>\n'
    ) in out
    assert (
        "<|im_start|>user\n<tool_response>\nfrom setuptools import setup\nsetup()\n\n</tool_response><|im_end|>\n"
        in out
    )
    assert out.endswith(
        "<|im_start|>assistant\n<think>\nIt is a stub.\n</think>\n\nIt only calls `setup()`.<|im_end|>\n"
    )

    out2 = render(hf, msgs[:10])
    assert "<|im_start|>user\nRun the tests, please.<|im_end|>\n" in out2
    assert (
        'Running them now.\n<tool_call>\n{"name": "run", "arguments": {"cmd": "pytest -q"}}\n</tool_call>\n'
        '<tool_call>\n{"name": "run", "arguments": {"cmd": "ruff check", "timeout": 60}}\n</tool_call><|im_end|>\n'
    ) in out2

    gen = render(hf, msgs[:2], gen=True)
    assert gen.endswith("<|im_start|>user\nWhat is in setup.py?<|im_end|>\n<|im_start|>assistant\n")


def test_chat_template_without_tools_or_system(hf: Any) -> None:
    out = render(hf, [{"role": "user", "content": "hi"}], gen=True, tools=None)
    assert out == "<|im_start|>user\nhi<|im_end|>\n<|im_start|>assistant\n"
    out = render(hf, [{"role": "user", "content": "hi"}], tools=TOOLS[:1])
    assert out.startswith("<|im_start|>system\n# Tools\n\nYou may call")
    assert out.endswith("</tool_call><|im_end|>\n<|im_start|>user\nhi<|im_end|>\n")


@pytest.mark.parametrize("tools", [TOOLS, None])
def test_chat_template_prefix_stable(hf: Any, raw: Tokenizer, tools: Any) -> None:
    msgs = agent_conversation()
    assert sum(m["role"] == "user" for m in msgs) == 5
    prev_text: str | None = None
    for k in range(1, len(msgs) + 1):
        text = render(hf, msgs[:k], tools=tools)
        if prev_text is not None:
            assert text.startswith(prev_text), f"turn {k} rewrote earlier turns"
            # Token ids too: the prefix cache works on ids, not strings.
            prev_ids = raw.encode(prev_text).ids
            assert raw.encode(text).ids[: len(prev_ids)] == prev_ids
        if msgs[k - 1]["role"] != "assistant" and k < len(msgs) and msgs[k]["role"] == "assistant":
            prompt = render(hf, msgs[:k], gen=True, tools=tools)
            nxt = render(hf, msgs[: k + 1], tools=tools)
            assert nxt.startswith(prompt), f"generation prompt before turn {k + 1} is not a prefix"
            prompt_ids = raw.encode(prompt).ids
            assert raw.encode(nxt).ids[: len(prompt_ids)] == prompt_ids
        prev_text = text


def test_chat_template_plain_jinja2(hf: Any) -> None:
    """Engines may render with bare jinja2 (default ``tojson``); it must still work and be prefix stable."""
    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, undefined=jinja2.Undefined)
    template = env.from_string((EMBEDDED / "chat_template.jinja").read_text(encoding="utf-8"))
    msgs = agent_conversation()
    prev = ""
    for k in range(1, len(msgs) + 1):
        text = template.render(messages=msgs[:k], tools=TOOLS, add_generation_prompt=False)
        assert text.startswith(prev)
        prev = text
    no_tools = [m for m in msgs if m["role"] in ("user", "system") or not m.get("tool_calls")]
    no_tools = [m for m in no_tools if m["role"] != "tool"]
    assert template.render(messages=no_tools, add_generation_prompt=True) == render(
        hf, no_tools, gen=True, tools=None
    )
