"""`LLM`: the offline API, call-compatible with vLLM's `LLM` for the common paths.

    from tokenspeed import LLM, SamplingParams
    llm = LLM("path/to/model")
    outputs = llm.generate(["def fib(n):"], SamplingParams(max_tokens=32))

With no model it serves the embedded tiny model (`models/embedded/`: a small
code model; seeded random weights in a checkout without its trained weights).

`llm.shutdown()`, leaving `with LLM(...) as llm:`, or dropping the last
reference frees the weights, KV pool and CUDA graphs (`Executor.close`), so
a second engine can be built in the same process.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from collections.abc import Sequence
from typing import Any

from tokenspeed.config import EngineConfig
from tokenspeed.engine.control_tokens import ControlTokenGuard, Escapes
from tokenspeed.engine.core import EngineCore
from tokenspeed.engine.model_files import eos_token_ids, load_tokenizer
from tokenspeed.engine.output_processor import OutputProcessor
from tokenspeed.engine.outputs import RequestOutput
from tokenspeed.engine.progress import GenerationProgress
from tokenspeed.engine.segment_cache import DEFAULT_TOKENIZER_CACHE_TOKENS, SegmentTokenCache
from tokenspeed.errors import EngineDead, InvalidRequest, TokenSpeedError
from tokenspeed.models import ModelConfig
from tokenspeed.scheduler.sampling_params import SamplingParams
from tokenspeed.spec.config import speculative_config_dict

PromptInput = str | dict[str, Any]


class EngineStalled(TokenSpeedError):
    """The scheduler produced an empty step while requests were pending: a bug, never a hang."""


class LLM:
    def __init__(
        self,
        model: str | None = None,
        *,
        tokenizer: str | None = None,
        dtype: str = "auto",
        device: str = "auto",
        max_model_len: int | None = None,
        max_num_seqs: int = 256,
        max_num_batched_tokens: int | None = None,
        page_size: int = 16,
        enable_prefix_caching: bool = True,
        load_format: str = "auto",
        seed: int = 0,
        num_kv_pages: int | None = None,
        kv_cache_memory_bytes: int | None = None,
        gpu_memory_utilization: float = 0.9,
        skip_tokenizer_init: bool = False,
        trust_remote_code: bool = False,
        enforce_eager: bool = False,
        cuda_graph_max_bs: int | None = None,
        disable_overlap: bool = False,
        disable_cpu_decode_forward: bool = False,
        disable_cpu_prefill_forward: bool = False,
        disable_cpu_gemm_prepack: bool = False,
        disable_cpu_paged_attention: bool = False,
        disable_cpu_fused_ops: bool = False,
        kernel_overrides: tuple[str, ...] = (),
        cpu_threads: int | None = None,
        speculative_config: dict[str, Any] | str | None = None,
        quantization: str | None = None,
        kv_cache_dtype: str = "auto",
        calculate_kv_scales: bool = False,
        tensor_parallel_size: int = 1,
        enable_expert_parallel: bool = False,
        enable_dp_attention: bool = False,
        show_progress: bool = True,
        # KV tiers (see EngineConfig): host tier bytes, disk tier, session TTL, retract | recompute.
        host_kv_cache_bytes: int | None = None,
        kv_cache_dir: str | None = None,
        kv_cache_dir_bytes: int = 64 * 1024**3,
        session_ttl: float = 300.0,
        preemption_mode: str | None = None,
    ) -> None:
        """`speculative_config`: vLLM's option, a dict or its JSON (e.g. `{"method": "suffix"}`); see
        `tokenspeed.spec.config`. Outputs are those of plain decoding (token for token; with a device
        drafter at temperature > 0, in distribution)."""
        config = EngineConfig(
            model=model,
            tokenizer=tokenizer,
            dtype=dtype,
            device=device,
            max_model_len=max_model_len,
            max_num_seqs=max_num_seqs,
            max_num_batched_tokens=max_num_batched_tokens,
            page_size=page_size,
            enable_prefix_caching=enable_prefix_caching,
            load_format=load_format,
            seed=seed,
            num_kv_pages=num_kv_pages,
            kv_cache_memory_bytes=kv_cache_memory_bytes,
            gpu_memory_utilization=gpu_memory_utilization,
            skip_tokenizer_init=skip_tokenizer_init,
            trust_remote_code=trust_remote_code,
            enforce_eager=enforce_eager,
            cuda_graph_max_bs=cuda_graph_max_bs,
            disable_overlap=disable_overlap,
            disable_cpu_decode_forward=disable_cpu_decode_forward,
            disable_cpu_prefill_forward=disable_cpu_prefill_forward,
            disable_cpu_gemm_prepack=disable_cpu_gemm_prepack,
            disable_cpu_paged_attention=disable_cpu_paged_attention,
            disable_cpu_fused_ops=disable_cpu_fused_ops,
            kernel_overrides=tuple(kernel_overrides),
            cpu_threads=cpu_threads,
            speculative_config=speculative_config_dict(speculative_config),
            quantization=quantization,
            kv_cache_dtype=kv_cache_dtype,
            calculate_kv_scales=calculate_kv_scales,
            host_kv_cache_bytes=host_kv_cache_bytes,
            kv_cache_dir=kv_cache_dir,
            kv_cache_dir_bytes=kv_cache_dir_bytes,
            session_ttl=session_ttl,
            preemption_mode=preemption_mode,
            tensor_parallel_size=tensor_parallel_size,
            enable_expert_parallel=enable_expert_parallel,
            enable_dp_attention=enable_dp_attention,
        )
        self.show_progress = show_progress
        self.core = EngineCore(config, progress=show_progress)
        folder = self.core.model_folder
        assert folder is not None  # the core built its own executor from the model's folder
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(tokenizer or folder, trust_remote_code)
        self.eos_token_ids = eos_token_ids(folder, ModelConfig.from_pretrained(folder), self.tokenizer)
        self._ids = itertools.count()
        self._chat_guard: ControlTokenGuard | None = None

    @classmethod
    def from_config(cls, config: EngineConfig, show_progress: bool = True) -> LLM:
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        fields.pop("enable_kv_cache_events")  # page events are for a router; offline has none
        return cls(**fields, show_progress=show_progress)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # ------------------------------------------------------------------ lifetime

    def shutdown(self) -> None:
        """Free the model's weights, KV pool and CUDA graphs now, so another engine fits in this
        process. The LLM cannot generate afterwards; a second call does nothing. Leaving a
        `with LLM(...) as llm:` block, or dropping the last reference, does the same."""
        core = self.__dict__.get("core")  # absent when __init__ failed before the core existed
        if core is not None:
            core.shutdown()

    def __enter__(self) -> LLM:
        return self

    def __exit__(self, *exc: object) -> None:
        self.shutdown()

    def __del__(self) -> None:
        with contextlib.suppress(Exception):  # at interpreter exit torch may already be torn down
            self.shutdown()

    # ------------------------------------------------------------------ generate

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        if self.core.is_shut_down:
            raise EngineDead("This LLM is shut down; build a new one.")
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompt_list))
        processor = OutputProcessor(self.tokenizer, self.core.finish_stream)
        request_ids: list[str] = []
        budgets: dict[str, int] = {}  # engine request -> most tokens it may generate (the progress bar)
        try:
            for prompt, params in zip(prompt_list, params_list):
                text, token_ids = self._tokenize(prompt)
                if params.n > self.core.config.max_num_seqs:
                    raise InvalidRequest(f"n={params.n} exceeds max_num_seqs={self.core.config.max_num_seqs}.")
                request_id = str(next(self._ids))
                params = dataclasses.replace(params, eos_token_ids=self.eos_token_ids)
                children = processor.add_request(request_id, text, token_ids, params)
                request_ids.append(request_id)
                for child in children:  # n > 1: n requests sharing the prompt (engine/fan_out.py)
                    self.core.add_request(child.request_id, token_ids, child.params)
                    budgets[child.request_id] = child.params.max_tokens or (
                        self.core.limits.max_model_len - len(token_ids)
                    )
            progress = GenerationProgress(budgets, len(request_ids), enabled=use_tqdm and self.show_progress)
            with progress:
                finished = self._run_to_completion(processor, len(request_ids), progress)
        except BaseException:
            for core_id in budgets:  # leave the engine usable: no request of this call lingers
                self.core.abort(core_id)
            raise
        return [finished[request_id] for request_id in request_ids]

    def chat(
        self,
        messages: Sequence[dict[str, Any]] | Sequence[Sequence[dict[str, Any]]],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
        chat_template: str | None = None,
        add_generation_prompt: bool = True,
        tools: list[dict[str, Any]] | None = None,
        chat_template_kwargs: dict[str, Any] | None = None,
    ) -> list[RequestOutput]:
        if self.tokenizer is None:
            raise InvalidRequest("chat() needs a tokenizer; this LLM was built with skip_tokenizer_init.")
        conversations = [messages] if messages and isinstance(messages[0], dict) else messages
        if self._chat_guard is None:  # message text never becomes control tokens, as in the server; the
            # segment cache keeps earlier turns' messages tokenised across calls (an agent loop over chat())
            self._chat_guard = ControlTokenGuard(self.tokenizer, SegmentTokenCache(DEFAULT_TOKENIZER_CACHE_TOKENS))
        guard = self._chat_guard
        prompts: list[PromptInput] = []
        for conversation in conversations:
            escapes = Escapes()
            rendered = self.tokenizer.apply_chat_template(
                guard.escape(list(conversation), escapes),
                tokenize=False,
                add_generation_prompt=add_generation_prompt,
                tools=guard.escape(tools, escapes),
                chat_template=chat_template,
                **guard.escape(chat_template_kwargs or {}, escapes),
            )
            ids = guard.encode(rendered, escapes)
            prompts.append({"prompt": escapes.restore(rendered), "prompt_token_ids": ids})
        return self.generate(prompts, sampling_params, use_tqdm=use_tqdm)

    # ------------------------------------------------------------------ internals

    @staticmethod
    def _params_per_prompt(
        sampling_params: SamplingParams | Sequence[SamplingParams] | None, count: int
    ) -> list[SamplingParams]:
        if sampling_params is None:
            return [SamplingParams()] * count
        if isinstance(sampling_params, SamplingParams):
            return [sampling_params] * count
        params = list(sampling_params)
        if len(params) != count:
            raise InvalidRequest(f"Got {len(params)} sampling params for {count} prompts.")
        return params

    def _tokenize(self, prompt: PromptInput) -> tuple[str | None, list[int]]:
        if isinstance(prompt, str):
            if self.tokenizer is None:
                raise InvalidRequest("Text prompts need a tokenizer; pass {'prompt_token_ids': [...]}.")
            if not prompt:
                raise InvalidRequest("The prompt is empty.")
            return prompt, list(self.tokenizer.encode(prompt))
        if "prompt_token_ids" in prompt:
            ids = prompt["prompt_token_ids"]
            if not isinstance(ids, list) or not all(isinstance(t, int) for t in ids):
                raise InvalidRequest("prompt_token_ids must be a list of integers.")
            return prompt.get("prompt"), list(ids)
        if "prompt" in prompt:
            return self._tokenize(str(prompt["prompt"]))
        raise InvalidRequest("A prompt dict needs 'prompt' or 'prompt_token_ids'.")

    def _run_to_completion(
        self, processor: OutputProcessor, count: int, progress: GenerationProgress
    ) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        while len(finished) < count:
            if not self.core.has_unfinished():
                raise EngineStalled("Requests are pending in the front end but not in the scheduler.")
            updates = self.core.step()
            progress.advance(updates)
            for output in processor.process(updates):
                finished[output.request_id] = output
            for _, error in self.core.take_failures():  # e.g. a grammar that did not compile
                raise error
        return finished
