"""`EngineCore`: the heartbeat `plan = scheduler.next_plan(); result = executor.run(plan); scheduler.advance(result)`.

It works in token ids only; text (tokenising, detokenising, stop strings) is
the front end's job (`LLM`, later the API server), so the core can run in a
process of its own. One core serves one data-parallel replica.

Overlap scheduling (on unless `disable_overlap`): step N+1 is planned and
launched while the device still runs step N. The scheduler stays torch-free
and unchanged; the core drives it through its ordinary API with one rule:
right after launching a step it `advance`s the scheduler with *placeholder*
samples (`PLACEHOLDER_TOKEN_ID`), so the next plan can be built at once. A
decode row whose input is a placeholder reads "the token this stream sampled
last step" on the device. When the real ids arrive (one step later, while the
next step runs) the core writes them over the placeholders in each stream's
output list, applies the stop-token rule the placeholder could not trigger,
and only then reports the step's updates: updates lag the launch by one
step, never the tokens. Consequences, all invisible in the output:
- a stream that stops on a stop token runs one extra step, whose sample is
  dropped (length limits are exact: they depend on counts, not ids);
- every placeholder is patched before any code reads it: prefix hashing
  covers computed tokens only, and a placeholder is always the one uncomputed
  token of its stream until patched; steps whose sampling reads token history
  (penalties) or that return logprobs are run synchronously instead.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from pathlib import Path

import torch

from tokenspeed.config import (
    EngineConfig,
    kv_cache_budget_bytes,
    parse_kernel_override,
    resolve_device,
    resolve_dtype,
)
from tokenspeed.engine.model_files import resolve_model_folder
from tokenspeed.errors import ContextTooLong, InvalidRequest
from tokenspeed.executor.cuda_graphs import DecodeGraphs, graph_batch_sizes
from tokenspeed.executor.forward_batch import PLACEHOLDER_TOKEN_ID
from tokenspeed.executor.kv_storage import PagedKVStorage
from tokenspeed.executor.model_runner import ModelRunner, StepHandle
from tokenspeed.executor.sampling import needs_host_results
from tokenspeed.kernels import set_kernel_override
from tokenspeed.models import ModelConfig, build_model, load_weights
from tokenspeed.models.presets import materialize_preset, preset_name
from tokenspeed.scheduler import Scheduler, SchedulerConfig
from tokenspeed.scheduler.plan import ExecutionPlan, ExecutionResult, RowOutput
from tokenspeed.scheduler.request import Request
from tokenspeed.scheduler.sampling_params import SamplingParams
from tokenspeed.scheduler.stepping import fork_ids
from tokenspeed.scheduler.updates import RequestUpdate

logger = logging.getLogger("tokenspeed.engine")

_DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
_MAX_GRAPH_BS = 512


@dataclass(slots=True)
class _Patch:
    """One placeholder sample awaiting its real id: where it goes and how to judge it."""

    update: RequestUpdate
    stream: Request | None  # the live stream after the placeholder advance (None: it finished there)
    position: int  # index of the placeholder in the stream's output list
    stop_ids: frozenset[int]
    min_tokens: int


@dataclass(slots=True)
class _InFlight:
    handle: StepHandle
    patches: list[tuple[int, int, _Patch]]  # (plan row, draw within row, patch)
    updates: list[RequestUpdate]


class EngineCore:
    def __init__(self, config: EngineConfig, *, progress: bool = False) -> None:
        config.validate()
        self.config = config
        preset = None if config.model is None or Path(config.model).expanduser().exists() else preset_name(config.model)
        self.model_folder = materialize_preset(preset) if preset else resolve_model_folder(config.model)
        self.model_config = ModelConfig.from_pretrained(self.model_folder)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, self.model_config.torch_dtype)
        self.max_model_len = self._resolve_max_model_len()

        for item in config.kernel_overrides:
            set_kernel_override(*parse_kernel_override(item))
        torch.manual_seed(config.seed)
        self.model = build_model(self.model_config, dtype=self.dtype, device=self.device)
        load_weights(
            self.model,
            None if config.load_format == "dummy" or preset else self.model_folder,
            load_format="dummy" if preset else config.load_format,  # a preset ships no weights
            seed=config.seed,
            progress=progress,
        )
        self.model.eval()

        num_pages = self._resolve_num_pages()
        mc = self.model_config
        self.kv = PagedKVStorage(
            num_layers=mc.num_hidden_layers,
            num_pages=num_pages + 1,  # the last page is scratch for padded CUDA-graph rows
            page_size=config.page_size,
            num_kv_heads=mc.num_key_value_heads,
            head_dim=mc.head_dim,
            dtype=self.dtype,
            device=self.device,
        )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens or _DEFAULT_MAX_NUM_BATCHED_TOKENS,
                max_model_len=self.max_model_len,
                page_size=config.page_size,
                num_pages=num_pages,
                enable_prefix_caching=config.enable_prefix_caching,
                seed=config.seed,
            )
        )
        graphs = self._capture_graphs(num_pages)
        self.runner = ModelRunner(
            self.model,
            self.kv,
            self.device,
            scratch_page=num_pages,
            graphs=graphs,
            max_model_len=self.max_model_len,
            graph_sizes=graph_batch_sizes(self._graph_max_bs()),
        )
        self.overlap = not config.disable_overlap
        self._inflight: _InFlight | None = None
        logger.info(
            "engine ready: %s on %s (%s), %d KV pages of %d tokens, max_model_len %d",
            mc.architecture, self.device, self.dtype, num_pages, config.page_size, self.max_model_len,
        )

    def _graph_max_bs(self) -> int:
        return min(self.config.cuda_graph_max_bs or _MAX_GRAPH_BS, self.config.max_num_seqs)

    def _capture_graphs(self, scratch_page: int) -> DecodeGraphs | None:
        if self.device.type != "cuda" or self.config.enforce_eager:
            return None
        graphs = DecodeGraphs(
            self.model,
            self.kv,
            max_bs=self._graph_max_bs(),
            max_pages_per_seq=math.ceil(self.max_model_len / self.config.page_size),
            max_model_len=self.max_model_len,
            scratch_page=scratch_page,
        )
        return graphs if graphs.capture() else None

    @property
    def cuda_graphs_enabled(self) -> bool:
        return self.runner.graphs is not None

    @property
    def vocab_size(self) -> int:
        return self.model_config.vocab_size

    def _resolve_max_model_len(self) -> int:
        limit = self.model_config.max_position_embeddings
        wanted = self.config.max_model_len
        if wanted is None:
            return limit
        if wanted > limit:
            raise ContextTooLong(
                f"max_model_len {wanted} exceeds the model's max_position_embeddings ({limit})."
            )
        return wanted

    def _resolve_num_pages(self) -> int:
        """Enough pages for one max-length request at least; otherwise what the memory budget allows."""
        one_request = math.ceil(self.max_model_len / self.config.page_size)
        if self.config.num_kv_pages is not None:
            if self.config.num_kv_pages < one_request:
                raise InvalidRequest(
                    f"num_kv_pages={self.config.num_kv_pages} cannot hold one request of max_model_len "
                    f"{self.max_model_len} (needs {one_request} pages of {self.config.page_size})."
                )
            return self.config.num_kv_pages
        mc = self.model_config
        per_page = PagedKVStorage.bytes_per_page(
            num_layers=mc.num_hidden_layers,
            page_size=self.config.page_size,
            num_kv_heads=mc.num_key_value_heads,
            head_dim=mc.head_dim,
            dtype=self.dtype,
        )
        budget_pages = kv_cache_budget_bytes(self.config, self.device) // per_page
        useful_pages = self.config.max_num_seqs * one_request + 1
        num_pages = min(budget_pages, useful_pages)
        if num_pages < one_request:
            raise InvalidRequest(
                f"The KV cache budget holds {budget_pages} pages but one request of max_model_len "
                f"{self.max_model_len} needs {one_request}; lower max_model_len or raise the budget."
            )
        return int(num_pages)

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        bad = [t for t in prompt_token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise InvalidRequest(
                f"Prompt token ids must be in [0, {self.vocab_size}); got {bad[:5]}"
                + (" ..." if len(bad) > 5 else "")
            )
        self.scheduler.submit(request_id, list(prompt_token_ids), sampling)

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def finish_stream(self, stream_id: str, reason: str, stop_reason: str | None = None) -> None:
        self.scheduler.finish(stream_id, reason, stop_reason)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def step(self) -> list[RequestUpdate]:
        if not self.overlap:
            plan = self.scheduler.next_plan()
            if plan.is_empty():
                return []
            return self.scheduler.advance(plan, self.runner.run(plan))
        return self._overlapped_step()

    # ---- overlap scheduling (see the module docstring) ---------------------------------

    def _overlapped_step(self) -> list[RequestUpdate]:
        plan = self.scheduler.next_plan()
        updates: list[RequestUpdate] = []
        if plan.is_empty():
            return self._resolve_inflight()
        previous = self._inflight.handle if self._inflight is not None else None
        if needs_host_results(plan):
            # Penalties read the (patched) history and logprobs need host work: this step runs
            # synchronously, after the step in flight is resolved.
            updates = self._resolve_inflight()
            handle = self.runner.launch(plan, previous)
            return updates + self.scheduler.advance(plan, handle.result())
        handle = self.runner.launch(plan, previous)
        updates = self._resolve_inflight()
        self._inflight = self._advance_with_placeholders(plan, handle)
        return updates

    def _advance_with_placeholders(self, plan: ExecutionPlan, handle: StepHandle) -> _InFlight:
        fake = ExecutionResult(
            step_id=plan.step_id,
            rows=[RowOutput(r.request_id, [PLACEHOLDER_TOKEN_ID] * r.num_samples) for r in plan.rows],
        )
        updates = self.scheduler.advance(plan, fake)
        by_stream = {u.request_id: u for u in updates if u.new_token_ids}
        patches: list[tuple[int, int, _Patch]] = []
        for i, row in enumerate(plan.rows):
            if not row.sample:
                continue
            streams = [row.request_id, *fork_ids(row.request_id, len(row.seeds))]
            for k, stream_id in enumerate(streams):
                update = by_stream.get(stream_id)
                if update is None:  # the stream ended before this step's results (abort)
                    continue
                patches.append((i, k, _Patch(
                    update=update,
                    stream=self.scheduler.get(stream_id),
                    position=row.sample_index,
                    stop_ids=frozenset(row.sampling.stop_ids()),
                    min_tokens=row.sampling.min_tokens,
                )))
        return _InFlight(handle, patches, updates)

    def _resolve_inflight(self) -> list[RequestUpdate]:
        """Fetch the in-flight step's ids, patch them in, apply stop tokens; that step's updates."""
        inflight, self._inflight = self._inflight, None
        if inflight is None:
            return []
        result = inflight.handle.result()
        dropped: set[int] = set()
        for row, draw, patch in inflight.patches:
            token = result.rows[row].sampled_token_ids[draw]
            update, stream = patch.update, patch.stream
            update.new_token_ids = [token]
            live = stream is not None and self.scheduler.get(stream.request_id) is stream
            if stream is not None:
                outputs = stream.output_token_ids
                if patch.position < len(outputs) and outputs[patch.position] == PLACEHOLDER_TOKEN_ID:
                    outputs[patch.position] = token
                if not live:  # aborted or stopped by the front end after the launch: drop the token
                    dropped.add(id(update))
                    continue
            if token in patch.stop_ids and patch.position + 1 >= patch.min_tokens:
                update.finished, update.finish_reason, update.stop_reason = True, "stop", token
                if live and stream is not None:
                    self.scheduler.finish_request(stream, "stop", token)
        return [u for u in inflight.updates if id(u) not in dropped]
