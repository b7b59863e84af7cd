"""The offline `LLM` API on the embedded model: vLLM-shaped outputs and request options."""

from __future__ import annotations

import json

import pytest

from tokenspeed import LLM, SamplingParams


@pytest.fixture(scope="module")
def llm():
    return LLM(page_size=16, max_model_len=1024)


def greedy(**kw) -> SamplingParams:
    return SamplingParams(temperature=0.0, **kw)


def test_generate_returns_vllm_shaped_outputs(llm):
    out = llm.generate(["def fib(n):", "import os\n"], greedy(max_tokens=8, ignore_eos=True))
    assert [o.prompt for o in out] == ["def fib(n):", "import os\n"]
    for o in out:
        assert o.finished and o.prompt_token_ids == llm.tokenizer.encode(o.prompt)
        completion = o.outputs[0]
        assert len(completion.token_ids) == 8 and completion.finish_reason == "length"
        assert completion.text == llm.tokenizer.decode(completion.token_ids, skip_special_tokens=True)
        assert 0.0 <= o.metrics["time_in_queue"] < 60.0  # vLLM's RequestMetrics name: submit to admission


def test_token_id_prompts_and_text_prompts_agree(llm):
    ids = llm.tokenizer.encode("class Foo:")
    a = llm.generate("class Foo:", greedy(max_tokens=6, ignore_eos=True))[0]
    b = llm.generate({"prompt_token_ids": ids}, greedy(max_tokens=6, ignore_eos=True))[0]
    assert a.outputs[0].token_ids == b.outputs[0].token_ids


