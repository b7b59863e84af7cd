"""`Sampler`: the engine's one sampling module, for every step on every device.

Each sampling row of a step gives one logits row and a `SampleSpec`; per row,
in this order:

1. raw logprobs: log-softmax of the model's logits, before anything below
   changes them (vLLM's default), kept only when the row asks for logprobs;
2. penalties: repetition over prompt + output, frequency and presence over
   the output (vLLM's rules); they read the row's token history, which the
   plan carries only for such rows;
3. logit bias, then grammar masks (structured output): `logits_processors.py`,
   on the device;
4. min-tokens: the row's stop ids are masked until `min_tokens` are out, so
   min_tokens is honoured, not merely delayed (not on grammar rows: there the
   grammar says when the output may end, and masking its only way out would
   leave nothing to draw);
5. the draw: greedy rows (temperature below `GREEDY_EPSILON`) take the first
   argmax; random rows apply temperature, min-p, top-k, top-p and draw with
   a key mixed from (request seed, sample index) (`kernels/sampling/keys`).

Randomness is keyed, not stateful, so a request produces the same tokens
whatever it is batched with, whenever it is preempted and recomputed.

Where the draw runs: a step without penalties uses the registry's batched
`sampling.sample` kernel on GPUs (Triton: one launch, Philox keyed like the
reference, no vocabulary sort). On the CPU, when only the reference kernel
fits, and on every step with penalties, each random row is drawn by
`draw_row_reference`, the reference kernel's own row routine. Nothing here
reads a value back: `Sampler.launch` returns `Draws` whose ids stay on the
device (the next step reads them there under overlap scheduling) while one
non-blocking copy brings them to the host.

Penalties need the token history on the host, which overlap scheduling
leaves one token behind, and logprobs are host work: the engine runs such
steps synchronously (`needs_host_results`).

Extending it means one more step between 2 and 5 above and a field in
`SampleSpec`, not another sampler; logit bias and grammar masks are such
steps (3). Speculative verification reuses the steps before the draw
(`process`) and the draw (`draw`) per verified position.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace

import torch

from tokenspeed.executor.logits_processors import (
    DeviceGrammarMasks,
    apply_grammar_masks,
    apply_logit_bias,
)
from tokenspeed.executor.logits_processors import upload as _upload
from tokenspeed.kernels import platform_of, select_kernel
from tokenspeed.kernels.sampling.keys import mix_seed
from tokenspeed.kernels.sampling.reference import draw_row_reference
from tokenspeed.scheduler.plan import ExecutionPlan, ScheduledRow, TokenLogprob
from tokenspeed.scheduler.sampling_params import SamplingParams

logger = logging.getLogger("tokenspeed.executor")


@dataclass(slots=True)
class SampleSpec:
    """One draw: the request's parameters, the draw's key, and (for penalties) the request's history."""

    sampling: SamplingParams
    seed: int
    sample_index: int
    prompt_token_ids: Sequence[int] | None = None
    output_token_ids: Sequence[int] | None = None

    @classmethod
    def of_row(cls, row: ScheduledRow) -> SampleSpec:
        return cls(row.sampling, row.seed, row.sample_index, row.prompt_token_ids, row.output_token_ids)


def needs_host_results(plan: ExecutionPlan) -> bool:
    """A step whose sampling reads the host token history (penalties) or that returns logprobs."""
    return any(
        (r.sample and (r.sampling.needs_penalties or r.sampling.logprobs is not None))
        or r.prompt_logprobs_start is not None
        for r in plan.rows
    )


def apply_penalties(logits: torch.Tensor, specs: Sequence[SampleSpec]) -> None:
    """Repetition (prompt + output, HF/vLLM rule), frequency and presence (output only), in place."""
    for i, spec in enumerate(specs):
        params = spec.sampling
        if not params.needs_penalties:
            continue
        if spec.prompt_token_ids is None or spec.output_token_ids is None:
            raise ValueError("a row with penalties must carry its token history (ScheduledRow.prompt_token_ids)")
        row = logits[i]
        if params.repetition_penalty != 1.0:
            seen = torch.tensor(sorted(set(spec.prompt_token_ids) | set(spec.output_token_ids)), dtype=torch.int64)
            seen = seen.to(row.device)
            values = row.index_select(0, seen)
            values = torch.where(values > 0, values / params.repetition_penalty, values * params.repetition_penalty)
            row.index_copy_(0, seen, values)
        if spec.output_token_ids and (params.frequency_penalty or params.presence_penalty):
            out = torch.tensor(spec.output_token_ids, dtype=torch.int64, device=row.device)
            counts = torch.zeros_like(row).index_add_(0, out, torch.ones_like(out, dtype=row.dtype))
            row -= params.frequency_penalty * counts + params.presence_penalty * (counts > 0).to(row.dtype)


