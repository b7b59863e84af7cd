"""`EngineCore`: the heartbeat `plan = scheduler.next_plan(); result = executor.run(plan); scheduler.advance(result)`.

It works in token ids only; text (tokenising, detokenising, stop strings) is
the front end's job (`LLM`, later the API server), so the core can run in a
process of its own. One core serves one data-parallel replica.
"""

from __future__ import annotations

import logging
import math

import torch

from tokenspeed.config import EngineConfig, kv_cache_budget_bytes, resolve_device, resolve_dtype
from tokenspeed.engine.model_files import resolve_model_folder
from tokenspeed.errors import ContextTooLong, InvalidRequest
from tokenspeed.executor.kv_storage import PagedKVStorage
from tokenspeed.executor.model_runner import ModelRunner
from tokenspeed.models import ModelConfig, build_model, load_weights
from tokenspeed.scheduler import Scheduler, SchedulerConfig
from tokenspeed.scheduler.sampling_params import SamplingParams
from tokenspeed.scheduler.updates import RequestUpdate

logger = logging.getLogger("tokenspeed.engine")

_DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


class EngineCore:
    def __init__(self, config: EngineConfig, *, progress: bool = False) -> None:
        config.validate()
        self.config = config
        self.model_folder = resolve_model_folder(config.model)
        self.model_config = ModelConfig.from_pretrained(self.model_folder)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, self.model_config.torch_dtype)
        self.max_model_len = self._resolve_max_model_len()

        torch.manual_seed(config.seed)
        self.model = build_model(self.model_config, dtype=self.dtype, device=self.device)
        load_weights(
            self.model,
            None if config.load_format == "dummy" else self.model_folder,
            load_format=config.load_format,
            seed=config.seed,
            progress=progress,
        )
        self.model.eval()

        num_pages = self._resolve_num_pages()
        mc = self.model_config
        self.kv = PagedKVStorage(
            num_layers=mc.num_hidden_layers,
            num_pages=num_pages,
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
        self.runner = ModelRunner(self.model, self.kv, self.device)
        logger.info(
            "engine ready: %s on %s (%s), %d KV pages of %d tokens, max_model_len %d",
            mc.architecture, self.device, self.dtype, num_pages, config.page_size, self.max_model_len,
        )

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
        return self.scheduler.has_unfinished()

    def step(self) -> list[RequestUpdate]:
        plan = self.scheduler.next_plan()
        if plan.is_empty():
            return []
        result = self.runner.run(plan)
        return self.scheduler.advance(plan, result)
