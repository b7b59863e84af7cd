"""Device drafters (EAGLE, MTP, draft model) through the whole engine.

* Greedy outputs equal those without speculation, for every drafter, with
  prefix-cache hits, chunked prefill, preemption and n > 1.
* The drafters draft what they should: a draft model that *is* the target
  has every greedy draft accepted (its K/V catch-up, chain positions and
  pages line up), and the features an EAGLE head or an MTP layer drafts from
  equal an independent computation (the training networks of
  `models/embedded/training/`, full sequences, no paging) at every chain step.
* Temperature > 0: rejection sampling keeps the target's distribution (a
  chi-square test on the first tokens of thousands of seeded requests of a
  tiny-vocabulary model against its exact distribution from transformers),
  and a deliberately wrong verifier fails the same test.
"""

from __future__ import annotations

import itertools
import math
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoints import load_hf, make_checkpoint
from tests.spec_cases import agent_prompts, run, token_ids
from tokenspeed import LLM, SamplingParams
from tokenspeed.models.embedded.materialize import embedded_eagle_path, embedded_model_path
from tokenspeed.spec.feature_drafter import FeatureDrafter
from tokenspeed.spec.speculator import SpeculativeDecoder

GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec_device")
    return {
        "llama": make_checkpoint("llama", root / "llama"),
        "llama_draft": make_checkpoint("llama", root / "llama_draft", seed=1, num_hidden_layers=1),
    }


def embedded_prompts(count: int, seed: int = 0) -> list[list[int]]:
    return [[t % 4000 + 10 for t in p] for p in agent_prompts(count, seed)]


def drafter_cases(folders: dict[str, Path]) -> dict[str, tuple[str, dict[str, Any], list[list[int]]]]:
    return {
        "draft_model": (str(folders["llama"]), {"method": "draft_model", "model": str(folders["llama_draft"]),
                                                "num_speculative_tokens": 3}, agent_prompts(4)),
        "draft_model_is_target": (str(folders["llama"]), {"method": "draft_model", "model": str(folders["llama"]),
                                                          "num_speculative_tokens": 3}, agent_prompts(4)),
        "eagle": ("embedded", {"method": "eagle", "model": str(embedded_eagle_path()), "num_speculative_tokens": 3},
                  embedded_prompts(4)),
        "mtp": ("embedded-moe", {"method": "mtp", "num_speculative_tokens": 2}, embedded_prompts(4)),
    }


@pytest.mark.parametrize("padded", [False, True], ids=["eager_layout", "graph_layout"])
@pytest.mark.parametrize("name", ["draft_model", "draft_model_is_target", "eagle", "mtp"])
def test_greedy_outputs_equal_with_prefix_hits_chunking_and_n(folders: dict[str, Path], name: str,
                                                              padded: bool) -> None:
    """Also with verify steps laid out as a GPU lays them out for its CUDA graphs (k+1 tokens every row,
    filler first), which moves the drafters' input tokens inside the rows."""
    model, spec, prompts = drafter_cases(folders)[name]
    prompts = prompts + prompts[:2]  # the repeats hit the prefix cache
    params = [GREEDY] * 4 + [SamplingParams(n=2, temperature=0.0, max_tokens=24, ignore_eos=True)] * 2
    engine = dict(max_num_batched_tokens=24, page_size=4)
    base, _ = run(model, None, prompts, params, **engine)
    got, llm = run(model, spec, prompts, params, verify_query_len=spec["num_speculative_tokens"] + 1 if padded else 1,
                   **engine)
    assert token_ids(got) == token_ids(base)
    stats = llm.core.speculation_stats
    assert stats is not None and stats.num_drafts > 0
    if name == "draft_model_is_target":
        assert stats.num_accepted_tokens == stats.num_draft_tokens


