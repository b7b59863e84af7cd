"""`LLM`: the offline API, call-compatible with vLLM's `LLM` for the common paths.

    from tokenspeed import LLM, SamplingParams
    llm = LLM("path/to/model")
    outputs = llm.generate(["def fib(n):"], SamplingParams(max_tokens=32))

With no model it serves the embedded tiny model (`models/embedded/`: a small
code model; seeded random weights in a checkout without its trained weights).
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from tqdm.auto import tqdm

from tokenspeed.config import EngineConfig
from tokenspeed.engine.control_tokens import ControlTokenGuard, Escapes
from tokenspeed.engine.core import EngineCore
from tokenspeed.engine.output_processor import OutputProcessor
from tokenspeed.engine.outputs import RequestOutput
from tokenspeed.errors import InvalidRequest, TokenSpeedError
from tokenspeed.models import ModelConfig
from tokenspeed.scheduler.sampling_params import SamplingParams
from tokenspeed.spec.config import speculative_config_dict

PromptInput = str | dict[str, Any]
_PROGRESS_MIN_PROMPTS = 8  # a bar for two prompts is noise


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
        enforce_eager: bool = False,
        cuda_graph_max_bs: int | None = None,
        disable_overlap: bool = False,
        kernel_overrides: tuple[str, ...] = (),
        cpu_threads: int | None = None,
        speculative_config: dict[str, Any] | str | None = None,
        show_progress: bool = True,
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
            enforce_eager=enforce_eager,
            cuda_graph_max_bs=cuda_graph_max_bs,
            disable_overlap=disable_overlap,
            kernel_overrides=tuple(kernel_overrides),
            cpu_threads=cpu_threads,
            speculative_config=speculative_config_dict(speculative_config),
        )
        self.show_progress = show_progress
        self.core = EngineCore(config, progress=show_progress)
        folder = self.core.model_folder
        assert folder is not None  # the core built its own executor from the model's folder
        self.tokenizer = None if skip_tokenizer_init else load_tokenizer(tokenizer or folder)
        self.eos_token_ids = _eos_token_ids(folder, ModelConfig.from_pretrained(folder), self.tokenizer)
        self._ids = itertools.count()

    @classmethod
    def from_config(cls, config: EngineConfig, show_progress: bool = True) -> LLM:
        fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
        fields.pop("enable_kv_cache_events")  # page events are for a router; offline has none
        return cls(**fields, show_progress=show_progress)

    def get_tokenizer(self) -> Any:
        return self.tokenizer

    # ------------------------------------------------------------------ generate

    def generate(
        self,
        prompts: PromptInput | Sequence[PromptInput],
        sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
        *,
        use_tqdm: bool = True,
    ) -> list[RequestOutput]:
        prompt_list = [prompts] if isinstance(prompts, (str, dict)) else list(prompts)
        params_list = self._params_per_prompt(sampling_params, len(prompt_list))
        processor = OutputProcessor(self.tokenizer, self.core.finish_stream)
        request_ids: list[str] = []
        core_ids: list[str] = []
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
                    core_ids.append(child.request_id)
            finished = self._run_to_completion(processor, len(request_ids), use_tqdm)
        except BaseException:
            for core_id in core_ids:  # leave the engine usable: no request of this call lingers
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
        guard = ControlTokenGuard(self.tokenizer)  # message text never becomes control tokens, as in the server
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
        self, processor: OutputProcessor, count: int, use_tqdm: bool
    ) -> dict[str, RequestOutput]:
        finished: dict[str, RequestOutput] = {}
        bar = tqdm(
            total=count, desc="Generating", unit="req",
            disable=not (use_tqdm and self.show_progress and count >= _PROGRESS_MIN_PROMPTS),
        )
        with bar:
            while len(finished) < count:
                if not self.core.has_unfinished():
                    raise EngineStalled("Requests are pending in the front end but not in the scheduler.")
                for output in processor.process(self.core.step()):
                    finished[output.request_id] = output
                    bar.update(1)
        return finished


def load_tokenizer(source: str | Path) -> Any:
    """The checkpoint's tokenizer, with no length limit of its own.

    Prompt length is checked against `max_model_len` at admission, with a
    clear error; the tokenizer's `model_max_length` would only add
    transformers' "Token indices sequence length is longer..." warning first.
    """
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(source), model_max_length=sys.maxsize)


def _eos_token_ids(folder: Path, model_config: Any, tokenizer: Any | None) -> tuple[int, ...]:
    """EOS ids from generation_config.json, config.json and the tokenizer: any of them ends a turn."""
    ids: list[int] = []

    def add(value: object) -> None:
        if isinstance(value, int):
            ids.append(value)
        elif isinstance(value, list):
            ids.extend(v for v in value if isinstance(v, int))

    generation_config = Path(folder) / "generation_config.json"
    if generation_config.is_file():
        add(json.loads(generation_config.read_text()).get("eos_token_id"))
    add(getattr(model_config, "eos_token_ids", None) or getattr(model_config, "eos_token_id", None))
    if tokenizer is not None:
        add(tokenizer.eos_token_id)
    return tuple(dict.fromkeys(ids))
