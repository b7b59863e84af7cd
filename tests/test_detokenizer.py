"""Incremental detokenisation equals a full decode, token by token, multi-byte characters included."""

from __future__ import annotations

import random

import pytest

from tokenspeed.engine.detokenizer import IncrementalDetokenizer
from tokenspeed.engine.llm import load_tokenizer
from tokenspeed.models.embedded.materialize import embedded_model_path

TEXTS = [
    "def fib(n):\n    return n if n < 2 else fib(n - 1) + fib(n - 2)\n",
    "naïve café — 日本語のテキスト 🚀 emoji and ünïcödé",
    "    indented\n\n\ttabs\t and  double  spaces  ",
]


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(embedded_model_path())


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_equals_full_decode(tokenizer, text):
    prompt = tokenizer.encode("x = 1\n")
    ids = tokenizer.encode(text)
    detok = IncrementalDetokenizer(tokenizer, prompt)
    for token in ids:
        detok.push([token])
        assert tokenizer.decode(ids, skip_special_tokens=True).startswith(detok.text)
    assert detok.text == tokenizer.decode(ids, skip_special_tokens=True)


def test_random_token_soup_never_loses_text(tokenizer):
    rng = random.Random(0)
    ids = [rng.randrange(10, tokenizer.vocab_size) for _ in range(300)]
    detok = IncrementalDetokenizer(tokenizer, [])
    for i in range(0, len(ids), 3):
        detok.push(ids[i : i + 3])
    full = tokenizer.decode(ids, skip_special_tokens=True)
    # Invalid UTF-8 may stay pending at the very end; everything before it is emitted.
    assert full.startswith(detok.text) and len(full) - len(detok.text) <= 2


def test_stop_string_spanning_tokens_is_found_and_cut(tokenizer):
    ids = tokenizer.encode("alpha beta gamma delta")
    detok = IncrementalDetokenizer(tokenizer, [], stop=["ta gam"])
    match = None
    for token in ids:
        match = match or detok.push([token])
    assert match is not None and match.stop == "ta gam"
    assert detok.text == "alpha be"


def test_earliest_stop_string_wins(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=["gamma", "beta"], include_stop_str_in_output=True)
    match = detok.push(tokenizer.encode("alpha beta gamma"))
    assert match.stop == "beta" and detok.text == "alpha beta"