def test_preemption(folders: dict[str, Path]) -> None:
    prompts = agent_prompts(6, seed=3, shared=8)
    engine = dict(page_size=4, num_kv_pages=48, max_model_len=128)
    spec = {"method": "draft_model", "model": str(folders["llama"]), "num_speculative_tokens": 3}
    base, _ = run(folders["llama"], None, prompts, GREEDY, **engine)
    got, llm = run(folders["llama"], spec, prompts, GREEDY, **engine)
    assert token_ids(got) == token_ids(base)
    stats = llm.core.speculation_stats
    assert llm.core.scheduler.num_preemptions > 0
    assert stats is not None and stats.num_accepted_tokens == stats.num_draft_tokens > 0


# ---- the features drafted from, against the training networks ------------------------------------------


def _record_features(llm: LLM) -> list[tuple[int, list[torch.Tensor]]]:
    """Per proposal (of a one-row step): the row's start position and the features drafted from, in order."""
    speculation = llm.core.executor.runner.speculation  # type: ignore[attr-defined]
    assert isinstance(speculation, SpeculativeDecoder) and isinstance(speculation.drafter, FeatureDrafter)
    drafter = speculation.drafter
    features: list[torch.Tensor] = []
    calls: list[tuple[int, list[torch.Tensor]]] = []
    logits, propose = drafter.logits, drafter.propose

    def recording_logits(f: torch.Tensor) -> torch.Tensor:
        features.append(f[0].clone())
        return logits(f)

    def recording_propose(batch: Any, rows: Any) -> Any:
        first = len(features)
        proposed = propose(batch, rows)
        calls.append((rows.start_positions[0], features[first:]))
        return proposed

    drafter.logits = recording_logits  # type: ignore[method-assign]
    drafter.propose = recording_propose  # type: ignore[method-assign]
    return calls


def _reference_features(net_step: Any, target_features: torch.Tensor, sequence: list[int], start: int,
                        drafts: list[int]) -> list[torch.Tensor]:
    """The drafting features of a row at `start` from full-sequence computations: pairs (f_q, t_{q+1}) for
    q < start, then the chain's own (feature, draft) pairs."""
    features = target_features[:start]
    tokens = list(sequence[1 : start + 1])
    out = []
    for draft in [None, *drafts]:
        if draft is not None:
            features = torch.cat([features, out[-1][None]])
            tokens.append(draft)
        out.append(net_step(features, torch.tensor(tokens))[-1])
    return out


