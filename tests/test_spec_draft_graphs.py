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
