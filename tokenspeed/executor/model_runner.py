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

Speculative decoding: a decode row with k drafts runs as a (k+1)-token row
(`step_layout.py`) in the same batch as prefill chunks and plain decodes; its
K/V is written at all k+1 positions and its logits are computed at all of
them. What is accepted, and what a device drafter drafts, is decided by the
`Speculator` (`speculator.py`, implemented in `spec/`); the runner lays the
rows out, runs the hooks in order, and returns 1 .. k+1 tokens per verify row.

DP attention (`attention_ranks` set): the runner keeps page tables for its own
requests only and runs the forward pass over its own rows
(`dp_attention_step.py`); the model's gathers make every rank's logits whole,
they are put back in the plan's order, and from there sampling runs on the
whole plan as on one device, on every rank alike. Always eager (no graphs).
"""

from __future__ import annotations

import itertools

import numpy as np
import torch

from tokenspeed.batch.forward_batch import ForwardBatch
from tokenspeed.batch.kv_storage import PagedKVStorage
from tokenspeed.executor.attention_ranks import AttentionRanks
from tokenspeed.executor.batch_builder import RowSpec, StagingRing, build_host_batch, to_forward_batch
from tokenspeed.executor.cpu_decode import CPUDecodeForward
from tokenspeed.executor.cuda_graphs import (
    VERIFY_MAX_TOKENS,
    DecodeGraphs,
    context_class,
    decode_kv_splits,
    mla_query_heads,
)
from tokenspeed.executor.dp_attention_step import DPStep, dp_step
from tokenspeed.executor.logits_processors import DeviceGrammarMasks
from tokenspeed.executor.page_tables import RequestPageTables
from tokenspeed.executor.sampler import Draws, Sampler, SampleSpec, prompt_token_logprobs
from tokenspeed.executor.speculator import DraftRows, ProposedDrafts, Speculator, StepTail
from tokenspeed.executor.step_layout import PromptLogprobSlice, StepLayout, lay_out, verify_graph_query_len
from tokenspeed.executor.verify_step import VerifiedTokens, process_verified, verify_batch
from tokenspeed.models.parallel.planned_model import DPRows, TokenRows
from tokenspeed.scheduler.plan import ExecutionPlan, ExecutionResult, RowOutput


class StepHandle:
    """A launched step. `sampled` (device: each stream's last token, at `stream_index`) is valid at once;
    `result()` waits for the step."""

    def __init__(self, plan: ExecutionPlan) -> None:
        self.plan = plan
        self.draws: Draws | None = None
        self.owners: list[int] = []  # plan row of each draw
        self.verified: VerifiedTokens | None = None
        self.stream_index: dict[str, int] = {}  # request id -> its last token in `sampled`
        self.sampled: torch.Tensor | None = None
        self.prompt_logprobs: tuple[torch.Tensor, list[PromptLogprobSlice]] | None = None  # (logits, slices)
        self._result: ExecutionResult | None = None

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
        if self.verified is not None:
            verified = self.verified
            for owner, tokens, logprobs in zip(verified.batch.plan_rows, verified.rows(), verified.logprobs()):
                result.rows[owner].sampled_token_ids = tokens
                result.rows[owner].logprobs = logprobs
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
        self.sampler = Sampler(device)
        self.staging = StagingRing(device)
        self.scratch_page = scratch_page if scratch_page is not None else 0
        self.page_tables = RequestPageTables(device, scratch_page=self.scratch_page)
        self.graphs = graphs
        # CPU: decode-only steps (and prefill / mixed steps) run the few-op forward (`cpu_decode.py`) where it
        # `serves` them; None: the model's layers run every step.
        self.cpu_decode: CPUDecodeForward | None = None
        self.max_model_len = max_model_len
        # Decode batches are sized by these buckets (for split-KV counts) even when running eagerly.
        self.graph_sizes = graph_sizes or []
        self.mla_heads = mla_query_heads(model)  # MLA decode sizes its splits by query heads
        self.speculation: Speculator | None = None  # set by spec/ when speculative decoding is on
        # k+1 of the verify batches CUDA graphs run (1: none): on a GPU every verify step that fits is laid
        # out so, graphs on or off, so both give the same tokens.
        self.verify_query_len = 1
        # DP attention: the placement of requests over the attention ranks, and this rank's index there.
        self.attention_ranks: AttentionRanks | None = None
        self.attention_rank = 0

    @torch.inference_mode()
    def launch(self, plan: ExecutionPlan, previous: StepHandle | None = None) -> StepHandle:
        handle = StepHandle(plan)
        if self.attention_ranks is not None:
            return self._launch_dp(plan, previous, handle)
        table_slots = self.page_tables.apply(plan)
        if not plan.rows:
            return handle
        if plan.has_drafts and self.speculation is None:
            raise RuntimeError(f"plan {plan.step_id} carries drafts, but speculative decoding is not set up")
        # Verify steps take one shape, k+1 tokens every row (filler first), as their graphs do.
        q_len = 1
        if self.verify_query_len > 1 and verify_graph_query_len(plan, self.verify_query_len):
            q_len = self.verify_query_len
        layout = lay_out(plan, pad_to=q_len if q_len > 1 else 0)

        num_rows = len(plan.rows)
        uniform = q_len > 1 or layout.num_tokens == num_rows  # decode-only, or padded verify rows
        sizes = self.graph_sizes if q_len == 1 else [b for b in self.graph_sizes if b * q_len <= VERIFY_MAX_TOKENS]
        rows_bucket = next((b for b in sizes if b >= num_rows), num_rows)
        bucket = self.graphs.bucket(num_rows, q_len) if self.graphs is not None and uniform else None
        if (
            bucket is not None
            and self.graphs is not None
            and max(r.num_pages for r in plan.rows) > self.graphs.page_table.shape[1]
        ):
            bucket = None
        # A verify step runs its bucket's shape even eagerly: graphs on and off then compute the same thing.
        pad_rows = bucket or (rows_bucket if q_len > 1 else 0)
        host = build_host_batch(
            [RowSpec(tokens, r.start_position - pad, padding=pad)
             for tokens, pad, r in zip(layout.tokens, layout.padding, plan.rows)],
            page_size=self.kv.page_size,
            logits_indices=layout.logits_indices,
            placeholder_source=None if previous is None else previous.stream_index,
            row_ids=[r.request_id for r in plan.rows],
            pad_rows_to=pad_rows,
            scratch_page=self.scratch_page,
            tables=self.page_tables,
            table_slots=table_slots,
            pad_row_tokens=q_len,
        )
        graph_inputs = None
        if bucket is not None and self.graphs is not None:
            graph_inputs = self.graphs.step_inputs(bucket, q_len, host.table_width)
        batch = to_forward_batch(
            host, self.staging, self.kv.page_size, None if previous is None else previous.sampled, self.page_tables,
            out=graph_inputs,
        )  # fmt: skip
        if uniform and self.max_model_len is not None:
            bound = context_class(batch.attn.max_seq_len, self.max_model_len)
            batch.attn.num_kv_splits = decode_kv_splits(
                rows_bucket, self.kv.k[0].shape[2], bound, self.device, mla_heads=self.mla_heads, q_len=q_len
            )
        proposed = self._propose(plan, layout, batch, table_slots) if layout.device_drafted else None
        if bucket is not None and self.graphs is not None:
            hidden, logits = self.graphs.replay(batch, bucket)
            if layout.logits_indices != list(range(logits.shape[0])):
                logits = logits.index_select(0, batch.logits_indices)
        else:
            cpu_decode = self.cpu_decode
            if cpu_decode is not None and q_len == 1 and not pad_rows and proposed is None and cpu_decode.serves(batch):
                # the logits rows only (no speculation here: nothing reads the other rows' hidden states)
                hidden = cpu_decode.run(batch, logits_rows=True)
                logits = cpu_decode.logits(hidden)  # the model's LM head, pre-packed where faster
            else:
                hidden = self.model(batch, self.kv)
                logits = self.model.compute_logits(hidden.index_select(0, batch.logits_indices))

        if layout.prompt_slices:
            handle.prompt_logprobs = (logits, layout.prompt_slices)
        self._sample(plan, logits, layout, handle)
        if layout.verify_rows:
            self._verify(plan, logits, layout, proposed, handle)
        self._publish_last_tokens(plan, layout, handle)
        if self.speculation is not None and self.speculation.observes:
            replayed = None if bucket is None else (bucket, q_len, batch.attn.num_kv_splits)
            self._observe(layout, batch, hidden, table_slots, handle, replayed)
        return handle

    def _launch_dp(self, plan: ExecutionPlan, previous: StepHandle | None, handle: StepHandle) -> StepHandle:
        """A DP-attention step: this rank's rows forward, every rank's logits back in plan order, then
        sampling over the whole plan (see the module docstring)."""
        assert self.attention_ranks is not None
        step = dp_step(plan, self.attention_ranks.split(plan), self.attention_rank)
        local = step.local
        table_slots = self.page_tables.apply(local)
        if not plan.rows:
            return handle
        if plan.has_drafts:
            raise RuntimeError(f"plan {plan.step_id} carries drafts: speculative decoding is not run with DP attention")
        local_layout = lay_out(local)
        host = build_host_batch(
            [RowSpec(tokens, r.start_position) for tokens, r in zip(local_layout.tokens, local.rows)],
            page_size=self.kv.page_size,
            logits_indices=local_layout.logits_indices,
            placeholder_source=None if previous is None else previous.stream_index,
            row_ids=[r.request_id for r in local.rows],
            pad_rows_to=1 if step.idle else 0,  # an idle rank runs one filler token on the scratch page
            scratch_page=self.scratch_page,
            tables=self.page_tables,
            table_slots=table_slots,
        )
        batch = to_forward_batch(
            host, self.staging, self.kv.page_size, None if previous is None else previous.sampled, self.page_tables
        )
        num_rows = len(local.rows)
        if num_rows and local_layout.num_tokens == num_rows and self.max_model_len is not None:
            # decode-only on this rank: split-KV counts by bucket, as the one-device runner sizes them
            rows_bucket = next((b for b in self.graph_sizes if b >= num_rows), num_rows)
            bound = context_class(batch.attn.max_seq_len, self.max_model_len)
            batch.attn.num_kv_splits = decode_kv_splits(
                rows_bucket, self.kv.k[0].shape[2], bound, self.device, mla_heads=self.mla_heads
            )
        logits = self._forward_dp(batch, step)
        layout = lay_out(plan)
        if layout.prompt_slices:
            handle.prompt_logprobs = (logits, layout.prompt_slices)
        self._sample(plan, logits, layout, handle)
        self._publish_last_tokens(plan, layout, handle)
        return handle

    def _forward_dp(self, batch: ForwardBatch, step: DPStep) -> torch.Tensor:
        """This rank's forward and LM head; the gathered logits, in the whole plan's order."""
        model = self.model
        model.dp_rows = DPRows(
            tokens=TokenRows(step.num_tokens, step.padded_tokens),
            logits=TokenRows(step.num_logits, step.padded_logits),
        )
        try:
            hidden = model(batch, self.kv)
            logits = model.compute_logits(hidden.index_select(0, batch.logits_indices))
        finally:
            model.dp_rows = None
        return self._rows_of(logits, step.logits_order)

    def _sample(self, plan: ExecutionPlan, logits: torch.Tensor, layout: StepLayout, handle: StepHandle) -> None:
        """One draw per plain sampling row, keyed by the row's seed and sample index."""
        if not layout.sample_slots:
            return
        gather: list[int] = []
        specs: list[SampleSpec] = []
        for plan_row, logits_row in layout.sample_slots:
            gather.append(logits_row)
            handle.owners.append(plan_row)
            specs.append(SampleSpec.of_row(plan.rows[plan_row]))
        chosen = self._rows_of(logits, gather)
        masks = None
        if plan.grammar_masks is not None:  # rows of `chosen` are the draws, in `owners` order
            first = {plan_row: draw for draw, plan_row in enumerate(handle.owners)}
            masks = DeviceGrammarMasks.of(plan.grammar_masks, first, chosen.device)
        handle.draws = self.sampler.launch(chosen, specs, masks)

    def _verify(
        self, plan: ExecutionPlan, logits: torch.Tensor, layout: StepLayout, proposed: ProposedDrafts | None,
        handle: StepHandle,
    ) -> None:
        """The emitted tokens of the verify rows, decided by the speculator on processed logits."""
        assert self.speculation is not None
        batch = verify_batch(plan, layout, proposed, logits.device,
                             fast_greedy=self.speculation.fast_greedy_verify)
        gather = [s + i for s, k in zip(layout.verify_logits_starts, batch.num_draft_tokens) for i in range(k + 1)]
        chosen = self._rows_of(logits, gather)
        masks = None
        if plan.grammar_masks is not None:  # a verify row's k+1 positions are consecutive rows of `chosen`
            offsets = [0, *itertools.accumulate(k + 1 for k in batch.num_draft_tokens)]
            first = {plan_row: offsets[j] for j, plan_row in enumerate(layout.verify_rows)}
            masks = DeviceGrammarMasks.of(plan.grammar_masks, first, chosen.device)
        processed, raw = process_verified(self.sampler, chosen, batch, masks)
        outcome = self.speculation.verify(processed, batch, self.sampler)
        handle.verified = VerifiedTokens(batch, outcome, raw)

    def _publish_last_tokens(self, plan: ExecutionPlan, layout: StepLayout, handle: StepHandle) -> None:
        """`handle.sampled`: each sampling row's last token on the device, for the next step's placeholders."""
        parts: list[torch.Tensor] = []
        if handle.draws is not None:
            parts.append(handle.draws.ids)
            for j, owner in enumerate(handle.owners):
                handle.stream_index[plan.rows[owner].request_id] = j
        if handle.verified is not None:
            offset = len(handle.owners)
            for j, owner in enumerate(layout.verify_rows):
                handle.stream_index[plan.rows[owner].request_id] = offset + j
            parts.append(handle.verified.last)
        if parts:
            handle.sampled = parts[0] if len(parts) == 1 else torch.cat(parts)

    def _propose(
        self, plan: ExecutionPlan, layout: StepLayout, batch: ForwardBatch, table_slots: np.ndarray
    ) -> ProposedDrafts:
        """Device drafts for the verify rows that asked for them, written into the batch's input ids."""
        assert self.speculation is not None
        plan_rows = [layout.verify_rows[j] for j in layout.device_drafted]
        rows = [plan.rows[i] for i in plan_rows]
        slots = [int(table_slots[i]) for i in plan_rows]
        proposed = self.speculation.propose(batch, DraftRows(
            batch_rows=self._upload(plan_rows),
            token_index=self._upload([layout.row_starts[i] for i in plan_rows]),
            slots=self._upload(slots),
            start_positions=[r.start_position for r in rows],
            num_draft_tokens=[r.num_draft_tokens for r in rows],
            specs=[SampleSpec.of_row(r) for r in rows],
        ))
        width = proposed.token_ids.shape[1]
        dest: list[int] = []
        source: list[int] = []
        for n, (i, row) in enumerate(zip(plan_rows, rows)):
            dest.extend(layout.row_starts[i] + 1 + j for j in range(row.num_draft_tokens))
            source.extend(n * width + j for j in range(row.num_draft_tokens))
        drafted = proposed.token_ids.reshape(-1).index_select(0, self._upload(source))
        batch.input_ids = batch.input_ids.index_copy(0, self._upload(dest), drafted)
        return proposed

    def _observe(
        self, layout: StepLayout, batch: ForwardBatch, hidden: torch.Tensor, table_slots: np.ndarray,
        handle: StepHandle, replayed: tuple[int, int, int | None] | None = None,
    ) -> None:
        """Hand the step to a drafter that catches up on it: every position with the token after it.

        Within a row the next token is the row's next input; at a sampling row's last accepted position
        it is the token the row emitted there (a verify row's drafts past it were rejected: their
        positions get wrong tokens, and are recomputed before anything reads them). A prompt chunk that
        does not sample ends on a position whose next token comes with the next chunk: it gets a wrong
        one too, which costs that position's drafter state some accuracy, never exactness.
        """
        assert self.speculation is not None
        sampling_rows = [plan_row for plan_row, _ in layout.sample_slots]
        index_parts = [self._upload([layout.logits_indices[logits_row] for _, logits_row in layout.sample_slots])]
        if handle.verified is not None:
            starts = self._upload([layout.row_starts[i] for i in layout.verify_rows])
            index_parts.append(starts + handle.verified.outcome.num_emitted - 1)
            sampling_rows = sampling_rows + layout.verify_rows
        last_index = torch.cat(index_parts)
        next_ids = torch.roll(batch.input_ids, -1)
        if handle.sampled is not None:
            next_ids = next_ids.index_copy(0, last_index, handle.sampled)
        host_slots = [int(table_slots[i]) for i in sampling_rows]
        tail = StepTail(next_ids, last_index, self._upload(host_slots), max(host_slots, default=-1), replayed)
        self.speculation.observe(batch, hidden, tail)

    def _rows_of(self, logits: torch.Tensor, rows: list[int]) -> torch.Tensor:
        if rows == list(range(logits.shape[0])):
            return logits
        return logits.index_select(0, self._upload(rows))

    def _upload(self, values: list[int]) -> torch.Tensor:
        tensor = torch.tensor(values, dtype=torch.int64)
        if self.device.type == "cuda":
            return tensor.pin_memory().to(self.device, non_blocking=True)
        return tensor
