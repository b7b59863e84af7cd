"""Speculative decoding through the whole engine (host drafters): outputs equal those with it off.

Tiny random checkpoints of a dense (Llama), an MoE (Qwen3-MoE) and an MLA +
MoE (DeepSeek-V3) model, agent-like prompts that repeat themselves (drafts
are accepted and rejected), prefix-cache hits, chunked prefill, preemption,
n > 1, overlap on and off, and sampling with penalties, logprobs and
min_tokens: every run must give the very tokens of the run without
speculation, and page accounting holds after every test (conftest).
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.spec_cases import FAMILIES, HOST_METHODS, agent_prompts, make_family, run, token_ids
from tokenspeed import SamplingParams
from tokenspeed.errors import InvalidRequest

GREEDY = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec_engine")
    return {family: make_family(family, root / family) for family in FAMILIES}


@pytest.mark.parametrize("method", sorted(HOST_METHODS))
@pytest.mark.parametrize("family", FAMILIES)
def test_greedy_outputs_equal_with_prefix_hits_and_chunking(folders: dict[str, Path], family: str, method: str) -> None:
    prompts = agent_prompts(4)
    prompts = prompts + prompts[:2]  # the repeats hit the prefix cache
    engine = dict(max_num_batched_tokens=24, page_size=4)  # prompts are chunked; decodes mix with chunks
    base, _ = run(folders[family], None, prompts, GREEDY, **engine)
    spec, llm = run(folders[family], HOST_METHODS[method], prompts, GREEDY, **engine)
    assert token_ids(spec) == token_ids(base)
    stats = llm.core.speculation_stats
    assert stats is not None and stats.num_accepted_tokens > 0 and stats.num_accepted_tokens < stats.num_draft_tokens
    assert max(o.num_cached_tokens for o in spec[4:]) > 0


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_verify_rows_padded_as_for_cuda_graphs_give_the_same_tokens(folders: dict[str, Path], family: str) -> None:
    """Every verify step laid out with 7 tokens a row (filler first, as a GPU lays them out for its
    verify graphs): the filler writes only the scratch page and changes no real token."""
    prompts = agent_prompts(4, seed=2)
    base, _ = run(folders[family], None, prompts, GREEDY, page_size=4)
    spec, llm = run(folders[family], HOST_METHODS["suffix"], prompts, GREEDY, page_size=4, verify_query_len=7)
    assert token_ids(spec) == token_ids(base)
    stats = llm.core.speculation_stats
    assert stats is not None and stats.num_accepted_tokens > 0


@pytest.mark.parametrize("overlap", [True, False])
def test_preemption_and_overlap(folders: dict[str, Path], overlap: bool) -> None:
    prompts = agent_prompts(6, seed=3, shared=8)
    engine = dict(page_size=4, num_kv_pages=48, max_model_len=128, disable_overlap=not overlap)
    base, _ = run(folders["llama"], None, prompts, GREEDY, **engine)
    spec, llm = run(folders["llama"], HOST_METHODS["suffix"], prompts, GREEDY, **engine)
    assert token_ids(spec) == token_ids(base)
    assert llm.core.scheduler.num_preemptions > 0


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_sampling_with_penalties_logprobs_and_min_tokens_gives_the_same_tokens(
    folders: dict[str, Path], family: str
) -> None:
    prompts = agent_prompts(3, seed=5)
    params = [
        SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=11, max_tokens=24, ignore_eos=True, logprobs=2),
        SamplingParams(temperature=1.0, seed=12, max_tokens=24, repetition_penalty=1.3, frequency_penalty=0.2,
                       presence_penalty=0.1, ignore_eos=True),
        SamplingParams(temperature=0.0, max_tokens=24, min_tokens=12, stop_token_ids=[7, 9, 11, 13]),
    ]
    base, _ = run(folders[family], None, prompts, params)
    spec, llm = run(folders[family], HOST_METHODS["ngram"], prompts, params)
    assert token_ids(spec) == token_ids(base)
    for a, b in zip(base[0].outputs[0].logprobs, spec[0].outputs[0].logprobs):
        assert a.keys() == b.keys()
        for token in a:
            assert abs(a[token].logprob - b[token].logprob) < 1e-4 and a[token].rank == b[token].rank
    stats = llm.core.speculation_stats
    assert stats is not None and stats.num_drafts > 0


def test_n_samples(folders: dict[str, Path]) -> None:
    prompts = agent_prompts(2, seed=7)
    params = SamplingParams(n=3, temperature=0.9, seed=3, max_tokens=20, ignore_eos=True)
    base, _ = run(folders["qwen3_moe"], None, prompts, params)
    spec, _ = run(folders["qwen3_moe"], HOST_METHODS["suffix"], prompts, params)
    assert token_ids(spec) == token_ids(base)
    assert all(len(o.outputs) == 3 for o in spec)


def test_bad_speculative_config_is_refused_before_loading(folders: dict[str, Path]) -> None:
    with pytest.raises(InvalidRequest, match="num_speculative_tokens"):
        run(folders["llama"], {"method": "ngram", "num_speculative_tokens": 0}, [[5, 6]], GREEDY)
    with pytest.raises(InvalidRequest, match="unknown key"):
        run(folders["llama"], '{"method": "suffix", "k": 3}', [[5, 6]], GREEDY)
    with pytest.raises(InvalidRequest, match="EAGLE-3"):
        run(folders["llama"], {"method": "eagle3", "model": "x", "num_speculative_tokens": 2}, [[5, 6]], GREEDY)
    with pytest.raises(InvalidRequest, match="multi-token-prediction"):
        run(folders["llama"], {"method": "mtp"}, [[5, 6]], GREEDY)
    with pytest.raises(InvalidRequest, match="no config.json"):
        run(folders["llama"], {"method": "eagle", "model": str(folders["llama"] / "none"),
                               "num_speculative_tokens": 2}, [[5, 6]], GREEDY)


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_fast_greedy_verify_on_and_off_give_the_same_tokens(
    folders: dict[str, Path], family: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """`fast_greedy_verify` (batched argmax/compare for all-plain-greedy steps) against the per-position
    path and against no speculation: greedy rows, a greedy row still short of `min_tokens` (not plain
    until it is past them) and a step mixing in a sampled row (the per-position path)."""
    from tokenspeed.spec.speculator import SpeculativeDecoder

    fast_steps = []
    greedy = SpeculativeDecoder._greedy
    monkeypatch.setattr(SpeculativeDecoder, "_greedy", staticmethod(
        lambda logits, batch, sampler: fast_steps.append(1) or greedy(logits, batch, sampler)))
    prompts = agent_prompts(4, seed=9)
    params = [GREEDY, GREEDY,
              SamplingParams(temperature=0.0, max_tokens=24, min_tokens=12, stop_token_ids=[7, 9, 11, 13]),
              SamplingParams(temperature=0.8, seed=4, max_tokens=12, ignore_eos=True)]
    base, _ = run(folders[family], None, prompts, params, page_size=4)
    outputs = {}
    for fast in (False, True):
        fast_steps.clear()
        spec = {**HOST_METHODS["suffix"], "fast_greedy_verify": fast}
        outputs[fast], llm = run(folders[family], spec, prompts, params, page_size=4)
        stats = llm.core.speculation_stats
        assert stats is not None and stats.num_accepted_tokens > 0
        assert bool(fast_steps) == fast  # on: the fast path ran (once the sampled row is done); off: never
    assert token_ids(outputs[True]) == token_ids(outputs[False]) == token_ids(base)


def test_an_engine_without_graphs_prices_verify_steps_as_its_graphs_would(folders: dict[str, Path]) -> None:
    """Padded verify rows but no CUDA graphs (`enforce_eager` on a GPU; here the CPU told to pad as a GPU does):
    the executor reports the verify-step bound its graphs would have, so the scheduler's adaptive drafting plans
    the same steps with graphs on and off (in bf16 a token's rounding depends on the step that computes it)."""
    from tokenspeed import LLM
    from tokenspeed.executor.cuda_graphs import VERIFY_MAX_TOKENS, verify_graph_sizes

    llm = LLM(str(folders["llama"]), speculative_config=HOST_METHODS["suffix"], show_progress=False,
              skip_tokenizer_init=True, max_num_seqs=64)  # fmt: skip
    executor = llm.core.executor
    assert executor.runner.graphs is None and executor.verify_shape is None  # the CPU pads nothing by itself
    executor.runner.verify_query_len = 7
    largest = max(verify_graph_sizes(64, 7))  # 64 rows x 7 tokens: 448, within VERIFY_MAX_TOKENS
    assert largest == 64 and largest * 7 <= VERIFY_MAX_TOKENS
    assert executor.verify_shape == (6, 448)
