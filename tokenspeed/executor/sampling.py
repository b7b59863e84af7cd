"""Sampling that leaves the sampled ids on the device.

`layers/sampler.py` defines the semantics (keyed randomness, min-p/top-k/top-p,
penalties, raw logprobs). This module runs it without reading anything back,
so a step can end with the ids still on the device: the next step reads them
there (overlap scheduling) and the host fetches them with one non-blocking
copy. Greedy batches are one argmax. Batches with random rows use the
registry's `sampling.sample` kernel on GPUs (one launch for every row, Philox
keyed by seed and sample index, no vocabulary sort), and on the CPU the very
ops of `random_draw` (`random_draw_tensor`: same generator, same draw) minus the `.item()`.

Penalties need each request's token history on the host, which overlap
scheduling leaves one token behind; plans with penalties therefore use the
host `Sampler` on a synchronised step (`needs_host_sampling`).
"""

from __future__ import annotations

import logging

import torch

from tokenspeed.kernels import platform_of, select_kernel
from tokenspeed.layers.sampler import SampleSpec, random_draw_tensor
from tokenspeed.scheduler.plan import ExecutionPlan

logger = logging.getLogger("tokenspeed.executor")
_BATCHED_KERNELS: dict[str, object] = {}


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """Row-wise argmax (first maximum). A long row is reduced in two stages: one block per row
    takes ~27 us on 128K logits, 64 chunks in parallel then one small pass take a few."""
    rows, vocab = logits.shape
    chunks = next((c for c in (64, 32, 16) if vocab % c == 0 and vocab // c >= 1024), 1)
    if chunks == 1 or not logits.is_cuda:
        return torch.argmax(logits, dim=-1)
    values, index = logits.view(rows, chunks, vocab // chunks).max(dim=-1)
    best = torch.argmax(values, dim=-1, keepdim=True)  # first chunk holding the maximum
    return (best.squeeze(1) * (vocab // chunks) + index.gather(1, best).squeeze(1)).to(torch.int64)


def _batched_sampler(device: torch.device) -> object | None:
    """The `sampling.sample` kernel for this platform, unless only the (host-syncing) reference fits."""
    platform = platform_of(device)
    if platform not in _BATCHED_KERNELS:
        spec = None
        if platform != "cpu":
            try:
                spec = select_kernel("sampling", "sample", platform=platform)
            except LookupError:
                spec = None
            if spec is not None and spec.name == "reference":
                spec = None
        _BATCHED_KERNELS[platform] = None if spec is None else spec.impl
    return _BATCHED_KERNELS[platform]


def _upload(values: list[float] | list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def needs_host_sampling(plan: ExecutionPlan) -> bool:
    return any(r.sample and r.sampling.needs_penalties for r in plan.rows)


def needs_host_results(plan: ExecutionPlan) -> bool:
    """Rows whose results are more than token ids (logprobs) or whose sampling reads host history."""
    return needs_host_sampling(plan) or any(
        r.prompt_logprobs_start is not None or (r.sample and r.sampling.logprobs is not None) for r in plan.rows
    )


def _mask_stop_tokens_before_min(logits: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
    rows: list[int] = []
    cols: list[int] = []
    for i, spec in enumerate(specs):
        if spec.sample_index < spec.sampling.min_tokens:
            for token in sorted(spec.sampling.stop_ids()):
                rows.append(i)
                cols.append(token)
    if not rows:
        return logits
    index = torch.tensor([rows, cols], dtype=torch.int64)
    if logits.is_cuda:
        index = index.pin_memory().to(logits.device, non_blocking=True)
    masked = logits.clone()
    masked[index[0], index[1]] = float("-inf")
    return masked


def sample_on_device(logits: torch.Tensor, specs: list[SampleSpec]) -> torch.Tensor:
    """One token id per spec, `[len(specs)]` int64 on the logits' device; no host synchronisation."""
    processed = _mask_stop_tokens_before_min(logits.float(), specs)
    random_rows = [i for i, s in enumerate(specs) if not s.sampling.greedy]
    batched = _batched_sampler(processed.device) if random_rows else None
    if batched is not None:
        d = processed.device
        params = [s.sampling for s in specs]
        try:
            return batched(  # type: ignore[operator, no-any-return]
                processed,
                _upload([p.temperature for p in params], torch.float32, d),
                _upload([p.top_k for p in params], torch.int32, d),
                _upload([p.top_p for p in params], torch.float32, d),
                _upload([p.min_p for p in params], torch.float32, d),
                _upload([s.seed for s in specs], torch.int64, d),
                _upload([s.sample_index for s in specs], torch.int64, d),
            )
        except Exception:  # e.g. a kernel that fails to compile here: sample row by row instead
            logger.warning("batched sampling kernel failed; falling back to per-row sampling", exc_info=True)
            _BATCHED_KERNELS[platform_of(d)] = None
    tokens = greedy_argmax(processed)
    if random_rows:
        tokens = tokens.clone()
        for i in random_rows:
            tokens[i] = random_draw_tensor(processed[i], specs[i])
    return tokens