def mask_stop_tokens_before_min(logits: torch.Tensor, specs: Sequence[SampleSpec]) -> torch.Tensor:
    """`logits` with each row's stop ids at -inf while it is short of `min_tokens` (a copy; the input
    itself when no row needs it). One indexed write, no host synchronisation."""
    rows: list[int] = []
    cols: list[int] = []
    for i, spec in enumerate(specs):
        if spec.sample_index < spec.sampling.min_tokens and not spec.sampling.needs_grammar:
            for token in sorted(spec.sampling.stop_ids()):
                rows.append(i)
                cols.append(token)
    if not rows:
        return logits
    index = _upload([rows, cols], torch.int64, logits.device)
    masked = logits.clone()
    masked[index[0], index[1]] = float("-inf")
    return masked


def token_logprobs(logprobs: torch.Tensor, token_ids: Sequence[int], top_k: int) -> list[TokenLogprob]:
    """Per row of `logprobs`: the chosen token's logprob, its rank (1 = best) and the top-k alternatives."""
    chosen = torch.tensor(list(token_ids), dtype=torch.int64, device=logprobs.device)
    chosen_lp = logprobs.gather(1, chosen[:, None]).squeeze(1)
    ranks = (logprobs > chosen_lp[:, None]).sum(dim=1) + 1
    k = min(top_k, logprobs.shape[1])
    top_values, top_ids = (torch.topk(logprobs, k, dim=1) if k > 0 else (None, None))
    out: list[TokenLogprob] = []
    chosen_list, ranks_list = chosen_lp.tolist(), ranks.tolist()
    for i, token_id in enumerate(token_ids):
        top: list[tuple[int, float]] = []
        if top_values is not None and top_ids is not None:
            top = list(zip(top_ids[i].tolist(), top_values[i].tolist()))
        out.append(TokenLogprob(token_id=token_id, logprob=chosen_list[i], rank=int(ranks_list[i]), top=top))
    return out


def prompt_token_logprobs(logits: torch.Tensor, targets: Sequence[int], top_k: int) -> list[TokenLogprob]:
    """Logprobs of prompt tokens: logits row j scores `targets[j]` (raw, like sampled-token logprobs)."""
    return token_logprobs(torch.log_softmax(logits.float(), dim=-1), targets, top_k)


