"""`sampling.bitmask` on a CUDA GPU at serving shapes (`make test-gpu`): Triton == reference on
Llama-3 and Qwen vocabularies, inside a CUDA graph too, and a grammar-constrained greedy batch."""

from __future__ import annotations

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device"),
]

from tests.test_kernels_bitmask import random_case  # noqa: E402
from tokenspeed.kernels.sampling.bitmask_reference import apply_bitmask_reference  # noqa: E402
from tokenspeed.kernels.sampling.bitmask_triton import apply_bitmask_triton  # noqa: E402


@pytest.mark.parametrize("rows, vocab", [(1, 128256), (64, 151936), (256, 128256)])
def test_triton_matches_reference(rows, vocab):
    masked = list(range(0, rows, 2))
    logits, bitmask, indices = (t.cuda() for t in random_case(rows, vocab, masked, seed=rows))
    expected, got = logits.clone(), logits.clone()
    apply_bitmask_reference(expected, bitmask, indices)
    apply_bitmask_triton(got, bitmask, indices)
    assert torch.equal(expected, got)


def test_replays_in_a_cuda_graph():
    logits, bitmask, indices = (t.cuda() for t in random_case(8, 151936, [1, 5, 6], seed=3))
    static = logits.clone()
    apply_bitmask_triton(static.clone(), bitmask, indices)  # compile outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        apply_bitmask_triton(static, bitmask, indices)
    for seed in range(3):
        fresh, new_mask, _ = (t.cuda() for t in random_case(8, 151936, [1, 5, 6], seed=10 + seed))
        static.copy_(fresh)
        bitmask.copy_(new_mask)
        graph.replay()
        expected = fresh.clone()
        apply_bitmask_reference(expected, new_mask, indices)
        assert torch.equal(static, expected)


def test_constrained_generation_on_the_gpu():
    """The embedded model on the GPU (bf16, CUDA graphs, Triton masks): every output schema-valid, and
    overlap on and off give the same tokens."""
    import json

    import jsonschema

    from tests.test_structured_output_engine import PROMPTS, SCHEMA
    from tokenspeed import LLM, SamplingParams

    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=120, structured_outputs={"json": SCHEMA})
              for i in range(32)]
    prompts = [PROMPTS[i % len(PROMPTS)] for i in range(32)]
    outs = LLM(show_progress=False, num_kv_pages=1024).generate(prompts, params, use_tqdm=False)
    for out in outs:
        jsonschema.validate(json.loads(out.outputs[0].text), SCHEMA)
    sync = LLM(show_progress=False, num_kv_pages=1024, disable_overlap=True).generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in sync] == [o.outputs[0].token_ids for o in outs]
