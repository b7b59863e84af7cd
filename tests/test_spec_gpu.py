"""Speculative decoding on the GPU: compiled verify kernels, verify CUDA graphs, every drafter.

* `attention.verify` (Triton, compiled) against its reference at the
  serving dtypes and Llama-3.1-8B-like head layouts, q_len 1..9.
* Through the engine, fp32 (so that only the speculation can change a
  token): greedy and seeded-sampling outputs with each drafter equal those
  without speculation, with verify graphs on (and captured) and off.
* bf16: verify graphs on and off give identical tokens (same kernels, same
  shapes: the GPU lays every verify step out as its graphs do); the first
  position where speculation on and off part (near-ties in bf16 GEMMs of
  different shapes) is reported, never hidden.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch

from tests.checkpoints import make_checkpoint, make_deepseek_checkpoint
from tests.gpu_parity import first_divergence, free_cuda, report
from tests.paged_kernels import shuffled_page_table
from tests.spec_cases import agent_prompts
from tokenspeed import LLM, SamplingParams
from tokenspeed.models.embedded.materialize import embedded_eagle_path

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

GREEDY = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize(("heads", "kv_heads", "dim"), [(32, 8, 128), (16, 2, 64), (8, 8, 128)])
@pytest.mark.parametrize("q_len", [1, 2, 4, 5, 9])
def test_verify_kernel_compiled_matches_reference(dtype: torch.dtype, heads: int, kv_heads: int, dim: int,
                                                  q_len: int) -> None:
    from tokenspeed.kernels.attention.decode_triton import verify_attention_triton
    from tokenspeed.kernels.attention.paged_reference import verify_attention_reference

    gen = torch.Generator().manual_seed(q_len * 7 + heads)
    lengths = [700, 0, q_len, 3000, 129]
    table, pages = shuffled_page_table(lengths, 16, gen, spare_pages=2)
    k_cache = torch.randn(pages, 16, kv_heads, dim, generator=gen).to(dtype).cuda()
    v_cache = torch.randn(pages, 16, kv_heads, dim, generator=gen).to(dtype).cuda()
    q = torch.randn(len(lengths) * q_len, heads, dim, generator=gen).to(dtype).cuda()
    args = (q, k_cache, v_cache, table.cuda(), torch.tensor(lengths, dtype=torch.int32).cuda())
    for window in (None, 100):
        got = verify_attention_triton(*args, q_len=q_len, scale=dim**-0.5, sliding_window=window)
        want = verify_attention_reference(*args, q_len=q_len, scale=dim**-0.5, sliding_window=window)
        torch.testing.assert_close(got.float(), want.float(), rtol=2e-2, atol=2e-2)


@pytest.fixture(scope="module")
def folders(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("spec_gpu")
    return {
        "llama": make_checkpoint("llama", root / "llama", num_attention_heads=8, num_key_value_heads=2),
        "deepseek": make_deepseek_checkpoint("deepseek_v3", root / "deepseek"),
    }


def _run(model: str, spec: dict[str, Any] | None, prompts: list[list[int]], params: Any, **engine: Any
         ) -> tuple[list[list[int]], LLM]:
    args: dict[str, Any] = dict(skip_tokenizer_init=True, device="cuda", dtype="float32", max_model_len=512,
                                max_num_seqs=16, num_kv_pages=512, show_progress=False, page_size=16)
    args.update(engine)
    llm = LLM(model, speculative_config=spec, **args)
    outputs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return [o.outputs[0].token_ids for o in outputs], llm


def _verify_graphs(llm: LLM) -> int:
    graphs = llm.core.executor.runner.graphs  # type: ignore[attr-defined]
    return 0 if graphs is None else sum(1 for key in graphs._graphs if key[1] > 1)


def _cases(folders: dict[str, Path]) -> dict[str, tuple[str, dict[str, Any], list[list[int]]]]:
    embedded = [[t % 4000 + 10 for t in p] for p in agent_prompts(4)]
    return {
        "suffix-llama": (str(folders["llama"]), {"method": "suffix", "num_speculative_tokens": 6}, agent_prompts(4)),
        "suffix-mla": (str(folders["deepseek"]), {"method": "suffix", "num_speculative_tokens": 4}, agent_prompts(4)),
        "ngram-llama": (str(folders["llama"]), {"method": "ngram", "num_speculative_tokens": 3,
                                                "prompt_lookup_min": 2}, agent_prompts(4)),
        "draft_model-self": (str(folders["llama"]), {"method": "draft_model", "model": str(folders["llama"]),
                                                     "num_speculative_tokens": 3}, agent_prompts(4)),
        "eagle": ("embedded", {"method": "eagle", "model": str(embedded_eagle_path()), "num_speculative_tokens": 3},
                  embedded),
        "mtp": ("embedded-moe", {"method": "mtp", "num_speculative_tokens": 2}, embedded),
    }


@pytest.mark.parametrize("name", ["suffix-llama", "suffix-mla", "ngram-llama", "draft_model-self", "eagle", "mtp"])
def test_fp32_outputs_equal_without_speculation_graphs_on_and_off(folders: dict[str, Path], name: str) -> None:
    model, spec, prompts = _cases(folders)[name]
    params = [GREEDY, GREEDY, SamplingParams(temperature=0.0, max_tokens=40, min_tokens=30, ignore_eos=False),
              SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=40, ignore_eos=True)]
    if spec["method"] in ("eagle", "mtp", "draft_model"):
        params[3] = GREEDY  # a device drafter's sampled drafts are verified by rejection: same law, other tokens
    base, _ = _run(model, None, prompts, params)
    graphs, llm = _run(model, spec, prompts, params)
    eager, _ = _run(model, spec, prompts, params, enforce_eager=True)
    stats = llm.core.speculation_stats
    report({"test": "spec_fp32_identical", "case": name, "verify_graphs": _verify_graphs(llm),
            "stats": None if stats is None else stats.as_dict()})
    assert graphs == base and eager == base
    assert _verify_graphs(llm) > 0
    assert stats is not None and stats.num_drafts > 0
    if name == "draft_model-self":
        assert stats.num_accepted_tokens == stats.num_draft_tokens
    del llm
    free_cuda()


@pytest.mark.parametrize("name", ["suffix-llama", "suffix-mla", "eagle"])
def test_bf16_graphs_on_off_identical_and_divergence_from_off_reported(folders: dict[str, Path], name: str) -> None:
    model, spec, prompts = _cases(folders)[name]
    base, _ = _run(model, None, prompts, GREEDY, dtype="bfloat16")
    graphs, llm = _run(model, spec, prompts, GREEDY, dtype="bfloat16")
    eager, eager_llm = _run(model, spec, prompts, GREEDY, dtype="bfloat16", enforce_eager=True)
    # the same steps planned (eager steps priced as the graphs would run them), or bf16 rounding may differ
    shape = llm.core.executor.verify_shape
    assert shape is not None and eager_llm.core.executor.verify_shape == shape
    assert graphs == eager
    for prompt, a, b in zip(prompts, base, graphs):
        report({"test": "spec_bf16_vs_off", "case": name, "prompt_len": len(prompt),
                "first_divergence": first_divergence(b, a)})
    del llm, eager_llm
    free_cuda()


def test_mla_verify_takes_the_folded_decode_kernel(folders: dict[str, Path]) -> None:
    """Verify rows of an MLA model run the Triton `mla.decode` at q_len = k+1, folded per `choose_fold`
    (a spy registered above the Triton kernel records each call's q_len and fold, then calls it)."""
    from tokenspeed.kernels import Band, register_kernel, unregister_kernel
    from tokenspeed.kernels.mla.decode_plan import choose_fold
    from tokenspeed.kernels.mla.decode_triton import mla_decode_triton

    seen: list[tuple[int, int]] = []

    def spy(q: torch.Tensor, *args: Any, **kwargs: Any) -> torch.Tensor:
        seen.append((kwargs["q_len"], choose_fold(q.shape[1], kwargs["q_len"])))
        return mla_decode_triton(q, *args, **kwargs)

    register_kernel("mla", "decode", name="spy", band=Band.PLUGIN, platforms=("cuda",))(spy)
    try:
        model, config, prompts = _cases(folders)["suffix-mla"]
        _run(model, {**config, "adaptive_draft_length": False}, prompts, GREEDY, enforce_eager=True)
    finally:
        unregister_kernel("mla", "decode", "spy")
    verify_calls = {call for call in seen if call[0] > 1}
    report({"test": "mla_verify_kernel", "calls": sorted(verify_calls)})
    assert (5, choose_fold(4, 5)) in verify_calls  # the tiny DeepSeek has 4 heads: all 5 tokens fold


@pytest.mark.parametrize("name", ["eagle", "mtp"])
def test_drafter_graphs_replay_and_give_the_tokens_of_eager_drafting(folders: dict[str, Path], name: str,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """fp32: EAGLE/MTP drafting replayed from the drafter's CUDA graphs (`spec/draft_graphs.py`) gives the
    tokens of speculation off and of `draft_cuda_graphs: false`; the graphs are captured and replayed."""
    from tokenspeed.spec.draft_graphs import DraftGraphs

    model, spec, prompts = _cases(folders)[name]
    replays = {"propose": 0, "observe": 0}
    propose, observe = DraftGraphs.propose, DraftGraphs.observe

    def counted_propose(self: DraftGraphs, *args: Any) -> Any:
        out = propose(self, *args)
        replays["propose"] += out is not None
        return out

    def counted_observe(self: DraftGraphs, *args: Any) -> Any:
        out = observe(self, *args)
        replays["observe"] += out is not None
        return out

    monkeypatch.setattr(DraftGraphs, "propose", counted_propose)
    monkeypatch.setattr(DraftGraphs, "observe", counted_observe)
    base, _ = _run(model, None, prompts, GREEDY)
    graphs, llm = _run(model, spec, prompts, GREEDY)
    drafter = llm.core.executor.speculator.drafter  # type: ignore[attr-defined]
    captured = 0 if drafter.graphs is None else len(drafter.graphs._propose) + len(drafter.graphs._observe)
    eager, _ = _run(model, {**spec, "draft_cuda_graphs": False}, prompts, GREEDY)
    report({"test": "spec_drafter_graphs", "case": name, "captured": captured, **replays})
    assert graphs == base and eager == base
    assert captured > 0 and replays["propose"] > 0 and replays["observe"] > 0
    del llm
    free_cuda()
