"""`n > 1` with a seed returns the outputs recorded on the old (scheduler-fork) code.

The fixture (`tests/data/n_samples.json`, see `tests/n_samples_cases.py`) holds
the token ids of every sample; children of a fanned-out request must draw
exactly what the forks drew: child i samples with seed + i from sample index 0.
"""

from __future__ import annotations

import json

import pytest

from tests.n_samples_cases import ASYNC_CASE, CASES, FIXTURE, PROMPTS, checkpoint, run_async, run_llm


@pytest.fixture(scope="module")
def recorded():
    body = json.loads(FIXTURE.read_text())
    assert body["prompts"] == PROMPTS and body["cases"] == CASES, "the cases changed: re-record the fixture"
    return body["outputs"]


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return checkpoint(tmp_path_factory.mktemp("n_samples"))


@pytest.mark.parametrize("disable_overlap", [False, True], ids=["overlap", "sync"])
def test_llm_reproduces_recorded_samples(recorded, folder, disable_overlap):
    assert run_llm(folder, disable_overlap=disable_overlap) == recorded


def test_async_engine_reproduces_recorded_samples(recorded, folder):
    assert run_async(folder) == recorded[ASYNC_CASE]
