"""One training phase: window batches, AdamW, warmup + cosine schedule, a time budget, a JSON-lines log.

The schedule needs the number of steps, and on a GPU the command is given
seconds, not steps. A phase with a time budget therefore runs a few steps
(the first ones compile), times the next few, and fixes the total then:
`steps = done + remaining seconds / seconds per step`. From that point the
run is what `--steps` with that number would give, which is logged so a run
can be repeated step for step. With fixed steps (the CPU smoke run) the whole
phase is deterministic for a seed. A phase that still runs past its deadline
(a slower machine than the probe saw) stops there and says so in the log.

The learning rate is `peak * warmup(step) * decay(step)`: linear warmup over
`warmup_steps`, then cosine decay to `min_lr_fraction` of the peak over the
total (the decay factor is 1 until the total is known, inside the warmup).
"""

from __future__ import annotations

import json
import math
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import torch
from torch import nn

WARM_STEPS = 3  # compile and allocator warm-up, not timed
PROBE_STEPS = 10  # timed to size the phase


@dataclass(slots=True)
class PhaseSpec:
    name: str
    peak_lr: float
    warmup_steps: int
    batch_size: int
    seq_len: int
    steps: int | None = None  # fixed steps (deterministic); None: as many as `seconds` allow
    seconds: float | None = None
    min_lr_fraction: float = 0.1
    weight_decay: float = 0.1
    grad_clip: float = 1.0
    log_every: int = 10
    eval_every: int = 250

    def __post_init__(self) -> None:
        if (self.steps is None) == (self.seconds is None):
            raise ValueError(f"phase {self.name}: give exactly one of steps and seconds")
        if self.steps is None and self.warmup_steps < WARM_STEPS + PROBE_STEPS:
            raise ValueError(f"phase {self.name}: warmup must cover the {WARM_STEPS + PROBE_STEPS} probe steps")

    def learning_rate(self, step: int, total: int | None) -> float:
        warm = min(1.0, (step + 1) / self.warmup_steps)
        if total is None:
            return self.peak_lr * warm
        progress = min(1.0, step / max(1, total))
        decay = self.min_lr_fraction + (1 - self.min_lr_fraction) * 0.5 * (1 + math.cos(math.pi * progress))
        return self.peak_lr * warm * decay


class JsonLog:
    """Appends one JSON object per line to a file and echoes a short form to stdout."""

    def __init__(self, path: Path, echo: IO[str] | None = sys.stdout) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = path.open("w")
        self.echo = echo

    def write(self, record: dict[str, Any]) -> None:
        self.file.write(json.dumps(record) + "\n")
        self.file.flush()
        if self.echo is not None:
            shown = {k: (round(v, 4) if isinstance(v, float) else v) for k, v in record.items()}
            print(json.dumps(shown), file=self.echo, flush=True)

    def close(self) -> None:
        self.file.close()


class WindowBatches:
    """`[batch, length]` windows of a token stream, each epoch from a random offset in a random order.

    Windows within an epoch do not overlap, so every token is seen once per
    epoch; the offset moves the window boundaries between epochs. Seeded, and
    drawn on the host, so the order does not depend on the device.
    """

    def __init__(self, stream: torch.Tensor, length: int, batch: int, seed: int) -> None:
        if stream.numel() < (batch + 1) * length:
            raise ValueError(f"{stream.numel()} tokens cannot fill a batch of {batch} x {length}")
        self.stream, self.length, self.batch = stream, length, batch
        self.generator = torch.Generator().manual_seed(seed)
        self.offsets = torch.arange(length, device=stream.device)
        self.epoch = -1
        self._starts = torch.zeros(0, dtype=torch.int64)
        self._next = 0

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        if self._next + self.batch > self._starts.numel():
            self.epoch += 1
            offset = int(torch.randint(self.length, (1,), generator=self.generator))
            count = (self.stream.numel() - offset) // self.length
            self._starts = offset + torch.randperm(count, generator=self.generator) * self.length
            self._next = 0
        starts = self._starts[self._next : self._next + self.batch].to(self.stream.device)
        self._next += self.batch
        return self.stream[starts[:, None] + self.offsets].long()


