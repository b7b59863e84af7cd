"""`calculate_kv_scales` (vLLM's option): an fp8 KV cache's per-layer scales measured at start-up.

Why: with unit scales an e4m3 cache holds K/V values up to +-448. Most
models stay far inside that, but a model whose keys or values pass it (a
large k/v bias, outlier channels) loses them: tests/test_fp8_kv_scales.py
has one whose greedy tokens agree with the fp32 cache at 0.32. Calibrated
scales in the checkpoint fix that (`layers/kv_scales.py`); without them this
measures them, as vLLM does, on random tokens: one prefill of up to
`CALIBRATION_TOKENS` seeded random ids goes through the model runner before
any request, every attention layer records each KV head's largest |K| and
|V| as it stores them, and each head's scale becomes the power of two that
brings its peak under half of e4m3's range (`kv_scales.CALIBRATED_PEAK`).
Per head, where vLLM takes one scale for all: a head with outliers then does
not push the others' small values into e4m3's subnormals (the same test: 0.98
against 0.66). On several ranks each measures its own heads (a head two
ranks share, the same values on both). Measured scales replace the
checkpoint's; a speculative drafter's layers keep theirs.

The prompt's pages are released right after: the scheduler never saw it, so
nothing of it is in the prefix cache, and whatever it wrote is overwritten
before any request reads those pages.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

import torch

from tokenspeed.executor.model_runner import ModelRunner
from tokenspeed.layers.kv_scales import KVScales
from tokenspeed.scheduler.plan import ExecutionPlan, ScheduledRow
from tokenspeed.scheduler.sampling_params import SamplingParams

logger = logging.getLogger("tokenspeed.executor")

CALIBRATION_TOKENS = 512
_REQUEST_ID = "kv-scale-calibration"


def calibrate_kv_scales(runner: ModelRunner, *, vocab_size: int, max_tokens: int, seed: int) -> None:
    """Measure and set the scales of every `KVScales` in `runner.model` (module docstring) on one prompt of
    at most `max_tokens` (what the pool and max_model_len allow)."""
    layers = [m for m in runner.model.modules() if isinstance(m, KVScales)]
    length = min(CALIBRATION_TOKENS, max_tokens)
    page_size = runner.kv.page_size
    tokens = torch.randint(vocab_size, (length,), generator=torch.Generator().manual_seed(seed)).tolist()
    row = ScheduledRow(request_id=_REQUEST_ID, input_token_ids=tokens, start_position=0, first_new_page=0,
                       new_page_ids=list(range(-(-length // page_size))), sampling=SamplingParams(temperature=0.0),
                       sample=True, seed=seed, sample_index=0)
    for layer in layers:
        layer.start_calibration()
    try:
        runner.launch(ExecutionPlan(step_id=-2, rows=[row])).result()
    finally:
        peaks = [layer.finish_calibration() for layer in layers]
    runner.launch(ExecutionPlan(step_id=-1, released_request_ids=[_REQUEST_ID]))  # the pages go back
    for layer, layer_peaks in zip(layers, peaks, strict=True):
        layer.set_calibrated(layer_peaks)
    logger.info("calculated KV cache scales on %d random tokens: k %s, v %s", length,
                _span(x for layer in layers for x in layer.k_scale.tolist()),
                _span(x for layer in layers for x in layer.v_scale.tolist()))


def _span(values: Iterable[float]) -> str:
    ordered = sorted(values) or [1.0]
    return f"{ordered[0]:g}" if ordered[0] == ordered[-1] else f"{ordered[0]:g}-{ordered[-1]:g}"
