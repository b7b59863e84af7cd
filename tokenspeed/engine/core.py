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

Structured output (`grammar/`): a constrained request's grammar compiles in
a worker thread from `add_request` on while the scheduler holds the request
(`ready=False`); each step first releases the requests whose grammar is
ready. A step that samples a constrained row runs synchronously, like the
ones above: the matchers take the previous step's tokens, then the step's
masks are filled (`ExecutionPlan.grammar_masks`) and it is launched (the mask
of step N+1 depends on step N's token). Requests whose grammar fails to
compile are reported by `take_failures()`.

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
from typing import TYPE_CHECKING, Any

from tokenspeed.config import EngineConfig
from tokenspeed.engine.model_files import is_preset, resolve_model_folder
from tokenspeed.errors import TokenSpeedError
from tokenspeed.executor.executor import Executor
from tokenspeed.executor.interface import ModelExecutor
from tokenspeed.executor.sampler import needs_host_results
from tokenspeed.kvcache import KVTierConfig
from tokenspeed.scheduler import Scheduler, SchedulerConfig
from tokenspeed.scheduler.admission import check_admission
from tokenspeed.scheduler.plan import ExecutionPlan, ExecutionResult, ExecutorLimits
from tokenspeed.scheduler.sampling_params import SamplingParams
from tokenspeed.scheduler.speculation import SpeculationStats
from tokenspeed.scheduler.updates import RequestUpdate
from tokenspeed.spec.build import speculator_factory
from tokenspeed.spec.config import SpeculativeConfig, parse_speculative_config

if TYPE_CHECKING:
    from tokenspeed.grammar import RequestGrammars

logger = logging.getLogger("tokenspeed.engine")

_DEFAULT_MAX_NUM_BATCHED_TOKENS = 8192
# On a CPU a step's cost grows with its tokens (no idle compute to fill), so a burst of prompts
# prefilled in one 8192-token step stalls every running stream for its whole length: 16 prompts
# of 512 tokens on the embedded model waited 692 ms for their first token, 345 ms at 2048, for
# 5% more tokens/s (benchmarks/results/cpu/cpu_prefill_step_burst.json). vLLM's CPU server
# defaults to 2048. 1024 measured better again behind the HTTP server (vLLM's `bench serve`, 512 in /
# 64 out, two interleaved A/B pairs of 2 rounds): C=16 +3% output tok/s (1602 against 1553 on
# average), mean TTFT 194 against 268 ms; C=4 +5% (953 against 906): a burst's prompts start
# decoding two at a time, and their decode rows ride along in the next prompts' steps
# (benchmarks/results/cpu/vs_vllm/budget_ab.txt).
_DEFAULT_MAX_NUM_BATCHED_TOKENS_CPU = 1024
_GRAMMAR_WAIT_S = 0.002  # an engine with nothing to run but grammars compiling waits this long for one


def _default_max_num_batched_tokens(device: str) -> int:
    return _DEFAULT_MAX_NUM_BATCHED_TOKENS_CPU if device == "cpu" else _DEFAULT_MAX_NUM_BATCHED_TOKENS


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
            if config.tensor_parallel_size > 1:
                from tokenspeed.executor.multi_rank import MultiRankExecutor

                executor = MultiRankExecutor(config, self.model_folder, dummy_weights=preset, progress=progress)
            else:
                executor = Executor(config, self.model_folder, dummy_weights=preset, progress=progress,
                                    speculator=speculator)
        self.executor = executor
        limits = executor.limits
        spec = self.speculative_config
        policy = None if spec is None else spec.draft_policy()
        verify_shape = getattr(executor, "verify_shape", None)  # padded verify rows (a GPU): priced per step
        if policy is not None and verify_shape is not None:
            policy = dataclasses.replace(policy, verify_pad_length=verify_shape[0], max_verify_tokens=verify_shape[1])
        tiers = None
        if limits.kv_layout is not None:
            tiers = KVTierConfig(
                layout=limits.kv_layout,
                host_kv_cache_bytes=limits.host_kv_cache_bytes,
                kv_cache_dir=config.kv_cache_dir if limits.host_kv_cache_bytes else None,
                kv_cache_dir_bytes=config.kv_cache_dir_bytes,
                session_ttl=config.session_ttl,
            )
        self.scheduler = Scheduler(
            SchedulerConfig(
                max_num_seqs=config.max_num_seqs,
                max_num_batched_tokens=config.max_num_batched_tokens or _default_max_num_batched_tokens(limits.device),
                max_model_len=limits.max_model_len,
                page_size=limits.page_size,
                num_pages=limits.num_pages,
                enable_prefix_caching=config.enable_prefix_caching,
                seed=config.seed,
                vocab_size=limits.vocab_size,
                speculation=policy,
                kv_tiers=tiers,
                preemption_mode=config.preemption_mode,
            ),
            None if spec is None else spec.make_drafter(),
        )
        self.overlap = not config.disable_overlap
        self._host_drafts = spec is not None and not spec.drafts_on_device
        self._inflight: Any = None  # the executor's handle of the step launched, advanced on placeholders
        self._grammars: RequestGrammars | None = None  # built by the first constrained request
        self._failures: list[tuple[str, TokenSpeedError]] = []
        self.is_shut_down = False

    @property
    def limits(self) -> ExecutorLimits:
        return self.executor.limits

    def shutdown(self) -> None:
        """Free the executor's device state (weights, KV pool, CUDA graphs); no step runs afterwards."""
        self._inflight = None  # a launched step's handle holds device tensors
        self.is_shut_down = True
        if self._grammars is not None:
            self._grammars.compiler.close()
        close = getattr(self.executor, "close", None)  # a simulated executor holds nothing to free
        if close is not None:
            close()

    def add_request(self, request_id: str, prompt_token_ids: list[int], sampling: SamplingParams) -> None:
        # The front-end rule (LLM, CLI): max_tokens past the context is refused, where the scheduler clamps.
        check_admission(prompt_token_ids, sampling, dataclasses.replace(self.scheduler.config.limits,
                                                                        refuse_overlong_max_tokens=True))
        constrained = sampling.structured_outputs is not None
        self.scheduler.submit(request_id, list(prompt_token_ids), sampling, ready=not constrained)
        if constrained:
            self.grammars.add(request_id, sampling)

    def abort(self, request_id: str) -> bool:
        if self._grammars is not None:
            self._grammars.release(request_id)
        return self.scheduler.abort(request_id)

    def finish_stream(self, stream_id: str, reason: str, stop_reason: str | None = None) -> None:
        self.scheduler.finish(stream_id, reason, stop_reason)

    def take_failures(self) -> list[tuple[str, TokenSpeedError]]:
        """Requests that failed since the last call (their grammar did not compile): each is finished in the
        scheduler; the front end reports the error to its client."""
        failures, self._failures = self._failures, []
        return failures

    @property
    def grammars(self) -> RequestGrammars:
        """The constrained requests' grammars (structured output), built on first use (xgrammar is imported
        only then: front-end processes, which import this module, never load it)."""
        if self._grammars is None:
            from tokenspeed.grammar import GrammarCompiler, RequestGrammars

            compiler = GrammarCompiler(self._load_tokenizer, self.limits.vocab_size)
            self._grammars = RequestGrammars(compiler)
        return self._grammars

    def _load_tokenizer(self) -> Any:
        from tokenspeed.engine.llm import load_tokenizer

        source = self.config.tokenizer or self.model_folder
        return None if source is None else load_tokenizer(source, self.config.trust_remote_code)

    @property
    def speculation_stats(self) -> SpeculationStats | None:
        """Drafts, accepted tokens, acceptance rate and mean accepted length; None without speculation."""
        return self.scheduler.speculation_stats

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished() or self._inflight is not None

    def step(self) -> list[RequestUpdate]:
        self._poll_grammars()
        if not self.overlap:
            plan = self.scheduler.next_plan()
            if plan.is_empty():
                self._wait_for_grammars()
                return []
            return self._run_and_advance(plan, None)
        return self._overlapped_step()

    def _run(self, plan: ExecutionPlan, previous: Any) -> ExecutionResult:
        return self.executor.collect(self.executor.launch(plan, previous))

    def _run_and_advance(self, plan: ExecutionPlan, previous: Any) -> list[RequestUpdate]:
        """Run `plan` synchronously: its grammar masks first, its tokens into the matchers after."""
        grammars = self._grammars
        if grammars is None:
            return self.scheduler.advance(plan, self._run(plan, previous))
        plan.grammar_masks = grammars.masks(plan)
        result = self._run(plan, previous)
        violations = grammars.accept(plan, result)
        updates = self.scheduler.advance(plan, result)
        for request_id, error in violations:
            self._fail(request_id, error)
        return updates

    # ---- structured output ----------------------------------------------------------------

    def _poll_grammars(self) -> None:
        """Release requests whose grammar compiled, fail those whose grammar did not, forget finished ones."""
        grammars = self._grammars
        if grammars is None:
            return
        grammars.prune(lambda request_id: self.scheduler.get(request_id) is not None)
        ready, failed = grammars.poll()
        for request_id in ready:
            self.scheduler.set_ready(request_id)
        for request_id, error in failed:
            self._fail(request_id, error)

    def _fail(self, request_id: str, error: TokenSpeedError) -> None:
        self.scheduler.finish(request_id, "abort")
        self._failures.append((request_id, error))

    def _wait_for_grammars(self) -> None:
        """Nothing to run: if grammars are compiling, block briefly for one instead of spinning."""
        if self._grammars is not None and self._grammars.num_compiling:
            self._grammars.wait(_GRAMMAR_WAIT_S)

    def _constrained(self, plan: ExecutionPlan) -> bool:
        return self._grammars is not None and self._grammars.constrains(plan)

    # ---- overlap scheduling (see the module docstring) ---------------------------------

    def _overlapped_step(self) -> list[RequestUpdate]:
        # A host drafter drafts from the resolved history: nothing would be drafted on placeholders.
        # (When the batch is too large to draft, the step stays overlapped, as without speculation.)
        updates = self._resolve_inflight() if self._host_drafts and self.scheduler.may_draft() else []
        plan = self.scheduler.next_plan()
        if plan.is_empty():
            updates += self._resolve_inflight()
            if not updates:
                self._wait_for_grammars()
            return updates
        if needs_host_results(plan) or plan.has_drafts or self._constrained(plan):
            # Penalties read the (resolved) history, logprobs need host work, verify rows advance by what
            # was accepted, grammar masks need the previous token: this step runs synchronously, after the
            # step in flight is resolved.
            previous = self._inflight
            updates += self._resolve_inflight()
            return updates + self._run_and_advance(plan, previous)
        handle = self.executor.launch(plan, self._inflight)
        updates += self._resolve_inflight()
        self.scheduler.advance_provisional(plan)
        self._inflight = handle
        return updates

    def _resolve_inflight(self) -> list[RequestUpdate]:
        """Wait for the step in flight and hand its ids to the scheduler; that step's updates."""
        inflight, self._inflight = self._inflight, None
        return [] if inflight is None else self.scheduler.resolve(self.executor.collect(inflight))
