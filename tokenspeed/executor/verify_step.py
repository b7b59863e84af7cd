"""The runner's side of a step's verify rows: their `VerifyBatch` in, their emitted tokens out.

`verify_batch` gathers what the `Speculator` decides on: per verify row its
drafts (host drafts from the plan, or the device drafter's) and, per verified
position i, a `SampleSpec` that sees what plain decoding would have seen
there: sample index `sample_index + i` (the random key, the min-tokens mask)
and, for penalties, the history plus the drafts before it (`d1 .. di`).
Penalties are host work, so a row with penalties and device drafts reads its
drafts back (one synchronisation, only for such rows).

Plain greedy rows (greedy, no penalties, logprobs, logit bias or grammar, and
`min_tokens` already out) see nothing per position: their tokens are the
argmaxes of the raw logits. When every verify row of a step is one and the
speculator's `fast_greedy_verify` is on (`speculative_config`, default true),
the batch is marked `greedy`: its positions share their row's spec (no
per-position history copies), `process_verified` skips the sampler's
processing and the speculator verifies with a few batched tensor ops.

`VerifiedTokens` holds the outcome: on the device at once (the next step may
read a row's last emitted token there, as for plain draws), on the host after
one non-blocking copy, with one raw logprob per emitted token where the
request asked for logprobs.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence

import torch

from tokenspeed.executor.logits_processors import DeviceGrammarMasks
from tokenspeed.executor.sampler import Sampler, SampleSpec, token_logprobs
from tokenspeed.executor.speculator import ProposedDrafts, VerifyBatch, VerifyOutcome
from tokenspeed.executor.step_layout import StepLayout
from tokenspeed.scheduler.plan import ExecutionPlan, ScheduledRow, TokenLogprob


def _position_specs(row: ScheduledRow, drafts: Sequence[int]) -> list[SampleSpec]:
    """One spec per verified position of `row` (k drafts: k + 1 positions)."""
    specs = []
    for i in range(row.num_draft_tokens + 1):
        output = row.output_token_ids
        if output is not None and i:
            output = [*output, *drafts[:i]]
        specs.append(SampleSpec(row.sampling, row.seed, row.sample_index + i, row.prompt_token_ids, output))
    return specs


def plain_greedy(row: ScheduledRow) -> bool:
    """Whether every verified position of `row` is drawn as the argmax of its raw logits (module docstring)."""
    p = row.sampling
    return (p.greedy and not p.needs_penalties and p.logprobs is None and not p.logit_bias
            and not p.needs_grammar and row.sample_index >= p.min_tokens)


def process_verified(sampler: Sampler, logits: torch.Tensor, batch: VerifyBatch,
                     masks: DeviceGrammarMasks | None) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The sampler's processing of the verified positions' logits (`Sampler.process`): none for a greedy batch."""
    if batch.greedy and masks is None:
        return logits, None
    return sampler.process(logits, batch.position_specs, masks)


def verify_batch(
    plan: ExecutionPlan, layout: StepLayout, proposed: ProposedDrafts | None, device: torch.device,
    *, fast_greedy: bool = False,
) -> VerifyBatch:
    """`fast_greedy`: mark the batch `greedy` when every row is `plain_greedy` (the speculator's switch)."""
    rows = [plan.rows[i] for i in layout.verify_rows]
    counts = [r.num_draft_tokens for r in rows]
    width = max(counts)
    host = [list(r.draft_token_ids) + [0] * (width - len(r.draft_token_ids)) for r in rows]
    drafts = torch.tensor(host, dtype=torch.int64)
    drafts = drafts.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else drafts
    probs = None
    if proposed is not None:
        index = torch.tensor(layout.device_drafted, dtype=torch.int64)
        index = index.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else index
        short = width - proposed.token_ids.shape[1]  # > 0 only if host-drafted rows drafted more
        device_drafts = torch.nn.functional.pad(proposed.token_ids, (0, short))[:, :width]
        drafts = drafts.index_copy(0, index, device_drafts)
        if proposed.probs is not None:
            vocab = proposed.probs.shape[-1]
            probs = torch.zeros(len(rows), width, vocab, dtype=proposed.probs.dtype, device=device)
            probs.index_copy_(0, index, torch.nn.functional.pad(proposed.probs, (0, 0, 0, short))[:, :width])
        penalised = [j for j in layout.device_drafted if rows[j].sampling.needs_penalties]
        if penalised:  # penalties read the history on the host: these rows' drafts come back
            fetched = device_drafts.index_select(0, torch.tensor(
                [layout.device_drafted.index(j) for j in penalised], dtype=torch.int64, device=device
            )).tolist()
            for j, values in zip(penalised, fetched):
                host[j] = values
    greedy = fast_greedy and all(plain_greedy(row) for row in rows)
    if greedy:
        specs = [spec for row in rows for spec in [SampleSpec.of_row(row)] * (row.num_draft_tokens + 1)]
    else:
        specs = [spec for row, values in zip(rows, host) for spec in _position_specs(row, values)]
    offsets = list(itertools.accumulate((k + 1 for k in counts[:-1]), initial=0))
    return VerifyBatch(layout.verify_rows, counts, offsets, drafts, probs, specs, greedy)


class VerifiedTokens:
    """A step's verify outcome: `last` (device, the last emitted token of each row) at once, the rest
    on the host once fetched."""

    def __init__(self, batch: VerifyBatch, outcome: VerifyOutcome, raw_logprobs: torch.Tensor | None) -> None:
        self.batch = batch
        self.outcome = outcome
        self.raw_logprobs = raw_logprobs  # [verified positions, vocab] when some row wants logprobs
        self.last = outcome.token_ids.gather(1, (outcome.num_emitted - 1)[:, None]).squeeze(1)
        packed = torch.cat([outcome.num_emitted[:, None], outcome.token_ids], dim=1)
        self._event: torch.cuda.Event | None = None
        self._host = packed
        if packed.is_cuda:
            self._host = torch.empty(packed.shape, dtype=torch.int64, pin_memory=True)
            self._host.copy_(packed, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        self._rows: list[list[int]] | None = None

    def rows(self) -> list[list[int]]:
        """Emitted tokens per verify row, on the host (waits for the copy)."""
        if self._rows is None:
            if self._event is not None:
                self._event.synchronize()
            self._rows = [row[1 : 1 + row[0]] for row in self._host.tolist()]
        return self._rows

    def logprobs(self) -> list[list[TokenLogprob] | None]:
        """Per verify row, the raw logprob of each emitted token at its position (None: not asked)."""
        out: list[list[TokenLogprob] | None] = []
        first = 0
        for k, tokens in zip(self.batch.num_draft_tokens, self.rows()):
            spec = self.batch.position_specs[first]
            if self.raw_logprobs is None or spec.sampling.logprobs is None:
                out.append(None)
            else:
                scored = self.raw_logprobs[first : first + len(tokens)]
                out.append([token_logprobs(scored[i : i + 1], [t], spec.sampling.logprobs)[0]
                            for i, t in enumerate(tokens)])
            first += k + 1
        return out
