"""Streaming deltas from the `OutputProcessor`: held-back stop-string prefixes, n streams, aborts, merging."""

from __future__ import annotations

import pytest

from tokenspeed.engine.detokenizer import IncrementalDetokenizer
from tokenspeed.engine.llm import load_tokenizer
from tokenspeed.engine.output_processor import OutputProcessor
from tokenspeed.engine.stream import RequestDelta, StreamDelta, merge_deltas
from tokenspeed.models.embedded.materialize import embedded_model_path
from tokenspeed.scheduler.plan import TokenLogprob
from tokenspeed.scheduler.sampling_params import SamplingParams
from tokenspeed.scheduler.updates import RequestUpdate

TEXT = "alpha beta gamma delta epsilon"


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(embedded_model_path())


def stream_text(tokenizer, stop: list[str], *, last_finishes: bool = True):
    """Feed TEXT one token per step; return (deltas, full token ids, finish_stream calls)."""
    calls: list[tuple[str, str, str]] = []
    processor = OutputProcessor(tokenizer, lambda *args: calls.append(args))
    processor.add_request("r", None, tokenizer.encode("x ="), SamplingParams(stop=stop, max_tokens=100))
    ids = tokenizer.encode(TEXT)
    deltas: list[RequestDelta] = []
    for i, token in enumerate(ids):
        last = last_finishes and i == len(ids) - 1
        update = RequestUpdate("r", [token], finished=last, finish_reason="length" if last else None)
        deltas.extend(processor.process_deltas([update]))
        if deltas and deltas[-1].finished:
            break
    return deltas, ids, calls


def joined(deltas: list[RequestDelta], index: int = 0) -> str:
    return "".join(d.text for r in deltas for d in r.deltas if d.index == index)


def test_stable_length_holds_back_the_longest_possible_stop_prefix(tokenizer):
    detok = IncrementalDetokenizer(tokenizer, [], stop=["delta", "a bet", "zz"])
    for text, stable in [
        ("alpha", 4),
        ("alpha b", 4),
        ("alpha be!", 9),
        ("gamma del", 6),
        ("xyz", 2),
        ("none", 4),
        ("", 0),
    ]:
        detok.text = text
        assert detok.stable_length() == stable, text
    assert IncrementalDetokenizer(tokenizer, []).stable_length() == 0


def test_streamed_text_never_runs_ahead_of_a_stop_string(tokenizer):
    deltas, ids, calls = stream_text(tokenizer, ["ta gam"])
    final = TEXT[: TEXT.find("ta gam")]
    sofar = ""
    for delta in deltas:
        sofar += "".join(d.text for d in delta.deltas)
        assert final.startswith(sofar)  # never emitted, then retracted
    assert sofar == final
    last = deltas[-1]
    assert last.finished and last.deltas[0].finish_reason == "stop" and last.deltas[0].stop_reason == "ta gam"
    assert calls == [("r", "stop", "ta gam")]  # the core is told to free the stream
    # Tokens are not held back: one per step, up to the one that completed the stop string.
    assert [t for r in deltas for d in r.deltas for t in d.token_ids] == ids[: len(deltas)]


def test_a_partial_match_is_released_when_the_stream_ends(tokenizer):
    deltas, ids, calls = stream_text(tokenizer, ["epsilon!"])
    assert joined(deltas) == TEXT and calls == []
    before_last = "".join(d.text for r in deltas[:-1] for d in r.deltas)
    assert not before_last.endswith("eps")  # held back while it could still become "epsilon!"
    assert deltas[-1].deltas[0].text.endswith("epsilon") and deltas[-1].deltas[0].finish_reason == "length"
    assert [t for r in deltas for d in r.deltas for t in d.token_ids] == ids


