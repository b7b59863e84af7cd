"""The training loop's parts: batches, schedule, time budget, and the eager fallback of a failing compiled step."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from tokenspeed.models.embedded.training.loop import (
    PROBE_STEPS,
    WARM_STEPS,
    JsonLog,
    PhaseSpec,
    WindowBatches,
    run_phase,
)


def test_window_batches_cover_each_window_once_per_epoch_and_follow_the_seed():
    stream = torch.arange(1000, dtype=torch.int32)
    batches = WindowBatches(stream, length=10, batch=7, seed=1)
    first_epoch = []
    while batches.epoch <= 0:
        batch = next(batches)
        if batches.epoch == 0:
            first_epoch.append(batch)
    starts = torch.cat(first_epoch)[:, 0]
    assert len(set(starts.tolist())) == len(starts)  # no window twice
    assert bool(((starts - starts[0]) % 10 == 0).all())  # one offset per epoch
    assert all(bool((b[:, 1:] - b[:, :-1] == 1).all()) for b in first_epoch)  # contiguous slices
    again = WindowBatches(stream, length=10, batch=7, seed=1)
    other = WindowBatches(stream, length=10, batch=7, seed=2)
    assert torch.equal(next(again), first_epoch[0]) and not torch.equal(next(other), first_epoch[0])


def test_schedule_warms_up_then_decays_to_the_floor():
    spec = PhaseSpec("x", peak_lr=1.0, warmup_steps=10, batch_size=1, seq_len=1, steps=100, min_lr_fraction=0.1)
    assert spec.learning_rate(0, 100) == pytest.approx(0.1)  # 1/10 of warmup, no decay yet
    assert spec.learning_rate(9, 100) < spec.learning_rate(10, 100) * 1.01
    assert spec.learning_rate(100, 100) == pytest.approx(0.1)
    lrs = [spec.learning_rate(s, 100) for s in range(10, 101)]
    assert all(a >= b for a, b in zip(lrs, lrs[1:]))
    with pytest.raises(ValueError):
        PhaseSpec("x", peak_lr=1.0, warmup_steps=5, batch_size=1, seq_len=1, seconds=1.0)  # probe inside warmup


def _tiny_problem():
    torch.manual_seed(0)
    model = torch.nn.Linear(8, 8)
    data = iter(lambda: torch.randn(4, 8), None)

    def step(batch):
        return F.mse_loss(model(batch), batch.flip(-1)), {"norm": model.weight.norm().detach()}

    return model, data, step


def test_time_budget_sizes_the_phase_and_keeps_the_deadline(tmp_path):
    model, data, step = _tiny_problem()
    spec = PhaseSpec("t", peak_lr=1e-2, warmup_steps=WARM_STEPS + PROBE_STEPS, batch_size=4, seq_len=1,
                     seconds=1.5, log_every=50)
    log = JsonLog(tmp_path / "t.jsonl", echo=None)
    result = run_phase(spec, list(model.parameters()), step, data, log, device=torch.device("cpu"), tokens_per_batch=4)
    log.close()
    records = [json.loads(line) for line in (tmp_path / "t.jsonl").read_text().splitlines()]
    sized = [r for r in records if r.get("event") == "sized"]
    assert len(sized) == 1 and sized[0]["steps"] >= result["steps"] - 1
    assert result["steps"] > WARM_STEPS + PROBE_STEPS and result["seconds"] < 1.5 * 1.05 + 0.5
    assert records[-1].get("step") == result["steps"]


def test_a_failing_compiled_step_falls_back_to_eager(tmp_path):
    model, data, step = _tiny_problem()

    def broken(batch):
        raise RuntimeError("inductor could not compile this")

    spec = PhaseSpec("f", peak_lr=1e-2, warmup_steps=2, batch_size=4, seq_len=1, steps=5, log_every=1)
    log = JsonLog(tmp_path / "f.jsonl", echo=None)
    result = run_phase(spec, list(model.parameters()), broken, data, log, device=torch.device("cpu"),
                       tokens_per_batch=4, eager_step_fn=step)
    log.close()
    text = (tmp_path / "f.jsonl").read_text()
    assert result["steps"] == 5 and "compile_failed" in text and "inductor could not compile" in text
    with pytest.raises(RuntimeError):
        run_phase(spec, list(model.parameters()), broken, data, JsonLog(tmp_path / "g.jsonl", echo=None),
                  device=torch.device("cpu"), tokens_per_batch=4)
