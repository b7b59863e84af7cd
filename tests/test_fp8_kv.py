"""FP8 KV cache (`kv_cache_dtype="fp8"`) on the CPU: accuracy, pages, and every path that reads or writes it.

Accuracy (teacher-forced greedy top-1 agreement with the fp32 cache over 256
decode steps, `tests/fp8_agreement.py`; measured 2026-12-03, static unit scales):

- trained tiny models on text prompts: embedded (Qwen3 shape) 0.995,
  embedded-moe (DeepSeek-V3 shape: MLA latent cache) 0.996; asserted >= 0.99
  (in bf16 against the bf16 cache: 0.994 and 0.995 on the CPU; the GPU test
  `test_fp8_gpu.py` asserts >= 0.99 there);
- random tiny checkpoints (`tests/checkpoints.py`: flat logits, near-ties
  everywhere) on random prompts: llama 0.98, qwen3_moe 0.92, deepseek_v3
  0.95 (a bf16 cache scores 0.99-1.0 there); asserted >= 0.9, which a wrong
  scale, layout or dtype misses by far.

The engine runs write, decode, extend (chunked prefill, prefix-cache hits)
and speculative verify over an fp8 pool, and a speculative drafter's own KV
pages (EAGLE, MTP) are fp8 too; page accounting is checked after every test
(`conftest.kv_pages_accounted`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from tokenizers import Tokenizer

from tests.checkpoints import prompts
from tests.fp8_agreement import engine_kv_scales, fp8_kv_agreement
from tests.spec_cases import HOST_METHODS, agent_prompts, make_family, run, token_ids
from tokenspeed import LLM, SamplingParams
from tokenspeed.models.embedded.materialize import embedded_eagle_path, embedded_model_path

STEPS = 256
TEXT = [
    "The engine schedules requests in pages of sixteen tokens, and each step decodes one token for every "
    "running request. ",
    "def fibonacci(n):\n    if n < 2:\n        return n\n    return fibonacci(n - 1) + fibonacci(n - 2)\n",
    "User: What is the capital of France?\nAssistant:",
    "Once upon a time, in a small village by the sea, there lived an old fisherman who",
]
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


@pytest.mark.parametrize(("name", "calculated"), [("embedded", False), ("embedded-moe", False), ("embedded", True)])
def test_trained_models_agree_with_the_fp32_cache(name: str, calculated: bool) -> None:
    """Unit scales, and (`calculated`) the scales `calculate_kv_scales` measures on random tokens: 0.9951 either
    way on the embedded model (embedded-moe: 0.9961 either way, measured once, not repeated here)."""
    folder = embedded_model_path(name)
    tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))
    scales = None
    if calculated:
        llm = LLM(str(folder), skip_tokenizer_init=True, show_progress=False, kv_cache_dtype="fp8",
                  calculate_kv_scales=True)
        scales = engine_kv_scales(llm)
        llm.shutdown()
        assert any(x != 1.0 for k, v in scales for x in (*k, *v))
    agreement = fp8_kv_agreement(folder, [tokenizer.encode(t).ids for t in TEXT], STEPS, kv_scales=scales)
    assert agreement >= 0.99, f"{name}: top-1 agreement {agreement:.4f}"


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("fp8_kv")
    return {family: make_family(family, root / family) for family in ("llama", "qwen3_moe", "deepseek_v3")}


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3"])
def test_random_tiny_models_mostly_agree(family: str, tiny: dict[str, Path]) -> None:
    agreement = fp8_kv_agreement(tiny[family], prompts(4, seed=9, min_len=8, max_len=32), STEPS)
    assert agreement >= 0.9, f"{family}: top-1 agreement {agreement:.4f}"


def _llm(folder: Path | str, **engine: Any) -> LLM:
    return LLM(str(folder), skip_tokenizer_init=True, show_progress=False, **engine)


@pytest.mark.parametrize("family", ["llama", "deepseek_v3"])
def test_pool_holds_more_pages_for_the_same_bytes(family: str, tiny: dict[str, Path]) -> None:
    budget = 1 << 20
    plain = _llm(tiny[family], kv_cache_memory_bytes=budget, max_model_len=256)
    fp8 = _llm(tiny[family], kv_cache_memory_bytes=budget, max_model_len=256, kv_cache_dtype="fp8_e4m3")
    executor = fp8.core.executor  # type: ignore[attr-defined]
    assert all(k.dtype == torch.float8_e4m3fn for k in executor.kv.k + executor.kv.v)
    # fp32 model on the CPU: 4 bytes a value against 1 (bf16 on a GPU: 2 against 1)
    pages, plain_pages = executor.limits.num_pages, plain.core.executor.limits.num_pages  # type: ignore[attr-defined]
    assert 4 * plain_pages <= pages < 4 * (plain_pages + 1)  # budget // bytes per page, each rounded down


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3"])
def test_engine_generates_over_fp8_pages_with_prefix_hits_and_chunks(family: str, tiny: dict[str, Path]) -> None:
    batch = agent_prompts(4)
    llm = _llm(tiny[family], kv_cache_dtype="fp8", page_size=4, max_num_batched_tokens=24)
    first = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY)
    second = llm.generate([{"prompt_token_ids": p} for p in batch], GREEDY)
    assert sum(o.num_cached_tokens for o in second) > 0
    assert token_ids(first) == token_ids(second)  # cached fp8 pages read back as they were written


def _spec_cases(tiny: dict[str, Path]) -> dict[str, tuple[str, dict[str, Any], list[list[int]]]]:
    text = [[t % 4000 + 10 for t in p] for p in agent_prompts(3)]
    return {
        "ngram_llama": (str(tiny["llama"]), HOST_METHODS["ngram"], agent_prompts(3)),
        "suffix_deepseek": (str(tiny["deepseek_v3"]), HOST_METHODS["suffix"], agent_prompts(3)),
        "eagle": ("embedded", {"method": "eagle", "model": str(embedded_eagle_path()), "num_speculative_tokens": 3},
                  text),
        "mtp": ("embedded-moe", {"method": "mtp", "num_speculative_tokens": 2}, text),
    }


@pytest.mark.parametrize("padded", [False, True], ids=["eager_layout", "graph_layout"])
@pytest.mark.parametrize("name", ["ngram_llama", "suffix_deepseek", "eagle", "mtp"])
def test_speculative_verify_over_fp8_pages_equals_plain_decoding(name: str, padded: bool,
                                                                 tiny: dict[str, Path]) -> None:
    model, spec, batch = _spec_cases(tiny)[name]
    engine = dict(kv_cache_dtype="fp8", page_size=4, max_num_batched_tokens=24)
    base, _ = run(model, None, batch, GREEDY, **engine)
    got, llm = run(model, spec, batch, GREEDY, verify_query_len=spec["num_speculative_tokens"] + 1 if padded else 1,
                   **engine)
    assert token_ids(got) == token_ids(base)
    stats = llm.core.speculation_stats
    assert stats is not None and stats.num_accepted_tokens > 0
    drafter = llm.core.executor.speculator  # type: ignore[attr-defined]
    if name in ("eagle", "mtp"):  # their own attention layer keeps its K/V in the drafter's fp8 pages
        assert drafter.drafter.kv.k[0].dtype == torch.float8_e4m3fn


def test_fp8_pages_round_trip_through_the_host_and_disk_tiers(tiny: dict[str, Path], tmp_path: Path) -> None:
    """A tight pool spills fp8 pages to the host and the disk (bytes as they are) and reads them back:
    the tokens are those of an unpressured fp8 run."""
    shared = prompts(1, seed=21, min_len=48, max_len=48)[0]
    batch = [shared + p for p in prompts(4, seed=4, min_len=10, max_len=40)]
    params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True)
    plain = _llm(tiny["llama"], kv_cache_dtype="fp8", page_size=16, max_model_len=128)
    expected = token_ids(plain.generate([{"prompt_token_ids": p} for p in batch], params))
    llm = _llm(tiny["llama"], kv_cache_dtype="fp8", page_size=16, max_model_len=128, num_kv_pages=10,
               host_kv_cache_bytes=8 * 16 * 2 * 2 * 32 * 2, kv_cache_dir=str(tmp_path))
    layout = llm.core.limits.kv_layout
    assert layout is not None and layout.dtype == "float8_e4m3fn"
    assert layout.bytes_per_page == 2 * 16 * 2 * 32  # layers x tokens x kv heads x (K + V dims), one byte each
    llm.generate([{"prompt_token_ids": p} for p in batch], params)
    for other in prompts(3, seed=9, min_len=100, max_len=100):  # flush the device pool
        llm.generate([{"prompt_token_ids": other}], params)
    assert token_ids(llm.generate([{"prompt_token_ids": p} for p in batch], params)) == expected
    counters = llm.core.scheduler.kv.counters
    assert counters.pages_spilled > 0 and counters.host_hit_pages + counters.disk_hit_pages > 0
