"""The drafter chain that CUDA graphs capture (`spec/draft_graphs.py`) drafts what the eager chain drafts.

A captured chain computes every step's positions, K/V slots and sequence
lengths on the device from static buffers, padded to its row bucket with
rows of draft length 0 on the scratch page, and never reads host lists
(they are `GraphGuardList`s). Here, on the CPU, that same computation runs
beside the eager one at every propose of an EAGLE and an MTP drafter inside
the engine: same drafts, and the engine's tokens still equal speculation
off. The graphs themselves (capture, replay, on/off) are `test_spec_gpu.py`'s.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests.spec_cases import agent_prompts
from tokenspeed import LLM, SamplingParams
from tokenspeed.models.embedded.materialize import embedded_eagle_path
from tokenspeed.spec.draft_chain import DraftChain
from tokenspeed.spec.feature_drafter import FeatureDrafter

GREEDY = SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True)


def _padded_device_chain(drafter: FeatureDrafter, batch: Any, rows: Any, bucket: int) -> torch.Tensor:
    """The rows' drafts as a captured chain computes them: `bucket` rows, host lists refused."""
    count, steps = len(rows.num_draft_tokens), max(rows.num_draft_tokens)
    table = batch.attn.page_table.index_select(0, rows.batch_rows)
    padded_table = torch.full((bucket, table.shape[1] + 3), drafter.scratch_page, dtype=table.dtype)
    padded_table[:count, : table.shape[1]] = table
    start = torch.tensor(rows.start_positions + [0] * (bucket - count))
    lengths = torch.tensor(rows.num_draft_tokens + [0] * (bucket - count))
    features = torch.zeros(bucket, drafter.states.values.shape[1], dtype=drafter.dtype)
    features[:count] = drafter.states.read(rows.slots)
    chain = DraftChain(padded_table, start, lengths, page_size=batch.attn.page_size,
                       scratch_page=drafter.scratch_page, host=None, max_seq_len=4096)
    return drafter.draft(chain, features, None, steps).token_ids[:count]


