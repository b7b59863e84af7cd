"""Verification through the Triton sampler (the GPU's `sampling.sample`), and on a CUDA device.

On the CPU the Triton kernel runs under the interpreter (small vocabulary); on
a GPU (`make test-gpu`) the same checks run compiled at Llama-3's vocabulary,
plus: rejection sampling on the device draws exactly what it draws on the CPU
(its randomness is integer hashing, so the device changes nothing), which
carries the CPU's statistical test over to the GPU.
"""

from __future__ import annotations

import pytest
import torch

from tests.triton_interpreter import (  # sets TRITON_INTERPRET before triton loads
    INTERPRETING,
    fresh_process_test,
)
from tokenspeed.kernels.sampling.sample_triton import sample_triton
from tokenspeed.spec.verify import filtered_probs, rejection_sample, verify_point_mass

test_interpreter_suite_in_fresh_process = fresh_process_test(__file__)
CUDA = torch.cuda.is_available()
runs_triton = pytest.mark.skipif(not (INTERPRETING or CUDA), reason="needs the Triton interpreter or a GPU")


def _point_mass_equals_plain(device: str, rows: int, k: int, vocab: int) -> None:
    """Drafts half right: the emitted tokens are the sampler's own draws at (seed, index + i), so a plain
    decode of the same positions with the same keys emits the same tokens."""
    gen = torch.Generator().manual_seed(4)
    logits = (torch.randn(rows, k + 1, vocab, generator=gen) * 3).to(device)
    temperature = torch.tensor([0.0, 0.7, 1.0, 1.3] * (rows // 4), device=device)
    top_k = torch.tensor([0, 20, 0, 0] * (rows // 4), dtype=torch.int32, device=device)
    top_p = torch.tensor([1.0, 1.0, 0.9, 0.8] * (rows // 4), device=device)
    min_p = torch.tensor([0.0, 0.0, 0.05, 0.0] * (rows // 4), device=device)
    seeds = torch.arange(rows, dtype=torch.int64, device=device) * 31 + 7
    start = torch.arange(rows, dtype=torch.int64, device=device) % 5
    plain = torch.stack([sample_triton(logits[:, i], temperature, top_k, top_p, min_p, seeds, start + i)
                         for i in range(k + 1)], dim=1)
    coin = torch.rand(rows, k, generator=gen).to(device) < 0.6
    drafts = torch.where(coin, plain[:, :k], (plain[:, :k] + 1) % vocab)
    num_drafts = torch.full((rows,), k, dtype=torch.int64, device=device)
    verified = verify_point_mass(logits, drafts, num_drafts, temperature, top_k, top_p, min_p, seeds, start,
                                 sample=sample_triton)
    for row, emitted in enumerate(verified.rows()):
        assert emitted == plain[row, : len(emitted)].tolist()
        accepted = len(emitted) - 1
        assert accepted == k or int(drafts[row, accepted]) != int(plain[row, accepted])


@runs_triton
def test_point_mass_with_the_triton_sampler_is_plain_decoding() -> None:
    _point_mass_equals_plain("cuda" if CUDA else "cpu", rows=8, k=3, vocab=300)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_point_mass_on_the_gpu_at_llama3_vocabulary() -> None:
    _point_mass_equals_plain("cuda", rows=64, k=4, vocab=128256)


@pytest.mark.gpu
@pytest.mark.skipif(not CUDA, reason="needs a CUDA device")
def test_rejection_sampling_on_the_gpu_draws_what_the_cpu_draws() -> None:
    gen = torch.Generator().manual_seed(5)
    rows, k, vocab = 32, 4, 32000
    params = [torch.full((rows * (k + 1),), v) for v in (0.9, 50.0, 0.95, 0.0)]
    logits = torch.randn(rows, k + 1, vocab, generator=gen) * 4
    target = filtered_probs(logits.reshape(-1, vocab), params[0], params[1].long(), params[2],
                            params[3]).reshape(rows, k + 1, vocab)
    # a draft model that roughly agrees with the target, so some drafts are accepted and some are not
    draft_probs = torch.softmax(logits[:, :k] + torch.randn(rows, k, vocab, generator=gen) * 2, dim=-1)
    drafts = torch.multinomial(draft_probs.reshape(-1, vocab), 1, generator=gen).reshape(rows, k)
    num_drafts = torch.randint(0, k + 1, (rows,), generator=gen)
    seeds, indices = torch.arange(rows) * 977 + 3, torch.randint(0, 1000, (rows,), generator=gen)
    on_cpu = rejection_sample(target, drafts, num_drafts, seeds, indices, draft_probs)
    on_gpu = rejection_sample(*(t.cuda() for t in (target, drafts, num_drafts, seeds, indices, draft_probs)))
    assert on_gpu.rows() == on_cpu.rows()
    assert 0 < int((on_cpu.num_emitted - 1).sum()) < int(num_drafts.sum())  # some accepted, some rejected
