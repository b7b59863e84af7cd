"""Build the tokenizer and config shipped as TokenSpeed's embedded default model.

Why this exists: with no model argument TokenSpeed serves a tiny Qwen3-shaped
model that is materialised locally, so the first run needs no network and no
hub account.  A random-weight model still needs a *real* tokenizer: the
serving stack (chat template, special tokens, detokenisation, tool-call and
reasoning parsers, prefix cache) is exercised through it, and agents send
mostly code, so it should compress code like a real one.

This script is run once by a developer and its outputs are committed
(``tokenizer.json``, ``tokenizer_config.json``, ``config.json``); it is not
run at install or serve time.  It trains a byte-level BPE (GPT-2/Qwen style)
on Python sources of the local standard library only -- no downloads -- using a
deterministic, sorted subset so a rerun on the same interpreter reproduces the
same files byte for byte.

Usage::

    python -m tokenspeed.models.embedded.train_tokenizer [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import sysconfig
from collections.abc import Iterator
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

HERE = Path(__file__).resolve().parent

VOCAB_SIZE = 4096
MODEL_MAX_LENGTH = 4096
CORPUS_BUDGET_BYTES = 8 * 1024 * 1024

# Order fixes the ids: 0..6.  The first three are control tokens (hidden by
# ``skip_special_tokens``); the last four are markup the reasoning and
# tool-call parsers must still see in decoded text, so -- as in Qwen3 -- they
# are atomic added tokens but not "special".
CONTROL_TOKENS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
MARKUP_TOKENS = ["<think>", "</think>", "<tool_call>", "</tool_call>"]
SPECIAL_TOKENS = CONTROL_TOKENS + MARKUP_TOKENS
EOS_TOKEN = "<|im_end|>"
PAD_TOKEN = "<|endoftext|>"

# Test suites dominate the stdlib and are full of deliberately odd strings;
# site-packages is not the stdlib at all.
EXCLUDED_DIRS = frozenset({"site-packages", "test", "tests", "idle_test", "__pycache__"})


def corpus_files(budget: int = CORPUS_BUDGET_BYTES) -> list[Path]:
    """Deterministic subset of stdlib ``.py`` files totalling about ``budget`` bytes.

    Files are sorted by relative path and sampled evenly across that order
    (rather than taking a prefix) so every package contributes.
    """
    root = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(
        (p for p in root.rglob("*.py") if not EXCLUDED_DIRS.intersection(p.relative_to(root).parts)),
        key=lambda p: p.relative_to(root).as_posix(),
    )
    total = sum(p.stat().st_size for p in files)
    if total <= budget:
        return files
    # Take a file whenever the selected bytes lag the target share
    # (budget/total) of the bytes seen so far.
    ratio = budget / total
    picked: list[Path] = []
    seen = taken = 0
    for p in files:
        seen += p.stat().st_size
        if taken < seen * ratio:
            picked.append(p)
            taken += p.stat().st_size
    return picked


def iter_texts(files: list[Path]) -> Iterator[str]:
    for p in files:
        try:
            yield p.read_bytes().decode("utf-8")
        except UnicodeDecodeError:
            continue


def train(files: list[Path]) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=VOCAB_SIZE,
        min_frequency=2,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(iter_texts(files), trainer=trainer)
    # Demote the markup tokens to non-special added tokens (ids unchanged).
    data = json.loads(tok.to_str())
    for entry in data["added_tokens"]:
        entry["special"] = entry["content"] in CONTROL_TOKENS
        entry["normalized"] = False
    tok = Tokenizer.from_str(json.dumps(data))
    for i, t in enumerate(SPECIAL_TOKENS):
        assert tok.token_to_id(t) == i, (t, tok.token_to_id(t))
    assert tok.get_vocab_size() == VOCAB_SIZE, tok.get_vocab_size()
    return tok


def tokenizer_config(tok: Tokenizer, chat_template: str) -> dict[str, object]:
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS_TOKEN,
        "pad_token": PAD_TOKEN,
        "unk_token": None,
        # Markup tokens stay out of this list: older transformers strip every
        # listed token on ``skip_special_tokens`` decode.
        "additional_special_tokens": [t for t in CONTROL_TOKENS if t != PAD_TOKEN],
        "add_bos_token": False,
        "add_prefix_space": False,
        "clean_up_tokenization_spaces": False,
        "split_special_tokens": False,
        "model_max_length": MODEL_MAX_LENGTH,
        "added_tokens_decoder": {
            str(i): {
                "content": t,
                "lstrip": False,
                "normalized": False,
                "rstrip": False,
                "single_word": False,
                "special": t in CONTROL_TOKENS,
            }
            for i, t in enumerate(SPECIAL_TOKENS)
        },
        "chat_template": chat_template,
    }


def model_config(tok: Tokenizer) -> dict[str, object]:
    eos = tok.token_to_id(EOS_TOKEN)
    endoftext = tok.token_to_id(PAD_TOKEN)
    return {
        "architectures": ["Qwen3ForCausalLM"],
        "model_type": "qwen3",
        "vocab_size": VOCAB_SIZE,
        "hidden_size": 256,
        "intermediate_size": 576,  # sized so the models and their draft heads fit 16 MB of bf16 together
        "num_hidden_layers": 4,
        "num_attention_heads": 8,
        "num_key_value_heads": 2,
        "head_dim": 32,
        "hidden_act": "silu",
        "max_position_embeddings": MODEL_MAX_LENGTH,
        "rope_theta": 1000000.0,
        "rope_scaling": None,
        "rms_norm_eps": 1e-6,
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "max_window_layers": 4,
        "initializer_range": 0.02,
        "tie_word_embeddings": True,
        "use_cache": True,
        "bos_token_id": None,
        "eos_token_id": [eos, endoftext],
        "pad_token_id": endoftext,
        "torch_dtype": "bfloat16",
    }


def write_json(path: Path, obj: object) -> None:
    path.write_text(json.dumps(obj, indent=2, ensure_ascii=False) + "\n", encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=HERE, help="output folder (default: this package)")
    args = parser.parse_args(argv)
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)

    files = corpus_files()
    size = sum(p.stat().st_size for p in files)
    tok = train(files)
    # Compact (non-pretty) JSON keeps the committed file small.
    tok.save(str(out / "tokenizer.json"), pretty=False)

    chat_template = (HERE / "chat_template.jinja").read_text(encoding="utf-8")
    if out != HERE:
        (out / "chat_template.jinja").write_text(chat_template, encoding="utf-8")
    write_json(out / "tokenizer_config.json", tokenizer_config(tok, chat_template))
    write_json(out / "config.json", model_config(tok))
    print(f"trained on {len(files)} files ({size / 1e6:.2f} MB); wrote {out}")


if __name__ == "__main__":
    main()
