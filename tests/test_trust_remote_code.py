"""A tokenizer that is the checkpoint's own code (Kimi-K2 ships its tiktoken tokenizer that way) loads only
with `trust_remote_code` / `--trust-remote-code`; without it, a clear error at once (transformers, left to
itself, would ask on the terminal and wait)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest

from tokenspeed import LLM, SamplingParams
from tokenspeed.engine.model_files import load_tokenizer
from tokenspeed.engine_args import add_engine_args, engine_config_from_args
from tokenspeed.errors import ModelNotSupported

# Characters are ids 3..258; 0, 1, 2 are pad, bos, eos.
TOKENIZER_CODE = '''
from transformers import PreTrainedTokenizer


class CharTokenizer(PreTrainedTokenizer):
    model_input_names = ["input_ids", "attention_mask"]

    def __init__(self, **kwargs):
        kwargs.setdefault("pad_token", "<pad>")
        kwargs.setdefault("bos_token", "<s>")
        kwargs.setdefault("eos_token", "</s>")
        super().__init__(**kwargs)

    @property
    def vocab_size(self):
        return 259

    def get_vocab(self):
        return {"<pad>": 0, "<s>": 1, "</s>": 2, **{chr(i): i + 3 for i in range(256)}}

    def _tokenize(self, text):
        return list(text)

    def _convert_token_to_id(self, token):
        return self.get_vocab().get(token, 0)

    def _convert_id_to_token(self, index):
        return {0: "<pad>", 1: "<s>", 2: "</s>"}.get(index, chr(index - 3) if 3 <= index < 259 else "")

    def convert_tokens_to_string(self, tokens):
        return "".join(tokens)

    def save_vocabulary(self, save_directory, filename_prefix=None):
        return ()
'''


@pytest.fixture
def remote_tokenizer(tmp_path: Path) -> Path:
    (tmp_path / "tokenization_chars.py").write_text(TOKENIZER_CODE)
    auto_map = {"AutoTokenizer": ["tokenization_chars.CharTokenizer", None]}
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"tokenizer_class": "CharTokenizer",
                                                                "auto_map": auto_map}))  # fmt: skip
    return tmp_path


def test_the_checkpoints_own_tokenizer_code_needs_the_flag(remote_tokenizer: Path) -> None:
    with pytest.raises(ModelNotSupported, match="--trust-remote-code"):
        load_tokenizer(remote_tokenizer)
    tokenizer = load_tokenizer(remote_tokenizer, trust_remote_code=True)
    assert type(tokenizer).__name__ == "CharTokenizer"
    assert tokenizer("hi", add_special_tokens=False).input_ids == [107, 108]


def test_llm_serves_text_through_a_trusted_tokenizer(remote_tokenizer: Path) -> None:
    """The embedded model (vocabulary over 259) under the character tokenizer: text in, text out."""
    llm = LLM(tokenizer=str(remote_tokenizer), trust_remote_code=True, max_model_len=256, show_progress=False)
    try:
        params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
        out = llm.generate(["hello"], params)[0]
        assert out.prompt_token_ids == [107, 104, 111, 111, 114]
        assert out.outputs[0].text == llm.tokenizer.decode(out.outputs[0].token_ids)
    finally:
        llm.shutdown()


def test_flag_reaches_the_engine_config() -> None:
    parser = argparse.ArgumentParser()
    add_engine_args(parser)
    assert engine_config_from_args(parser.parse_args(["--trust-remote-code"])).trust_remote_code
    assert not engine_config_from_args(parser.parse_args([])).trust_remote_code