@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_device_computed_chain_drafts_what_the_eager_chain_drafts(method: str,
                                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    if method == "eagle":
        model, spec = "embedded", {"method": "eagle", "model": str(embedded_eagle_path()), "num_speculative_tokens": 3}
    else:
        model, spec = "embedded-moe", {"method": "mtp", "num_speculative_tokens": 2}
    prompts = [[t % 4000 + 10 for t in p] for p in agent_prompts(2, seed=3)]
    compared: list[int] = []
    eager_propose = FeatureDrafter.propose

    def checked(self: FeatureDrafter, batch: Any, rows: Any) -> Any:
        proposed = eager_propose(self, batch, rows)
        if all(spec.sampling.greedy for spec in rows.specs):
            # the drafter's K/V at draft positions is rewritten before anything reads it: running twice is safe
            again = _padded_device_chain(self, batch, rows, bucket=len(rows.num_draft_tokens) + 2)
            for i, k in enumerate(rows.num_draft_tokens):
                assert torch.equal(again[i, :k], proposed.token_ids[i, :k]), (i, again[i], proposed.token_ids[i])
            compared.append(len(rows.num_draft_tokens))
        return proposed

    monkeypatch.setattr(FeatureDrafter, "propose", checked)
    base = LLM(model, show_progress=False, skip_tokenizer_init=True)
    want = [o.outputs[0].token_ids for o in base.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    del base
    llm = LLM(model, speculative_config=spec, show_progress=False, skip_tokenizer_init=True)
    got = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    assert got == want
    assert compared and max(compared) == 2  # both requests drafted in one step at least once


class _Rerun:
    """Stands in for a captured CUDA graph on the CPU: `replay` re-runs the recorded computation on the same
    static buffers and writes its outputs where the capture left them, as a graph replay does."""

    def __init__(self, run: Any, out: Any) -> None:
        self.run, self.out = run, out
        self.replays = 0

    def replay(self) -> None:
        self.replays += 1
        fresh = self.run()
        for old, new in zip(self.out if isinstance(self.out, tuple) else (self.out,),
                            fresh if isinstance(fresh, tuple) else (fresh,), strict=True):
            old.copy_(new)

    def reset(self) -> None:
        pass


def _record(run: Any) -> tuple[_Rerun, Any]:
    out = run()
    return _Rerun(run, out), out


@pytest.mark.parametrize("method", ["eagle", "mtp"])
def test_graph_mode_plumbing_gives_the_tokens_of_speculation_off(method: str) -> None:
    """The whole graph path on the CPU, graphs replaced by re-runs on their static buffers: the target's
    verify and decode graphs (`DecodeGraphs`, the runner's padded layout) and the drafter's propose and
    observe graphs (`DraftGraphs`: the row buckets, padding rows, static copies, the target key handed to
    `observe`). Greedy tokens equal speculation off, and every kind of graph was replayed."""
    from tokenspeed.executor.cuda_graphs import DecodeGraphs, _Graph
    from tokenspeed.spec.draft_graphs import DraftGraphs

    k = 3 if method == "eagle" else 2
    if method == "eagle":
        model, spec = "embedded", {"method": "eagle", "model": str(embedded_eagle_path()), "num_speculative_tokens": k}
    else:
        model, spec = "embedded-moe", {"method": "mtp", "num_speculative_tokens": k}
    prompts = [[t % 4000 + 10 for t in p] for p in agent_prompts(3, seed=5)]
    args: dict[str, Any] = dict(show_progress=False, skip_tokenizer_init=True, max_model_len=512, max_num_seqs=4,
                                enable_prefix_caching=False)  # both runs below compute every position
    base = LLM(model, **args)
    want = [o.outputs[0].token_ids for o in base.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
    del base

    llm = LLM(model, speculative_config=spec, **args)
    executor = llm.core.executor  # type: ignore[attr-defined]
    runner = executor.runner
    target = DecodeGraphs(executor.model, executor.kv, max_bs=4, max_pages_per_seq=512 // executor.config.page_size,
                          max_model_len=512, scratch_page=runner.scratch_page, verify_query_len=k + 1)
    with torch.inference_mode():
        for bs, q_len in [(b, q) for b in target.sizes for q in (1, k + 1)]:
            graph, (hidden, logits) = _record(lambda b=bs, q=q_len: target._forward(b, q, None))
            target._graphs[(bs, q_len, None)] = _Graph(graph, hidden, logits, None)  # type: ignore[arg-type]
        drafter = executor.speculator.drafter
        drafts = DraftGraphs(drafter, target, k)
        drafts.record_all(_record)
    runner.graphs, runner.verify_query_len = target, k + 1
    stats = llm.core.speculation_stats
    assert stats is not None

    def generate() -> tuple[list[list[int]], tuple[int, int, int]]:
        before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
        out = [o.outputs[0].token_ids for o in llm.generate([{"prompt_token_ids": p} for p in prompts], GREEDY)]
        return out, (stats.num_drafts - before[0], stats.num_draft_tokens - before[1],
                     stats.num_accepted_tokens - before[2])

    eager_tokens, eager_stats = generate()  # the drafter eager, the target's "graphs" on
    drafter.graphs = drafts
    got, graph_stats = generate()
    assert got == want and eager_tokens == want
    assert graph_stats == eager_stats  # the replayed drafter drafted exactly what the eager one did
    replays = {kind: sum(g.replays for g, _ in table.values())
               for kind, table in (("propose", drafts._propose), ("observe", drafts._observe))}
    verify = sum(e.graph.replays for key, e in target._graphs.items() if key[1] > 1)  # type: ignore[attr-defined]
    assert replays["propose"] > 0 and replays["observe"] > 0 and verify > 0, (replays, verify)
