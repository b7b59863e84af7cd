"""The `TokenSpeedScheduler` wire (smg-grpc-proto) to and from the engine's own records.

Requests: a `GenerateRequest` becomes a prompt (token ids; text is tokenised
when only `tokenized.original_text` is given) and a `SamplingParams`. The
proto marks sampling scalars `optional`, so "unset" takes the engine's
default and an explicit 0 stays 0. Grammar constraints (the
`constraint` oneof: `regex`, `json_schema`, `ebnf_grammar`, `structural_tag`,
what smg sends for `response_format` and forced tool calls) become the
request's `StructuredOutputsParams`, and `logit_bias` (token id strings ->
bias) passes through; both are checked like any front end's (a bad schema
is INVALID_ARGUMENT). Fields the engine cannot honour yet (multimodal
inputs, disaggregated KV hand-off, per-token logprob lists) are refused
with a message naming them, never silently dropped.

Responses follow the gateway's reading of the stream: every choice opens
with a `chunk` (even an empty one) when streaming, ends with a `complete`,
and a trailing stop token (EOS or a `stop_token_ids` match) is cut from the
ids unless `no_stop_trim` (it is reported in `matched_token_id` instead).

Errors: each typed engine error is one gRPC status (`status_for`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import grpc
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as pb

from tokenspeed.engine.outputs import PositionLogprobs
from tokenspeed.engine.stream import StreamDelta
from tokenspeed.errors import (
    ContextTooLong,
    EngineDead,
    EngineOverloaded,
    InvalidRequest,
    TokenSpeedError,
)
from tokenspeed.scheduler.sampling_params import SamplingParams
from tokenspeed.scheduler.structured_outputs import StructuredOutputsParams

_MAX_INT64 = 2**63 - 1


def status_for(error: BaseException) -> grpc.StatusCode:
    """The gRPC status of an engine error (the HTTP layer's 400/429/503, in gRPC's words)."""
    if isinstance(error, ContextTooLong):
        return grpc.StatusCode.OUT_OF_RANGE
    if isinstance(error, InvalidRequest):
        return grpc.StatusCode.INVALID_ARGUMENT
    if isinstance(error, EngineOverloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED
    if isinstance(error, EngineDead):
        return grpc.StatusCode.UNAVAILABLE
    if isinstance(error, TokenSpeedError):
        return grpc.StatusCode.FAILED_PRECONDITION
    return grpc.StatusCode.INTERNAL


def _unsupported(request: pb.GenerateRequest) -> str | None:
    """The first field of `request` the engine cannot honour, as a message; None if all are fine."""
    sp = request.sampling_params
    if request.token_ids_logprob:
        return "token_ids_logprob is not supported."
    if request.HasField("mm_inputs") and request.mm_inputs.items:
        return "mm_inputs: this model takes text only."
    if request.HasField("kv_bootstrap_info") or request.HasField("encode_bootstrap_info"):
        return "disaggregated prefill/encode is not supported."
    if request.HasField("data_parallel_rank") and request.data_parallel_rank != 0:
        return f"data_parallel_rank {request.data_parallel_rank}: this server runs one rank (0)."
    if sp.HasField("sampling_seed") and sp.sampling_seed > _MAX_INT64:
        return f"sampling_seed {sp.sampling_seed} does not fit an int64."
    return None


# The proto's constraint fields -> StructuredOutputsParams fields.
_CONSTRAINTS = {"regex": "regex", "json_schema": "json", "ebnf_grammar": "grammar", "structural_tag": "structural_tag"}


def _structured_outputs(sp: pb.SamplingParams) -> StructuredOutputsParams | None:
    constraint = sp.WhichOneof("constraint")
    if constraint is None:
        return None
    if constraint not in _CONSTRAINTS:
        raise InvalidRequest(f"sampling_params.{constraint} is not a constraint this engine knows.")
    return StructuredOutputsParams(**{_CONSTRAINTS[constraint]: getattr(sp, constraint)})


def sampling_params_from_proto(request: pb.GenerateRequest) -> SamplingParams:
    """`SamplingParams` of a `GenerateRequest`; `InvalidRequest` for what cannot be served."""
    problem = _unsupported(request)
    if problem is not None:
        raise InvalidRequest(problem)
    sp = request.sampling_params

    def given(name: str, default: float) -> float:
        return float(getattr(sp, name)) if sp.HasField(name) else default

    logprobs = None
    if request.return_logprob:
        logprobs = max(0, request.top_logprobs_num)
    return SamplingParams(
        n=sp.n or 1,
        temperature=given("temperature", 1.0),
        top_p=given("top_p", 1.0),
        top_k=sp.top_k if sp.HasField("top_k") else 0,
        min_p=given("min_p", 0.0),
        frequency_penalty=given("frequency_penalty", 0.0),
        presence_penalty=given("presence_penalty", 0.0),
        repetition_penalty=given("repetition_penalty", 1.0),
        # Unset: the rest of the context window (the scheduler caps it), as the gateway means it.
        max_tokens=sp.max_new_tokens if sp.HasField("max_new_tokens") else None,
        min_tokens=sp.min_new_tokens,
        stop=list(sp.stop),
        stop_token_ids=list(sp.stop_token_ids),
        ignore_eos=sp.ignore_eos,
        skip_special_tokens=sp.skip_special_tokens,
        seed=sp.sampling_seed if sp.HasField("sampling_seed") else None,
        logprobs=logprobs,
        # The gateway detokenises; text is needed here only to find stop strings.
        detokenize=bool(sp.stop),
        logit_bias=dict(sp.logit_bias) or None,
        structured_outputs=_structured_outputs(sp),
    )


# ---- responses -------------------------------------------------------------------------------


@dataclass(slots=True)
class ChoiceState:
    """What one choice (sample index) of a Generate call has produced so far."""

    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] = field(default_factory=list)
    num_generated: int = 0  # stop token included
    opened: bool = False  # a chunk went out (streaming)


def _kept_ids(delta: StreamDelta, no_stop_trim: bool) -> int:
    """How many of `delta.token_ids` the client gets: all but a trailing matched stop token."""
    ids = delta.token_ids
    stop = delta.stop_reason
    if (
        not no_stop_trim
        and delta.finish_reason == "stop"
        and isinstance(stop, int)
        and ids
        and ids[-1] == stop
    ):
        return len(ids) - 1
    return len(ids)


def _logprobs_proto(
    token_ids: list[int], positions: list[PositionLogprobs], top_n: int
) -> pb.OutputLogProbs | None:
    if not positions:
        return None
    chosen, tops = [], []
    for token_id, position in zip(token_ids, positions):
        entry = position.get(token_id)
        chosen.append(entry.logprob if entry is not None else float("-inf"))
        ranked = sorted(
            ((lp.rank, tid, lp.logprob) for tid, lp in position.items() if lp.rank is not None and lp.rank <= top_n),
        )
        tops.append(pb.TopLogProbs(values=[v for _, _, v in ranked], token_ids=[t for _, t, _ in ranked]))
    return pb.OutputLogProbs(token_logprobs=chosen, token_ids=token_ids, top_logprobs=tops)


@dataclass(slots=True)
class ResponseBuilder:
    """Turns one request's `StreamDelta`s into `GenerateResponse`s (per choice, stream or not)."""

    request_id: str
    num_prompt_tokens: int
    stream: bool
    no_stop_trim: bool
    top_logprobs: int
    choices: dict[int, ChoiceState] = field(default_factory=dict)

    def responses(self, delta: StreamDelta, cached_tokens: int) -> list[pb.GenerateResponse]:
        choice = self.choices.setdefault(delta.index, ChoiceState())
        kept = _kept_ids(delta, self.no_stop_trim)
        new_ids = delta.token_ids[:kept]
        new_logprobs = (delta.logprobs or [])[:kept]
        choice.num_generated += len(delta.token_ids)
        choice.token_ids.extend(new_ids)
        choice.logprobs.extend(new_logprobs)
        out = []
        if self.stream and (new_ids or not choice.opened):
            choice.opened = True
            out.append(
                pb.GenerateResponse(
                    request_id=self.request_id,
                    chunk=pb.GenerateStreamChunk(
                        token_ids=new_ids,
                        prompt_tokens=self.num_prompt_tokens,
                        completion_tokens=choice.num_generated,
                        cached_tokens=cached_tokens,
                        output_logprobs=_logprobs_proto(new_ids, new_logprobs, self.top_logprobs),
                        index=delta.index,
                    ),
                )
            )
        if delta.finish_reason is not None:
            # Streaming: the ids already went out in chunks; the complete carries the last ones
            # again, as the gateway's other engines do, and the gateway reads only the end from it.
            ids = new_ids if self.stream else choice.token_ids
            logprobs = new_logprobs if self.stream else choice.logprobs
            out.append(self._complete(delta, choice, ids, logprobs, cached_tokens))
        return out

    def _complete(
        self,
        delta: StreamDelta,
        choice: ChoiceState,
        ids: list[int],
        logprobs: list[PositionLogprobs],
        cached_tokens: int,
    ) -> pb.GenerateResponse:
        complete = pb.GenerateComplete(
            output_ids=ids,
            finish_reason=delta.finish_reason or "stop",
            prompt_tokens=self.num_prompt_tokens,
            completion_tokens=choice.num_generated,
            cached_tokens=cached_tokens,
            output_logprobs=_logprobs_proto(ids, logprobs, self.top_logprobs),
            index=delta.index,
        )
        if isinstance(delta.stop_reason, int):
            complete.matched_token_id = delta.stop_reason
        elif isinstance(delta.stop_reason, str):
            complete.matched_stop_str = delta.stop_reason
        return pb.GenerateResponse(request_id=self.request_id, complete=complete)
