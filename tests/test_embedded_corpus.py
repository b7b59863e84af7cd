"""The embedded models' training data: split by file content hash, stable, deduplicated, bytes exact."""

from __future__ import annotations

import hashlib

import numpy as np
import pytest

from tokenspeed.models.embedded.materialize import package_dir
from tokenspeed.models.embedded.training import corpus
from tokenspeed.models.embedded.training.corpus import CorpusOptions

STDLIB_SAMPLE = CorpusOptions(sources=("stdlib",), held_out_per_mille=100, total_budget_bytes=600_000)


@pytest.fixture(scope="module")
def sample():
    return corpus.discover(STDLIB_SAMPLE)


@pytest.fixture(scope="module")
def tokenizer():
    return corpus.load_tokenizer(package_dir() / "tokenizer.json")


def test_split_is_a_fixed_function_of_the_file_content():
    # Pinned values: changing the rule would silently change every held-out number.
    digest = hashlib.sha256(b"print('hello')\n").hexdigest()
    assert int(digest[:8], 16) % 1000 == 777
    assert corpus.is_held_out(digest, 778) and not corpus.is_held_out(digest, 777)


def test_files_are_split_by_file_and_the_split_is_stable(sample):
    assert sample, "no stdlib files found"
    held = [f for f in sample if f.held_out]
    assert 0 < len(held) < len(sample)
    for f in sample:  # the side follows from the content alone
        assert f.held_out == corpus.is_held_out(hashlib.sha256(f.path.read_bytes()).hexdigest(), 100)
    assert len({f.sha256 for f in sample}) == len(sample), "copies of one text must count once"
    again = corpus.discover(STDLIB_SAMPLE)
    assert [(f.relpath, f.held_out) for f in again] == [(f.relpath, f.held_out) for f in sample]
    assert corpus.files_digest(again) == corpus.files_digest(sample)
    assert sum(f.size for f in sample) <= STDLIB_SAMPLE.total_budget_bytes


def test_token_bytes_count_exactly_the_text(sample, tokenizer):
    lengths = corpus.token_byte_lengths(tokenizer)
    assert lengths[tokenizer.token_to_id(corpus.SEPARATOR_TOKEN)] == 0
    texts = [f.path.read_text(encoding="utf-8") for f in sample[:20]]
    texts.append('x = "<|endoftext|> <|im_end|>"  # <think> héllo\n')  # special-token text stays text
    for text in texts:
        ids = tokenizer.encode(text, add_special_tokens=False).ids
        assert corpus.SEPARATOR_TOKEN not in text or tokenizer.token_to_id(corpus.SEPARATOR_TOKEN) not in ids
        assert int(lengths[ids].sum()) == len(text.encode("utf-8"))


def test_tokenised_corpus_and_eval_windows(sample):
    built = corpus.build_corpus(package_dir() / "tokenizer.json", STDLIB_SAMPLE)
    assert [f.relpath for f in built.files] == [f.relpath for f in sample]
    separator = 0
    assert (built.train == separator).sum() == sum(not f.held_out for f in sample)
    assert (built.held_out == separator).sum() == sum(f.held_out for f in sample)
    windows = corpus.eval_windows(built.held_out, 64, 10)
    assert windows.shape == (10, 64) and windows.dtype == np.int64
    total = built.held_out.size // 64
    for i, window in enumerate(windows):  # aligned slices spread over the whole held-out stream
        start = (i * total // 10) * 64
        assert np.array_equal(window, built.held_out[start : start + 64])
    same, token_bytes, about = corpus.held_out_windows(package_dir() / "tokenizer.json", STDLIB_SAMPLE, 64, 10)
    assert np.array_equal(same, windows) and about["data_files_sha256"] == built.summary()["data_files_sha256"]
    assert np.array_equal(token_bytes, built.token_bytes)
