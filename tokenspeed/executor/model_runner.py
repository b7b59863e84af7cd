"""Runs one `ExecutionPlan` on the device: batch layout, forward, logits, sampling.

The runner never consults the scheduler: everything it needs is in the plan.
Logits are computed only where they are used (each sampling row's last token,
and the prompt positions whose logprobs were asked for), which on long
prefills saves a `[tokens, vocab]` matmul.

`launch(plan)` enqueues the whole step and returns a `StepHandle` at once; the
sampled ids stay on the device (`handle.sampled`) until `handle.result()`
fetches them, which is the step's only host synchronisation. A plan whose
decode rows carry `PLACEHOLDER_TOKEN_ID` reads those inputs from the previous
handle's device ids (overlap scheduling, see `engine/core.py`). Decode-only
steps replay a CUDA graph when one fits (`executor/cuda_graphs.py`).

Plans are incremental: the runner keeps every running request's page table
(`RequestPageTables`, on the device on a GPU) and applies each plan's changes
to it, so plans must be launched once each, in the order they were made.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tokenspeed.batch.kv_storage import PagedKVStorage
from tokenspeed.executor.batch_builder import RowSpec, StagingRing, build_host_batch, to_forward_batch
from tokenspeed.executor.cuda_graphs import DecodeGraphs, context_class, decode_kv_splits, mla_query_heads
from tokenspeed.executor.logits_processors import DeviceGrammarMasks
from tokenspeed.executor.page_tables import RequestPageTables
from tokenspeed.executor.sampler import Draws, Sampler, SampleSpec, prompt_token_logprobs
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
    assert row.prompt_token_ids is not None, "a row that wants prompt logprobs carries its prompt"
    last_scored = len(row.prompt_token_ids) - 1  # the last prompt token has no prompt successor
    return range(max(row.start_position, row.prompt_logprobs_start), min(row.end_position, last_scored))


class StepHandle:
    """A launched step. `sampled` (device, one id per draw) is valid at once; `result()` waits for it."""

    def __init__(self, plan: ExecutionPlan) -> None:
        self.plan = plan
        self.draws: Draws | None = None
        self.owners: list[int] = []  # plan row of each draw
        self.stream_index: dict[str, int] = {}  # request id -> its draw in `sampled`
        self.prompt_logprobs: tuple[torch.Tensor, list[_PromptLogprobSlice]] | None = None  # (logits, slices)
        self._result: ExecutionResult | None = None

    @property
    def sampled(self) -> torch.Tensor | None:
        return None if self.draws is None else self.draws.ids

    def result(self) -> ExecutionResult:
        if self._result is not None:
            return self._result
        plan = self.plan
        result = ExecutionResult(step_id=plan.step_id, rows=[RowOutput(r.request_id) for r in plan.rows])
        if self.draws is not None:
            for owner, token_id, logprob in zip(self.owners, self.draws.token_ids(), self.draws.logprobs()):
                result.rows[owner].sampled_token_ids.append(token_id)
                if logprob is not None:
                    result.rows[owner].logprobs = [logprob]
        if self.prompt_logprobs is not None:
            logits, slices = self.prompt_logprobs
            for piece in slices:
                row = plan.rows[piece.row]
                assert row.prompt_token_ids is not None and row.sampling.prompt_logprobs is not None
                p0 = piece.start_position
                targets = row.prompt_token_ids[p0 + 1 : p0 + 1 + piece.count]
                scored = logits[piece.first : piece.first + piece.count]
                result.rows[piece.row].prompt_logprobs = prompt_token_logprobs(
                    scored, targets, row.sampling.prompt_logprobs
                )
        self._result = result
        return result


class ModelRunner:
    def __init__(
        self,
        model: torch.nn.Module,
        kv: PagedKVStorage,
        device: torch.device,
        *,
        scratch_page: int | None = None,
        graphs: DecodeGraphs | None = None,
        max_model_len: int | None = None,
        graph_sizes: list[int] | None = None,
    ) -> None:
        self.model = model
        self.kv = kv
        self.device = device
        self.sampler = Sampler()
        self.staging = StagingRing(device)
        self.scratch_page = scratch_page if scratch_page is not None else 0
        self.page_tables = RequestPageTables(device, scratch_page=self.scratch_page)
        self.graphs = graphs
        self.max_model_len = max_model_len
        # Decode batches are sized by these buckets (for split-KV counts) even when running eagerly.
        self.graph_sizes = graph_sizes or []
        self.mla_heads = mla_query_heads(model)  # MLA decode sizes its splits by query heads

    @torch.inference_mode()
    def launch(self, plan: ExecutionPlan, previous: StepHandle | None = None) -> StepHandle:
        handle = StepHandle(plan)
        table_slots = self.page_tables.apply(plan)
        if not plan.rows:
            return handle

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

        num_rows = len(plan.rows)
        decode_only = flat_start == num_rows
        bucket = self.graphs.bucket(num_rows) if self.graphs is not None and decode_only else None
        if (
            bucket is not None
            and self.graphs is not None
            and max(r.num_pages for r in plan.rows) > self.graphs.page_table.shape[1]
        ):
            bucket = None
        host = build_host_batch(
            [RowSpec(r.input_token_ids, r.start_position) for r in plan.rows],
            page_size=self.kv.page_size,
            logits_indices=logits_indices,
            placeholder_source=None if previous is None else previous.stream_index,
            row_ids=[r.request_id for r in plan.rows],
            pad_rows_to=bucket or 0,
            scratch_page=self.scratch_page,
            tables=self.page_tables,
            table_slots=table_slots,
        )
        batch = to_forward_batch(
            host, self.staging, self.kv.page_size, None if previous is None else previous.sampled, self.page_tables
        )
        if decode_only and self.max_model_len is not None:
            rows = next((b for b in self.graph_sizes if b >= num_rows), num_rows)
            bound = context_class(batch.attn.max_seq_len, self.max_model_len)
            batch.attn.num_kv_splits = decode_kv_splits(
                rows, self.kv.k[0].shape[2], bound, self.device, mla_heads=self.mla_heads
            )
        if bucket is not None and self.graphs is not None:
            logits = self.graphs.replay(batch, bucket)[:num_rows]
            if logits_indices != list(range(num_rows)):  # decode rows that sample are all of them here
                logits = logits.index_select(0, batch.logits_indices)
        else:
            hidden = self.model(batch, self.kv)
            logits = self.model.compute_logits(hidden.index_select(0, batch.logits_indices))

        if prompt_slices:
            handle.prompt_logprobs = (logits, prompt_slices)
        self._sample(plan, logits, sample_slots, handle)
        return handle

    def _sample(
        self,
        plan: ExecutionPlan,
        logits: torch.Tensor,
        sample_slots: list[tuple[int, int]],
        handle: StepHandle,
    ) -> None:
        """One draw per sampling row, keyed by the row's seed and sample index."""
        if not sample_slots:
            return
        gather: list[int] = []
        specs: list[SampleSpec] = []
        for plan_row, logits_row in sample_slots:
            row = plan.rows[plan_row]
            handle.stream_index[row.request_id] = len(gather)
            gather.append(logits_row)
            handle.owners.append(plan_row)
            specs.append(SampleSpec.of_row(row))
        if gather == list(range(logits.shape[0])):
            chosen = logits
        else:
            index = torch.tensor(gather, dtype=torch.int64)
            if logits.is_cuda:
                index = index.pin_memory().to(logits.device, non_blocking=True)
            chosen = logits.index_select(0, index)
        masks = None
        if plan.grammar_masks is not None:  # rows of `chosen` are the draws, in `owners` order
            first = {plan_row: draw for draw, plan_row in enumerate(handle.owners)}
            masks = DeviceGrammarMasks.of(plan.grammar_masks, first, chosen.device)
        handle.draws = self.sampler.launch(chosen, specs, masks)