@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_drafted_features_equal_the_training_networks(method: str) -> None:
    from tokenspeed.models.embedded.materialize import package_config
    from tokenspeed.models.embedded.training.nets import build_net
    from tokenspeed.spec.eagle import read_tensors

    k = 3
    if method == "eagle":
        model, spec = "embedded", {"method": "eagle", "model": str(embedded_eagle_path()), "num_speculative_tokens": k,
                                   "adaptive_draft_length": False}
    else:
        model, spec = "embedded-moe", {"method": "mtp", "num_speculative_tokens": k, "adaptive_draft_length": False}
    prompt = embedded_prompts(1, seed=9)[0]
    llm = LLM(model, speculative_config=spec, show_progress=False, skip_tokenizer_init=True)
    calls = _record_features(llm)
    output = llm.generate([{"prompt_token_ids": prompt}], GREEDY)[0].outputs[0].token_ids
    sequence = prompt + output

    net = build_net(package_config(model)).eval()
    net.load_hf_state_dict({n: t.float() for n, t in read_tensors(embedded_model_path(model)).items()})
    with torch.no_grad():
        target = net(torch.tensor([sequence]))[0]
        if method == "eagle":
            head = build_net(package_config(model, draft=True), draft=True).eval()
            head.load_hf_state_dict({n: t.float() for n, t in read_tensors(embedded_eagle_path()).items()})

            def net_step(f: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
                return head(net.embed(t[None]), f[None])[0]
        else:

            def net_step(f: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
                return net.mtp(f[None], t[None])[0][0]

        assert len(calls) > 3 and max(len(f) for _, f in calls) == k
        compute_logits = llm.core.executor.model.compute_logits  # type: ignore[attr-defined]
        for start, features in calls:
            drafted = [int(torch.argmax(compute_logits(f[None]))) for f in features[:-1]]
            expected = _reference_features(net_step, target, sequence, start, drafted)
            for i, (got, want) in enumerate(zip(features, expected, strict=True)):
                assert torch.allclose(got, want, atol=2e-4, rtol=1e-3), (start, i, float((got - want).abs().max()))


# ---- temperature > 0: the target's distribution ------------------------------------------------------------

TINY_VOCAB = 4
LENGTH = 4  # the first token is sampled at prefill, the others by verify rows of up to 2 drafts
REQUESTS = 3000
PROMPT = [1, 3, 0, 2, 3]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec_tiny")
    common = dict(vocab_size=TINY_VOCAB, bos_token_id=0, eos_token_id=0, pad_token_id=0, tie_word_embeddings=False,
                  initializer_range=0.25)
    return {
        "target": make_checkpoint("llama", root / "target", seed=3, **common),
        "draft": make_checkpoint("llama", root / "draft", seed=4, num_hidden_layers=1, **common),
    }


def _exact_joint(folder: Path, temperature: float) -> dict[tuple[int, ...], float]:
    hf = load_hf(folder)
    joint: dict[tuple[int, ...], float] = {}
    with torch.no_grad():
        for tokens in itertools.product(range(TINY_VOCAB), repeat=LENGTH):
            ids = torch.tensor([PROMPT + list(tokens)])
            probs = torch.softmax(hf(ids).logits[0].double() / temperature, dim=-1)
            p = 1.0
            for i, token in enumerate(tokens):
                p *= float(probs[len(PROMPT) - 1 + i, token])
            joint[tokens] = p
    return joint


def _chi_square(samples: list[tuple[int, ...]], joint: dict[tuple[int, ...], float]) -> tuple[float, float]:
    """(statistic, the 1e-6 critical value); cells expecting fewer than 5 samples are pooled into one."""
    observed = {cell: 0 for cell in joint}
    for sample in samples:
        observed[sample] += 1
    n = len(samples)
    big = [c for c, p in joint.items() if p * n >= 5]
    cells = [(observed[c], joint[c] * n) for c in big]
    cells.append((n - sum(o for o, _ in cells), n - sum(e for _, e in cells)))
    statistic = sum((o - e) ** 2 / e for o, e in cells if e > 0)
    df = len(cells) - 1
    z = 4.753  # one-sided normal quantile of 1e-6 (Wilson-Hilferty approximation of the chi-square quantile)
    return statistic, df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


def _sample(tiny: dict[str, Path], temperature: float) -> tuple[list[tuple[int, ...]], Any]:
    spec = {"method": "draft_model", "model": str(tiny["draft"]), "num_speculative_tokens": 2,
            "adaptive_draft_length": False}
    params = [SamplingParams(temperature=temperature, seed=1000 + i, max_tokens=LENGTH, ignore_eos=True)
              for i in range(REQUESTS)]
    outputs, llm = run(tiny["target"], spec, [PROMPT] * REQUESTS, params, max_num_seqs=512)
    return [tuple(o.outputs[0].token_ids) for o in outputs], llm.core.speculation_stats


def test_rejection_sampling_keeps_the_target_distribution(tiny: dict[str, Path]) -> None:
    samples, stats = _sample(tiny, 1.0)
    assert stats.num_drafts > 0 and 0 < stats.accepted_per_position[1] < stats.accepted_per_position[0]
    statistic, critical = _chi_square(samples, _exact_joint(tiny["target"], 1.0))
    assert statistic < critical


def test_a_verifier_that_accepts_every_draft_fails_the_same_test(tiny: dict[str, Path],
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    from tokenspeed.executor.speculator import VerifyOutcome

    def accept_all(logits: torch.Tensor, batch: Any, rows: list[int], width: int, sampler: Any) -> VerifyOutcome:
        drafts = batch.draft_token_ids.index_select(0, torch.tensor(rows))
        counts = torch.tensor([batch.num_draft_tokens[j] for j in rows])
        bonus = torch.zeros(len(rows), 1, dtype=torch.int64)
        return VerifyOutcome(torch.cat([drafts, bonus], dim=1), counts + 1)

    monkeypatch.setattr(SpeculativeDecoder, "_rejection", staticmethod(accept_all))
    samples, _ = _sample(tiny, 1.0)
    statistic, critical = _chi_square(samples, _exact_joint(tiny["target"], 1.0))
    assert statistic > 3 * critical


def test_a_public_eagle_checkpoint_drafts_as_our_format_does(tmp_path: Path) -> None:
    """The public EAGLE-1/2 layout (`pytorch_model.bin` with its copy of the embedding and the unused
    input norm of layer 0, no `eagle` section in config.json) loads and drafts exactly as ours."""
    import json

    from tokenspeed.spec.eagle import read_tensors

    ours = embedded_eagle_path()
    tensors = read_tensors(ours)
    hidden = tensors["fc.bias"].shape[0]
    tensors["embed_tokens.weight"] = read_tensors(embedded_model_path())["model.embed_tokens.weight"]
    tensors["layers.0.input_layernorm.weight"] = torch.ones(hidden)
    folder = tmp_path / "eagle-public"
    folder.mkdir()
    config = json.loads((ours / "config.json").read_text())
    del config["eagle"]
    (folder / "config.json").write_text(json.dumps(config))
    torch.save(tensors, folder / "pytorch_model.bin")
    prompts = embedded_prompts(2, seed=4)
    runs = []
    for head in (ours, folder):
        spec = {"method": "eagle", "model": str(head), "num_speculative_tokens": 3, "adaptive_draft_length": False}
        outputs, llm = run("embedded", spec, prompts, GREEDY)
        runs.append((token_ids(outputs), llm.core.speculation_stats.as_dict()))  # type: ignore[union-attr]
    assert runs[0] == runs[1]
    with pytest.raises(Exception, match="unexpected tensor"):
        tensors["layers.0.extra.weight"] = torch.ones(2)
        torch.save(tensors, folder / "pytorch_model.bin")
        run("embedded", {"method": "eagle", "model": str(folder), "num_speculative_tokens": 3}, prompts, GREEDY)


def test_a_drafter_with_its_own_kv_turns_the_default_host_tier_off(monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the host tier is on by default; it does not carry an EAGLE head's or MTP layer's own KV, so
    the default gives way (the engine starts, tier off) while an explicit `host_kv_cache_bytes` is refused."""
    import tokenspeed.executor.executor as executor_module
    from tokenspeed.errors import InvalidRequest

    monkeypatch.setattr(executor_module, "default_host_kv_cache_bytes", lambda device: 64 * 1024 * 1024)
    spec = {"method": "eagle", "model": str(embedded_eagle_path()), "num_speculative_tokens": 3}
    engine = dict(skip_tokenizer_init=True, max_model_len=256, show_progress=False)
    llm = LLM("embedded", speculative_config=spec, **engine)  # type: ignore[arg-type]
    assert llm.core.executor.tiers is None  # type: ignore[attr-defined]
    assert len(llm.generate([{"prompt_token_ids": embedded_prompts(1)[0]}], GREEDY)[0].outputs[0].token_ids) == 24
    llm.shutdown()
    assert LLM("embedded", **engine).core.executor.tiers is not None  # type: ignore[arg-type, attr-defined]
    with pytest.raises(InvalidRequest, match="drafter's own KV"):
        LLM("embedded", speculative_config=spec, host_kv_cache_bytes=64 * 1024 * 1024, **engine)  # type: ignore[arg-type]