def test_n_streams_logprobs_and_prompt_logprobs(tokenizer):
    processor = OutputProcessor(tokenizer, lambda *args: None)
    prompt = tokenizer.encode("x = 1")
    children = processor.add_request("r", None, prompt, SamplingParams(n=2, logprobs=1, prompt_logprobs=1))
    assert [(c.request_id, c.index, c.params.n) for c in children] == [("r#0", 0, 1), ("r#1", 1, 1)]

    def lp(token: int) -> TokenLogprob:
        return TokenLogprob(token, -0.5, 1, [(token, -0.5)])

    prompt_lps = [lp(t) for t in prompt[1:]]
    a, b = tokenizer.encode(" alpha beta")[:2]
    first = processor.process_deltas(
        [
            RequestUpdate("r#0", [a], [lp(a)], prompt_lps),
            RequestUpdate("r#1", [b], [lp(b)]),
        ]
    )
    (delta,) = first
    assert [d.index for d in delta.deltas] == [0, 1] and not delta.finished
    assert delta.prompt_logprobs is not None and len(delta.prompt_logprobs) == len(prompt)
    assert delta.prompt_logprobs[0] is None and a in delta.deltas[0].logprobs[0]
    (second,) = processor.process_deltas(
        [RequestUpdate("r#1", [a], [lp(a)], finished=True, finish_reason="length")]
    )
    assert second.prompt_logprobs is None  # sent once
    assert [d.index for d in second.deltas] == [1] and second.deltas[0].finish_reason == "length"
    assert len(second.deltas[0].logprobs) == len(second.deltas[0].token_ids) == 1
    assert not second.finished  # stream 0 still runs
    final = processor.abort_delta("r")
    assert final is not None and final.finished
    assert [(d.index, d.finish_reason) for d in final.deltas] == [(0, "abort")]
    assert processor.abort_delta("r") is None and not processor.has_request("r")


def test_abort_releases_held_back_text(tokenizer):
    processor = OutputProcessor(tokenizer, lambda *args: None)
    processor.add_request("r", None, [], SamplingParams(stop=["gamma!"]))
    ids = tokenizer.encode("beta gam")
    streamed = "".join(
        d.text for r in processor.process_deltas([RequestUpdate("r", ids)]) for d in r.deltas
    )
    assert streamed == "beta "
    final = processor.abort_delta("r")
    assert final is not None and final.deltas[0].text == "gam" and final.deltas[0].finish_reason == "abort"


def test_merge_deltas_concatenates_per_stream():
    one = RequestDelta("r", [StreamDelta(0, "a", [1], [{1: None}])], [9], 0, [None], False)  # type: ignore[dict-item]
    two = RequestDelta(
        "r",
        [StreamDelta(1, "x", [5], None), StreamDelta(0, "b", [2], [{2: None}], "stop", "b")],  # type: ignore[dict-item]
        [9],
        16,
        None,
        True,
    )
    merged = merge_deltas(one, two)
    assert [(d.index, d.text, d.token_ids, d.finish_reason) for d in merged.deltas] == [
        (0, "ab", [1, 2], "stop"),
        (1, "x", [5], None),
    ]
    assert merged.deltas[0].logprobs == [{1: None}, {2: None}] and merged.deltas[0].stop_reason == "b"
    assert merged.finished and merged.num_cached_tokens == 16 and merged.prompt_logprobs == [None]


def test_a_multi_token_step_is_cut_at_the_token_that_completes_a_stop_string(tokenizer):
    """Speculative decoding brings several tokens a step: the tokens, logprobs and text kept are those
    of one token a step, and the core is told to finish the stream."""
    ids = tokenizer.encode(TEXT)
    stop = "gamma"
    one_by_one, _, _ = stream_text(tokenizer, [stop], last_finishes=False)
    calls: list[tuple[str, str, str]] = []
    processor = OutputProcessor(tokenizer, lambda *args: calls.append(args))
    processor.add_request("r", None, tokenizer.encode("x ="), SamplingParams(stop=[stop], max_tokens=100, logprobs=0))
    logprobs = [TokenLogprob(t, -0.5, 1, []) for t in ids]
    outputs = processor.process([RequestUpdate("r", ids, new_logprobs=logprobs)])
    (completion,) = outputs[0].outputs
    kept = next(i for i in range(1, len(ids) + 1) if stop in tokenizer.decode(ids[:i]))
    assert completion.token_ids == ids[:kept] and len(completion.logprobs) == kept
    assert completion.text == joined(one_by_one) == TEXT[: TEXT.index(stop)]
    assert completion.finish_reason == "stop" and calls == [("r", "stop", stop)]
