"""The decode's last split merging the splits (`attention/decode_triton.py`) on a CUDA GPU: bit for bit
the separate merge kernel's output (`TOKENSPEED_DECODE_LAST_SPLIT_MERGES=0`) at Llama-3.1-8B's attention
shape, bf16 and fp8 caches, replayed from a CUDA graph with new lengths; and the engine's greedy tokens
identical with it on and off."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA device", allow_module_level=True)

from tests.gpu_parity import free_cuda  # noqa: E402
from tests.paged_kernels import capture_cuda_graph, shuffled_page_table  # noqa: E402
from tokenspeed import LLM, SamplingParams  # noqa: E402
from tokenspeed.kernels import arrival_counters  # noqa: E402
from tokenspeed.kernels.attention.decode_triton import decode_attention_triton  # noqa: E402
from tokenspeed.kernels.attention.paged_reference import decode_attention_reference  # noqa: E402
from tokenspeed.kernels.quant.fp8 import FP8_DTYPE  # noqa: E402
from tokenspeed.models.embedded.materialize import embedded_model_path  # noqa: E402

SWITCH = "TOKENSPEED_DECODE_LAST_SPLIT_MERGES"
HEADS, KV_HEADS, DIM, PAGE = 32, 8, 128, 16


@pytest.mark.parametrize("cache", ["bf16", "fp8"])
def test_graph_replays_equal_the_merge_kernel_bit_for_bit(cache: str, monkeypatch: pytest.MonkeyPatch) -> None:
    gen = torch.Generator().manual_seed(1)
    rows, max_len = 8, 32768
    table, num_pages = shuffled_page_table([max_len] * rows, PAGE, gen, spare_pages=4)
    k_cache = torch.randn(num_pages, PAGE, KV_HEADS, DIM, generator=gen).to(torch.bfloat16).cuda()
    v_cache = torch.randn(num_pages, PAGE, KV_HEADS, DIM, generator=gen).to(torch.bfloat16).cuda()
    scales: dict[str, torch.Tensor] = {}
    if cache == "fp8":
        scales = {"k_scale": torch.full((KV_HEADS,), 0.05, device="cuda"),
                  "v_scale": torch.full((KV_HEADS,), 0.05, device="cuda")}  # fmt: skip
        k_cache, v_cache = (k_cache / 0.05).to(FP8_DTYPE), (v_cache / 0.05).to(FP8_DTYPE)
    table = table.cuda()
    q = torch.zeros(rows, HEADS, DIM, dtype=torch.bfloat16, device="cuda")
    seq_lens = torch.zeros(rows, dtype=torch.int32, device="cuda")

    def step() -> torch.Tensor:
        return decode_attention_triton(q, k_cache, v_cache, table, seq_lens, scale=DIM**-0.5, num_splits=64, **scales)

    graphs = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(SWITCH, switch)
        graphs[switch] = capture_cuda_graph(step)
    for lengths in ([1, 17, 1000, 4096, 8191, 32768, 0, 20000], [32768] * 4 + [0, 1, 129, 2]):
        seq_lens.copy_(torch.tensor(lengths, dtype=torch.int32))
        q.copy_(torch.randn(rows, HEADS, DIM, generator=gen).to(torch.bfloat16))
        outs = {}
        for switch, (graph, out) in graphs.items():
            graph.replay()
            outs[switch] = out.clone()
        assert torch.equal(outs["1"], outs["0"])
        assert arrival_counters.all_at_rest()
        if cache == "bf16":
            expected = decode_attention_reference(q, k_cache, v_cache, table, seq_lens, scale=DIM**-0.5)
            torch.testing.assert_close(outs["1"].float(), expected.float(), rtol=2e-2, atol=1.5e-2)
        assert bool((outs["1"][lengths.index(0)] == 0).all())


def test_engine_tokens_identical_with_the_merge_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    prompts = [{"prompt_token_ids": [(7 * i + 3 * j) % 900 + 5 for j in range(300 + 97 * i)]} for i in range(4)]
    params = SamplingParams(temperature=0.0, max_tokens=64, ignore_eos=True)
    tokens = {}
    for switch in ("1", "0"):
        monkeypatch.setenv(SWITCH, switch)
        llm = LLM(str(embedded_model_path()), dtype="bfloat16", device="cuda", skip_tokenizer_init=True,
                  show_progress=False, max_model_len=2048, max_num_seqs=8)  # fmt: skip
        tokens[switch] = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        llm.shutdown()
        del llm
        free_cuda()
    assert tokens["1"] == tokens["0"]
