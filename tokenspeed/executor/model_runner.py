"""Runs one `ExecutionPlan` on the device: batch layout, forward, logits, sampling.

The runner never consults the scheduler: everything it needs is in the plan.
Logits are computed only where they are used (each sampling row's last token,
and the prompt positions whose logprobs were asked for), which on long
prefills saves a `[tokens, vocab]` matmul.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenspeed.executor.forward_batch import RowSpec, build_forward_batch
from tokenspeed.executor.kv_storage import PagedKVStorage
from tokenspeed.layers.sampler import Sampler, SampleSpec, token_logprobs
from tokenspeed.scheduler.plan import ExecutionPlan, ExecutionResult, RowOutput, ScheduledRow


@dataclass(slots=True)
class _PromptLogprobSlice:
    """Logits rows [first, first + count) score prompt positions start.. of one plan row."""

    row: int
    first: int
    count: int
    start_position: int


def _prompt_logprob_positions(row: ScheduledRow) -> range:
    """Prompt positions of this chunk whose next-token logprob is wanted."""
    if row.prompt_logprobs_start is None:
        return range(0)
    last_scored = len(row.prompt_token_ids) - 1  # the last prompt token has no prompt successor
    return range(max(row.start_position, row.prompt_logprobs_start), min(row.end_position, last_scored))


class ModelRunner:
    def __init__(self, model: torch.nn.Module, kv: PagedKVStorage, device: torch.device) -> None:
        self.model = model
        self.kv = kv
        self.device = device
        self.sampler = Sampler()

    @torch.inference_mode()
    def run(self, plan: ExecutionPlan) -> ExecutionResult:
        self.kv.copy_pages(plan.page_copies)
        result = ExecutionResult(step_id=plan.step_id, rows=[RowOutput(r.request_id) for r in plan.rows])
        if not plan.rows:
            return result

        logits_indices: list[int] = []
        prompt_slices: list[_PromptLogprobSlice] = []
        sample_slots: list[tuple[int, int]] = []  # (plan row, logits row)
        flat_start = 0
        for i, row in enumerate(plan.rows):
            positions = _prompt_logprob_positions(row)
            if positions:
                prompt_slices.append(_PromptLogprobSlice(i, len(logits_indices), len(positions), positions.start))
                logits_indices.extend(flat_start + p - row.start_position for p in positions)
            if row.sample:
                sample_slots.append((i, len(logits_indices)))
                logits_indices.append(flat_start + len(row.input_token_ids) - 1)
            flat_start += len(row.input_token_ids)

        batch = build_forward_batch(
            [RowSpec(r.input_token_ids, r.start_position, r.page_ids) for r in plan.rows],
            page_size=self.kv.page_size,
            logits_indices=logits_indices,
            device=self.device,
        )
        hidden = self.model(batch, self.kv)
        logits = self.model.compute_logits(hidden.index_select(0, batch.logits_indices))

        for piece in prompt_slices:
            row = plan.rows[piece.row]
            assert row.prompt_logprobs_start is not None and row.sampling.prompt_logprobs is not None
            scored = torch.log_softmax(logits[piece.first : piece.first + piece.count].float(), dim=-1)
            p0 = piece.start_position
            targets = row.prompt_token_ids[p0 + 1 : p0 + 1 + piece.count]
            result.rows[piece.row].prompt_logprobs = token_logprobs(
                scored, targets, row.sampling.prompt_logprobs
            )

        self._sample(plan, logits, sample_slots, result)
        return result

    def _sample(
        self,
        plan: ExecutionPlan,
        logits: torch.Tensor,
        sample_slots: list[tuple[int, int]],
        result: ExecutionResult,
    ) -> None:
        """One draw per seed: an `n > 1` row repeats its logits row once per fork."""
        if not sample_slots:
            return
        gather: list[int] = []
        specs: list[SampleSpec] = []
        owners: list[int] = []
        for plan_row, logits_row in sample_slots:
            row = plan.rows[plan_row]
            for seed in row.seeds:
                gather.append(logits_row)
                owners.append(plan_row)
                specs.append(
                    SampleSpec(row.sampling, seed, row.sample_index, row.prompt_token_ids, row.output_token_ids)
                )
        index = torch.tensor(gather, dtype=torch.int64, device=logits.device)
        sampled = self.sampler(logits.index_select(0, index), specs)
        for owner, token_id, logprob in zip(owners, sampled.token_ids, sampled.logprobs):
            out = result.rows[owner]
            out.sampled_token_ids.append(token_id)
            if logprob is not None:
                if out.logprobs is None:
                    out.logprobs = []
                out.logprobs.append(logprob)