def make_optimizer(params: list[nn.Parameter], spec: PhaseSpec, device: torch.device) -> torch.optim.AdamW:
    """AdamW (fused on CUDA); matrices decay, norms and biases do not."""
    decay = [p for p in params if p.requires_grad and p.dim() >= 2]
    no_decay = [p for p in params if p.requires_grad and p.dim() < 2]
    groups = [{"params": decay, "weight_decay": spec.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=spec.peak_lr, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")


StepFn = Callable[[torch.Tensor], tuple[torch.Tensor, dict[str, torch.Tensor]]]


def run_phase(
    spec: PhaseSpec,
    params: list[nn.Parameter],
    step_fn: StepFn,
    batches: Iterator[torch.Tensor],
    log: JsonLog,
    *,
    device: torch.device,
    tokens_per_batch: int,
    eval_fn: Callable[[], dict[str, float]] | None = None,
    after_step: Callable[[dict[str, torch.Tensor]], None] | None = None,
    eager_step_fn: StepFn | None = None,
) -> dict[str, Any]:
    """Train until the step count or the deadline; returns what the record keeps about the phase.

    `eager_step_fn`: the uncompiled step, taken over (and logged) when the
    compiled one fails on its first step, so a compiler problem on the
    training machine costs throughput, not the run.
    """
    optimizer = make_optimizer(params, spec, device)
    trainable = [p for p in params if p.requires_grad]
    start = time.perf_counter()
    deadline = None if spec.seconds is None else start + spec.seconds
    total, step, stopped_early = spec.steps, 0, False
    probe_start = first_step_seconds = 0.0
    loss_sum = torch.zeros((), device=device)
    interval_start, interval_steps = time.perf_counter(), 0

    def synced_now() -> float:
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        return time.perf_counter()

    while total is None or step < total:
        lr = spec.learning_rate(step, total)
        for group in optimizer.param_groups:
            group["lr"] = lr
        batch = next(batches)
        try:
            loss, metrics = step_fn(batch)
            loss.backward()
        except Exception as error:
            if step > 0 or eager_step_fn is None:
                raise
            log.write({"phase": spec.name, "event": "compile_failed", "error": repr(error)[:500]})
            optimizer.zero_grad(set_to_none=True)
            step_fn, eager_step_fn = eager_step_fn, None
            loss, metrics = step_fn(batch)
            loss.backward()
        torch.nn.utils.clip_grad_norm_(trainable, spec.grad_clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
        if after_step is not None:
            after_step(metrics)
        loss_sum += loss.detach()
        step += 1
        interval_steps += 1
        if step == 1:
            first_step_seconds = synced_now() - start
        if total is None and deadline is not None:
            if step == WARM_STEPS:
                probe_start = synced_now()
            elif step == WARM_STEPS + PROBE_STEPS:
                now = synced_now()
                per_step = (now - probe_start) / PROBE_STEPS
                total = step + max(0, int((deadline - now) / per_step))
                log.write({"phase": spec.name, "event": "sized", "steps": total, "seconds_per_step": per_step,
                           "tokens_per_s": tokens_per_batch / per_step})
        if step % spec.log_every == 0 or step == total:
            now = synced_now()
            log.write({
                "phase": spec.name, "step": step, "steps": total, "lr": lr,
                "loss": float(loss_sum) / interval_steps, "tokens": step * tokens_per_batch,
                "elapsed_s": now - start, "tokens_per_s": interval_steps * tokens_per_batch / (now - interval_start),
                **{k: float(v) for k, v in metrics.items() if v.dim() == 0},
            })
            loss_sum.zero_()
            interval_start, interval_steps = now, 0
        if eval_fn is not None and (step % spec.eval_every == 0 or step == total):
            log.write({"phase": spec.name, "step": step, "event": "eval", **eval_fn()})
        if deadline is not None and time.perf_counter() > deadline + 0.05 * (spec.seconds or 0):
            stopped_early = True
            log.write({"phase": spec.name, "event": "deadline", "step": step, "planned_steps": total})
            break
    seconds = synced_now() - start
    return {
        "steps": step,
        "tokens": step * tokens_per_batch,
        "seconds": round(seconds, 2),
        "first_step_seconds": round(first_step_seconds, 2),
        "tokens_per_s": round(step * tokens_per_batch / max(seconds - first_step_seconds, 1e-9), 1),
        "stopped_early": stopped_early,
        "batch_size": spec.batch_size,
        "seq_len": spec.seq_len,
        "peak_lr": spec.peak_lr,
    }