def test_stop_token_ids_and_min_tokens(llm):
    sampled = dict(temperature=1.0, seed=1, max_tokens=12, ignore_eos=True)
    first = llm.generate("x = ", SamplingParams(**sampled))[0].outputs[0].token_ids
    j = next(i for i in range(1, len(first)) if first[i] not in first[:i])  # first new token after the start
    stopped = llm.generate("x = ", SamplingParams(**sampled, stop_token_ids=[first[j]]))[0].outputs[0]
    assert stopped.token_ids == first[: j + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == first[j]
    # min_tokens forbids stop tokens until 4 tokens are out.
    forced = llm.generate("x = ", SamplingParams(**sampled, stop_token_ids=[first[0]], min_tokens=4))[0]
    assert len(forced.outputs[0].token_ids) >= 4 and first[0] not in forced.outputs[0].token_ids[:4]


def test_stop_string_is_cut_from_text(llm):
    full = llm.generate("def f():", greedy(max_tokens=12, ignore_eos=True))[0].outputs[0]
    assert len(full.text) > 6
    stop = full.text[3:6]
    out = llm.generate("def f():", greedy(max_tokens=12, stop=[stop], ignore_eos=True))[0].outputs[0]
    assert out.finish_reason == "stop" and out.stop_reason == stop
    assert out.text == full.text[: full.text.find(stop)]
    kept = llm.generate(
        "def f():", greedy(max_tokens=12, stop=[stop], include_stop_str_in_output=True, ignore_eos=True)
    )[0].outputs[0]
    assert kept.text == full.text[: full.text.find(stop) + len(stop)]


def test_eos_ends_generation_unless_ignored(llm):
    eos = llm.eos_token_ids[0]
    out = llm.generate("a", SamplingParams(temperature=0.0, max_tokens=50, stop_token_ids=[]))[0]
    if out.outputs[0].finish_reason == "stop":
        assert out.outputs[0].token_ids[-1] in llm.eos_token_ids
    ignored = llm.generate("a", greedy(max_tokens=50, ignore_eos=True))[0].outputs[0]
    assert len(ignored.token_ids) == 50 and ignored.finish_reason == "length"
    assert eos in llm.eos_token_ids


def test_seed_makes_sampling_reproducible(llm):
    params = SamplingParams(temperature=1.0, seed=42, max_tokens=16, ignore_eos=True)
    a = llm.generate(["hello"] * 2, params)
    b = llm.generate("hello", params)[0]
    assert a[0].outputs[0].token_ids == a[1].outputs[0].token_ids == b.outputs[0].token_ids
    other = llm.generate("hello", SamplingParams(temperature=1.0, seed=43, max_tokens=16, ignore_eos=True))[0]
    assert other.outputs[0].token_ids != b.outputs[0].token_ids


def test_n_samples_share_the_prompt_and_differ(llm):
    params = SamplingParams(n=4, temperature=1.0, seed=3, max_tokens=10, ignore_eos=True)
    out = llm.generate("for i in range(", params)[0]
    assert [c.index for c in out.outputs] == [0, 1, 2, 3]
    assert len({tuple(c.token_ids) for c in out.outputs}) > 1
    assert all(len(c.token_ids) == 10 for c in out.outputs)
    # Greedy samples are identical; they read one copy of the prompt's full pages.
    g = llm.generate("for i in range(", greedy(n=3, max_tokens=5, ignore_eos=True))[0]
    assert len({tuple(c.token_ids) for c in g.outputs}) == 1


def test_n_samples_share_prompt_pages():
    # The n children of a request share the prompt through the prefix cache (engine/fan_out.py),
    # even when they are admitted in one step.
    llm = LLM(page_size=4, max_model_len=256)
    prompt = {"prompt_token_ids": list(range(10, 30))}  # 20 tokens = 5 full pages
    used = []
    original = llm.core.step

    def step():
        updates = original()
        used.append(llm.core.scheduler.kv.stats().referenced)
        return updates

    llm.core.step = step
    llm.generate(prompt, SamplingParams(n=4, temperature=1.0, seed=0, max_tokens=3, ignore_eos=True))
    # 4 streams each owning a private copy would need >= 4 * 6 pages; shared prompt pages need far fewer.
    assert max(used) < 4 * 6


def test_prefix_reuse_reports_cached_tokens():
    llm = LLM(page_size=16, max_model_len=1024)
    shared = list(range(100, 300))  # 200 tokens
    first = llm.generate({"prompt_token_ids": shared + [5, 6, 7]}, greedy(max_tokens=2))[0]
    second = llm.generate({"prompt_token_ids": shared + [8, 9]}, greedy(max_tokens=2))[0]
    assert first.num_cached_tokens == 0
    assert second.num_cached_tokens >= 200 - 16
    off = LLM(page_size=16, max_model_len=1024, enable_prefix_caching=False)
    off.generate({"prompt_token_ids": shared + [5]}, greedy(max_tokens=2))
    assert off.generate({"prompt_token_ids": shared + [8]}, greedy(max_tokens=2))[0].num_cached_tokens == 0


def test_logprobs_shape(llm):
    out = llm.generate("def", greedy(max_tokens=4, logprobs=3, ignore_eos=True))[0].outputs[0]
    assert len(out.logprobs) == 4
    for token, position in zip(out.token_ids, out.logprobs):
        assert token in position and position[token].rank == 1  # greedy picks the top token
        assert len(position) == 3 and all(lp.decoded_token is not None for lp in position.values())
    assert out.cumulative_logprob == pytest.approx(sum(p[t].logprob for t, p in zip(out.token_ids, out.logprobs)))


def test_chat_uses_the_template(llm):
    messages = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"}]
    out = llm.chat(messages, greedy(max_tokens=4, ignore_eos=True))[0]
    rendered = llm.tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert out.prompt == rendered
    assert out.prompt_token_ids == llm.tokenizer.encode(rendered, add_special_tokens=False)
    batch = llm.chat([messages, messages[1:]], greedy(max_tokens=4, ignore_eos=True))
    assert len(batch) == 2 and batch[0].outputs[0].token_ids == out.outputs[0].token_ids


def test_eos_ids_of_config_json_stop_generation(tmp_path):
    """config.json's eos ids count even with no generation_config.json and no tokenizer: ModelConfig
    hands them over as a tuple, which the eos set once dropped. The AsyncEngine (hence the HTTP and
    gRPC servers) builds its set with the same function."""
    from tests.checkpoints import make_checkpoint
    from tokenspeed.engine.model_files import eos_token_ids
    from tokenspeed.models import ModelConfig

    folder = make_checkpoint("qwen3", tmp_path / "ckpt")
    (folder / "generation_config.json").unlink(missing_ok=True)
    prompt = {"prompt_token_ids": [5, 6, 7, 8]}
    with LLM(str(folder), skip_tokenizer_init=True, max_model_len=256, show_progress=False) as free:
        tokens = free.generate(prompt, greedy(max_tokens=12, ignore_eos=True))[0].outputs[0].token_ids
    stop_at = next(i for i in range(2, len(tokens)) if tokens[i] not in tokens[:i])
    config = json.loads((folder / "config.json").read_text())
    config["eos_token_id"] = [config["eos_token_id"], tokens[stop_at]]
    (folder / "config.json").write_text(json.dumps(config))

    assert eos_token_ids(folder, ModelConfig.from_pretrained(folder), None) == tuple(config["eos_token_id"])
    with LLM(str(folder), skip_tokenizer_init=True, max_model_len=256, show_progress=False) as llm:
        assert tokens[stop_at] in llm.eos_token_ids
        out = llm.generate(prompt, greedy(max_tokens=12))[0].outputs[0]
    assert out.token_ids == tokens[: stop_at + 1] and out.finish_reason == "stop"


def test_cpu_step_budget_defaults_to_1024_and_the_option_overrides_it(llm):
    """On the CPU a burst of prompts in one big step stalls every stream (see engine/core.py)."""
    assert llm.core.scheduler.config.max_num_batched_tokens == 1024
    explicit = LLM(page_size=16, max_model_len=1024, max_num_batched_tokens=512)
    try:
        assert explicit.core.scheduler.config.max_num_batched_tokens == 512
    finally:
        explicit.shutdown()