class Draws:
    """One step's draws: `ids` on the device at once; on the host, with their logprobs, once fetched."""

    def __init__(self, ids: torch.Tensor, specs: Sequence[SampleSpec], raw_logprobs: torch.Tensor | None) -> None:
        self.ids = ids
        self.specs = specs
        self._raw_logprobs = raw_logprobs
        self._event: torch.cuda.Event | None = None
        self._host = ids
        if ids.is_cuda:
            self._host = torch.empty(len(specs), dtype=torch.int64, pin_memory=True)
            self._host.copy_(ids, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        self._token_ids: list[int] | None = None

    def token_ids(self) -> list[int]:
        """The sampled ids on the host (waits for this step's copy, the step's only synchronisation)."""
        if self._token_ids is None:
            if self._event is not None:
                self._event.synchronize()
            self._token_ids = [int(t) for t in self._host.tolist()]
        return self._token_ids

    def logprobs(self) -> list[TokenLogprob | None]:
        """Per draw, the raw logprob entry of its token (None where the request asked for none)."""
        out: list[TokenLogprob | None] = [None] * len(self.specs)
        if self._raw_logprobs is None:
            return out
        tokens = self.token_ids()
        for i, spec in enumerate(self.specs):
            if spec.sampling.logprobs is not None:
                raw = self._raw_logprobs[i : i + 1]
                out[i] = token_logprobs(raw, [tokens[i]], spec.sampling.logprobs)[0]
        return out


@dataclass(slots=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]


BatchedSampleKernel = Callable[..., torch.Tensor]
ArgmaxKernel = Callable[[torch.Tensor], torch.Tensor]


@dataclass(frozen=True, slots=True)
class _PlatformKernels:
    sample: BatchedSampleKernel | None  # None where only the (host-syncing) reference fits: row by row instead
    argmax: ArgmaxKernel


class Sampler:
    """Turns one logits row per `SampleSpec` into a token id (see the module docstring)."""

    def __init__(self, device: torch.device | None = None) -> None:
        """`device`: choose its platform's kernels now, under the engine's kernel overrides (the engine builds
        its sampler inside `scoped_kernel_overrides`); other platforms' are chosen at their first step."""
        self._kernels: dict[str, _PlatformKernels] = {}
        if device is not None:
            self._kernels_of(device)

    def __call__(self, logits: torch.Tensor, specs: Sequence[SampleSpec]) -> SamplerOutput:
        """Sample and wait: the ids and logprobs on the host."""
        draws = self.launch(logits, specs)
        return SamplerOutput(draws.token_ids(), draws.logprobs())

    def launch(
        self, logits: torch.Tensor, specs: Sequence[SampleSpec], grammar_masks: DeviceGrammarMasks | None = None
    ) -> Draws:
        """Sample `logits` `[len(specs), vocab]` without waiting for the device; `grammar_masks` address
        rows of `logits`."""
        processed, raw = self.process(logits, specs, grammar_masks)
        return Draws(self.draw(processed, specs), specs, raw)

    def process(
        self, logits: torch.Tensor, specs: Sequence[SampleSpec], grammar_masks: DeviceGrammarMasks | None = None
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Every step of the module docstring but the draw: (fp32 logits the draw reads, raw logprobs or None).

        Speculative verification (`spec/`) runs every verified position through
        this with a spec of its own (history + the drafts before it, sample
        index + i) and the grammar mask of that position, so a drafted position
        sees exactly what the plain sampler would have seen there.
        """
        logits = logits.float()
        raw = torch.log_softmax(logits, dim=-1) if any(s.sampling.logprobs is not None for s in specs) else None
        penalties = any(s.sampling.needs_penalties for s in specs)
        if penalties or grammar_masks is not None or any(s.sampling.logit_bias for s in specs):
            logits = logits.clone()  # the caller's logits (a CUDA graph's output) stay as they are
        if penalties:
            apply_penalties(logits, specs)
        apply_logit_bias(logits, specs)
        if grammar_masks is not None:
            apply_grammar_masks(logits, grammar_masks)
        return mask_stop_tokens_before_min(logits, specs), raw

    def draw(self, logits: torch.Tensor, specs: Sequence[SampleSpec]) -> torch.Tensor:
        """The draw: one token per row of processed logits (`process`), on the device."""
        return self._draw(logits, specs, row_by_row=any(s.sampling.needs_penalties for s in specs))

    def _draw(self, logits: torch.Tensor, specs: Sequence[SampleSpec], *, row_by_row: bool) -> torch.Tensor:
        random_rows = [i for i, s in enumerate(specs) if not s.sampling.greedy]
        kernels = self._kernels_of(logits.device)
        batched = None if row_by_row or not random_rows else kernels.sample
        if batched is not None:
            d = logits.device
            params = [s.sampling for s in specs]
            try:
                return batched(
                    logits,
                    _upload([p.temperature for p in params], torch.float32, d),
                    _upload([p.top_k for p in params], torch.int32, d),
                    _upload([p.top_p for p in params], torch.float32, d),
                    _upload([p.min_p for p in params], torch.float32, d),
                    _upload([s.seed for s in specs], torch.int64, d),
                    _upload([s.sample_index for s in specs], torch.int64, d),
                )
            except Exception:  # e.g. a kernel that fails to compile here: sample row by row instead
                logger.warning("batched sampling kernel failed; falling back to per-row sampling", exc_info=True)
                kernels = self._kernels[platform_of(d)] = replace(kernels, sample=None)
        tokens = kernels.argmax(logits)
        if random_rows:
            tokens = tokens.clone()
            for i in random_rows:
                p = specs[i].sampling
                tokens[i] = draw_row_reference(
                    logits[i], temperature=p.temperature, top_k=p.top_k, top_p=p.top_p, min_p=p.min_p,
                    key=mix_seed(specs[i].seed, specs[i].sample_index),
                )
        return tokens

    def argmax(self, logits: torch.Tensor) -> torch.Tensor:
        """Each row's first argmax, int64 on the device: the greedy draw (`sampling.argmax`; on GPUs one Triton
        launch, `--kernel sampling.argmax=reference` for torch's two-stage reduction)."""
        return self._kernels_of(logits.device).argmax(logits)

    def _kernels_of(self, device: torch.device) -> _PlatformKernels:
        platform = platform_of(device)
        kernels = self._kernels.get(platform)
        if kernels is None:
            sample: BatchedSampleKernel | None = None
            if platform != "cpu":
                try:
                    spec = select_kernel("sampling", "sample", platform=platform)
                    sample = None if spec.name == "reference" else spec.impl
                except LookupError:
                    sample = None
            argmax = select_kernel("sampling", "argmax", platform=platform).impl
            kernels = self._kernels[platform] = _PlatformKernels(sample, argmax)
        return kernels
