"""`EngineCore`: the heartbeat `plan = scheduler.next_plan(); executor runs it; scheduler.advance(result)`.

The core owns no device state: the `Executor` (`executor/executor.py`)
builds the model, sizes the KV pool and runs plans, behind the
`ModelExecutor` interface (`executor/interface.py`: `limits`, `launch`,
`collect`). The core sizes its `Scheduler` from the executor's limits and
orders the calls. It works in token ids only; text (tokenising,
detokenising, stop strings) is the front end's job (`LLM`, `AsyncEngine`),
so the core can run in a process of its own. One core serves one
data-parallel replica.

Overlap scheduling (on unless `disable_overlap`): step N+1 is planned and
launched while the device still runs step N. The core only orders the calls;
the token bookkeeping is the scheduler's (`scheduler/provisional.py`):
launch N, then `scheduler.resolve(result of N-1)`, then
`scheduler.advance_provisional(plan N)`, so the next plan can be built at
once. Updates lag the launch by one step, never the tokens. Steps whose
sampling reads the token history (penalties) or that return logprobs run
synchronously, after the step in flight is resolved.

Speculative decoding (`speculative_config`, `spec/`): the scheduler drafts
or asks the executor for drafts, and a step with drafts runs synchronously
(its result decides how many tokens each row advances, so it cannot be
advanced on placeholders). A host drafter (n-gram, suffix) reads the
resolved history, so with one the step in flight is resolved before the
next plan is built; device drafters read the last token on the device.
"""

from __future__ import annotations

import dataclasses
import logging
from pathlib import Path
from typing import Any

from tokenspeed.config import EngineConfig
from tokenspeed.engine.model_files import is_preset, resolve_model_folder
from tokenspeed.executor.executor import Executor
from tokenspeed.executor.interface import ModelExecutor
from tokenspeed.executor.sampler import needs_host_results
from tokenspeed.scheduler import Scheduler, SchedulerConfig
from tokenspeed.scheduler.admission import check_admission
from tokenspeed.scheduler.plan import ExecutionPlan, ExecutionResult, ExecutorLimits
from tokenspeed.scheduler.sampling_params import SamplingParams
from tokenspeed.scheduler.speculation import SpeculationStats
from tokenspeed.scheduler.updates import RequestUpdate
from tokenspeed.spec.build import speculator_factory
from tokenspeed.spec.config import SpeculativeConfig, parse_speculative_config

logger = logging.getLogger("tokenspeed.engine")

_DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192


class EngineCore:
    def __init__(
        self, config: EngineConfig, *, progress: bool = False, executor: ModelExecutor[Any] | None = None
    ) -> None:
        """The core of `config`'s model; `executor` replaces the one it would build (tests, simulations)."""
        config.validate()
        self.config = config
        self.speculative_config: SpeculativeConfig | None = parse_speculative_config(config.speculative_config)
        self.model_folder: Path | None = None  # where the front end finds the tokenizer
        if executor is None:
            preset = is_preset(config.model)
            self.model_folder = resolve_model_folder(config.model)
            if preset:
                logger.warning("%s is a preset: the model's shape with random weights; its text is not meaningful",
                               config.model)
            speculator = None
            if self.speculative_config is not None:
                speculator = speculator_factory(self.speculative_config, progress=progress)
            executor = Executor(config, self.model_folder, dummy_weights=preset, progress=progress,
                                speculator=speculator)
        self.executor = executor
        limits = executor.limits
        spec = self.speculative_config
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens or _DEFAULT_MAX_NUM_BATCHED_TOKENS,
                max_model_len=limits.max_model_len,
                page_size=limits.page_size,
                num_pages=limits.num_pages,
                enable_prefix_caching=config.enable_prefix_caching,
                seed=config.seed,
                vocab_size=limits.vocab_size,
                speculation=None if spec is None else spec.draft_policy(),
            ),
            None if spec is None else spec.make_drafter(),
        )
        self.overlap = not config.disable_overlap
        self._host_drafts = spec is not None and not spec.drafts_on_device
        self._inflight: Any = None  # the executor's handle of the step launched, advanced on placeholders
        self.is_shut_down = False

    @property
    def limits(self) -> ExecutorLimits:
        return self.executor.limits

    def shutdown(self) -> None:
        """Free the executor's device state (weights, KV pool, CUDA graphs); no step runs afterwards."""
        self._inflight = None  # a launched step's handle holds device tensors
        self.is_shut_down = True
        close = getattr(self.executor, "close", None)  # a simulated executor holds nothing to free
        if close is not None:
            close()

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        # The front-end rule (LLM, CLI): max_tokens past the context is refused, where the scheduler clamps.
        check_admission(prompt_token_ids, sampling, dataclasses.replace(self.scheduler.config.limits,
                                                                        refuse_overlong_max_tokens=True))
        self.scheduler.submit(request_id, list(prompt_token_ids), sampling)

    def abort(self, request_id: str) -> bool:
        return self.scheduler.abort(request_id)

    def finish_stream(self, stream_id: str, reason: str, stop_reason: str | None = None) -> None:
        self.scheduler.finish(stream_id, reason, stop_reason)

    @property
    def speculation_stats(self) -> SpeculationStats | None:
        """Drafts, accepted tokens, acceptance rate and mean accepted length; None without speculation."""
        return self.scheduler.speculation_stats

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def step(self) -> list[RequestUpdate]:
        if not self.overlap:
            plan = self.scheduler.next_plan()
            if plan.is_empty():
                return []
            return self.scheduler.advance(plan, self._run(plan, None))
        return self._overlapped_step()

    def _run(self, plan: ExecutionPlan, previous: Any) -> ExecutionResult:
        return self.executor.collect(self.executor.launch(plan, previous))

    # ---- overlap scheduling (see the module docstring) ---------------------------------

    def _overlapped_step(self) -> list[RequestUpdate]:
        # A host drafter drafts from the resolved history: nothing would be drafted on placeholders.
        updates = self._resolve_inflight() if self._host_drafts else []
        plan = self.scheduler.next_plan()
        if plan.is_empty():
            return updates + self._resolve_inflight()
        if needs_host_results(plan) or plan.has_drafts:
            # Penalties read the (resolved) history, logprobs need host work, and verify rows advance by
            # what was accepted: this step runs synchronously, after the step in flight is resolved.
            previous = self._inflight
            updates += self._resolve_inflight()
            return updates + self.scheduler.advance(plan, self._run(plan, previous))
        handle = self.executor.launch(plan, self._inflight)
        updates += self._resolve_inflight()
        self.scheduler.advance_provisional(plan)
        self._inflight = handle
        return updates

    def _resolve_inflight(self) -> list[RequestUpdate]:
        """Wait for the step in flight and hand its ids to the scheduler; that step's updates."""
        inflight, self._inflight = self._inflight, None
        return [] if inflight is None else self.scheduler.resolve(self.executor.collect(inflight))
