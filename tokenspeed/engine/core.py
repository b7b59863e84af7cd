"""`EngineCore`: the heartbeat `plan = scheduler.next_plan(); result = executor.run(plan); scheduler.advance(result)`.

It works in token ids only; text (tokenising, detokenising, stop strings) is
the front end's job (`LLM`, later the API server), so the core can run in a
process of its own. One core serves one data-parallel replica.

Overlap scheduling (on unless `disable_overlap`): step N+1 is planned and
launched while the device still runs step N. The core only orders the calls;
the token bookkeeping is the scheduler's (`scheduler/provisional.py`):
launch N, then `scheduler.resolve(result of N-1)`, then
`scheduler.advance_provisional(plan N)`, so the next plan can be built at
once. Updates lag the launch by one step, never the tokens. Steps whose
sampling reads the token history (penalties) or that return logprobs run
synchronously, after the step in flight is resolved.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import torch

from tokenspeed.config import (
    EngineConfig,
    kv_cache_budget_bytes,
    parse_kernel_override,
    resolve_device,
    resolve_dtype,
)
from tokenspeed.engine.model_files import is_preset, resolve_model_folder
from tokenspeed.errors import ContextTooLong, InvalidRequest
from tokenspeed.executor.cuda_graphs import DecodeGraphs, graph_batch_sizes
from tokenspeed.executor.kv_storage import PagedKVStorage
from tokenspeed.executor.model_runner import ModelRunner, StepHandle
from tokenspeed.executor.sampling import needs_host_results
from tokenspeed.kernels import set_kernel_override
from tokenspeed.models import ModelConfig, build_model, load_weights
from tokenspeed.scheduler import Scheduler, SchedulerConfig
from tokenspeed.scheduler.admission import check_admission
from tokenspeed.scheduler.sampling_params import SamplingParams
from tokenspeed.scheduler.updates import RequestUpdate

logger = logging.getLogger("tokenspeed.engine")

_DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
_MAX_GRAPH_BS = 512


class EngineCore:
    def __init__(self, config: EngineConfig, *, progress: bool = False) -> None:
        config.validate()
        self.config = config
        preset = is_preset(config.model)
        self.model_folder = resolve_model_folder(config.model)
        self.model_config = ModelConfig.from_pretrained(self.model_folder)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, self.model_config.torch_dtype)
        self.max_model_len = self._resolve_max_model_len()

        for item in config.kernel_overrides:
            set_kernel_override(*parse_kernel_override(item))
        torch.manual_seed(config.seed)
        if config.cpu_threads is not None and self.device.type == "cpu":
            torch.set_num_threads(config.cpu_threads)
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
        kv_heads, k_dim, v_dim = mc.kv_cache_layout
        self.kv = PagedKVStorage(
            num_layers=mc.num_hidden_layers,
            num_pages=num_pages + 1,  # the last page is scratch for padded CUDA-graph rows
            page_size=config.page_size,
            num_kv_heads=kv_heads,
            head_dim=k_dim,
            v_head_dim=v_dim,
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
                vocab_size=self.model_config.vocab_size,
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
        self._inflight: StepHandle | None = None  # launched, advanced on placeholders
        logger.info(
            "engine ready: %s on %s (%s), %d KV pages of %d tokens, max_model_len %d",
            mc.architecture,
            self.device,
            self.dtype,
            num_pages,
            config.page_size,
            self.max_model_len,
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
        kv_heads, k_dim, v_dim = mc.kv_cache_layout
        per_page = PagedKVStorage.bytes_per_page(
            num_layers=mc.num_hidden_layers,
            page_size=self.config.page_size,
            num_kv_heads=kv_heads,
            head_dim=k_dim,
            v_head_dim=v_dim,
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
        # The front-end rule (LLM, CLI): max_tokens past the context is refused, where the scheduler clamps.
        check_admission(prompt_token_ids, sampling, dataclasses.replace(self.scheduler.config.limits,
                                                                        refuse_overlong_max_tokens=True))
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
        if plan.is_empty():
            return self._resolve_inflight()
        if needs_host_results(plan):
            # Penalties read the (resolved) history and logprobs need host work: this step runs
            # synchronously, after the step in flight is resolved.
            previous = self._inflight
            updates = self._resolve_inflight()
            return updates + self.scheduler.advance(plan, self.runner.launch(plan, previous).result())
        handle = self.runner.launch(plan, self._inflight)
        updates = self._resolve_inflight()
        self.scheduler.advance_provisional(plan)
        self._inflight = handle
        return updates

    def _resolve_inflight(self) -> list[RequestUpdate]:
        """Wait for the step in flight and hand its ids to the scheduler; that step's updates."""
        inflight, self._inflight = self._inflight, None
        return [] if inflight is None else self.scheduler.resolve(inflight.result())
