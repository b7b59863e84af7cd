"""Turns the core's per-request token updates into user-facing `RequestOutput`s.

It owns the text side of a request: detokenisers, stop strings and logprob
decoding. When a stop string appears it tells the core to finish that stream,
so the stream's KV pages are freed at once rather than after `max_tokens`.

It is also where `n > 1` fan-out is undone: `add_request` returns the n child
requests to send to the core (`engine/fan_out.py`), and their updates are
regrouped by index under the parent, which finishes when every child has. The
parent's `num_cached_tokens` is child 0's (admitted first, so it is what the
cache held for this prompt before the request came; the other children
mostly hit the pages child 0 computes).

Two ways out: `process` returns whole `RequestOutput`s of finished requests
(the offline `LLM`); `process_deltas` returns what is new since the last call
(`AsyncEngine` streaming). Both read the same state, so streamed and
non-streamed outputs cannot drift apart; streamed text leaves out a tail that
a stop string might still cut (`IncrementalDetokenizer.stable_length`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from tokenspeed.engine.detokenizer import IncrementalDetokenizer
from tokenspeed.engine.fan_out import ChildRequest, fan_out
from tokenspeed.engine.outputs import CompletionOutput, Logprob, PositionLogprobs, RequestOutput
from tokenspeed.engine.stream import RequestDelta, StreamDelta
from tokenspeed.errors import InvalidRequest
from tokenspeed.scheduler.plan import TokenLogprob
from tokenspeed.scheduler.sampling_params import SamplingParams
from tokenspeed.scheduler.updates import RequestUpdate

FinishStream = Callable[[str, str, str], None]  # (core request id, reason, stop string)


@dataclass(slots=True)
class _Stream:
    output: CompletionOutput
    detokenizer: IncrementalDetokenizer | None
    # How much of `output` the streaming side has handed out already.
    sent_text: int = 0
    sent_tokens: int = 0
    sent_finish: bool = False


@dataclass(slots=True)
class _RequestState:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    sampling: SamplingParams
    children: list[ChildRequest]
    streams: dict[int, _Stream] = field(default_factory=dict)
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0
    sent_prompt_logprobs: bool = False
    queue_time_s: float | None = None  # child 0's, as num_cached_tokens
    sent_queue_time: bool = False

    def finished(self) -> bool:
        return len(self.streams) == self.sampling.n and all(
            s.output.finish_reason is not None for s in self.streams.values()
        )


class OutputProcessor:
    def __init__(self, tokenizer: Any | None, finish_stream: FinishStream) -> None:
        self.tokenizer = tokenizer
        self.finish_stream = finish_stream
        self._requests: dict[str, _RequestState] = {}
        self._children: dict[str, tuple[_RequestState, int]] = {}  # core request id -> (parent, index)

    def add_request(
        self, request_id: str, prompt: str | None, prompt_token_ids: list[int], sampling: SamplingParams
    ) -> list[ChildRequest]:
        """Track a request; returns the requests to send to the core (n of them for n > 1)."""
        children = fan_out(request_id, sampling)
        taken = [c.request_id for c in children if c.request_id in self._children]
        if request_id in self._requests or taken:
            raise InvalidRequest(f"Request id {request_id!r} (n={sampling.n}) collides with a live request's ids.")
        state = _RequestState(request_id, prompt, list(prompt_token_ids), sampling, children)
        if sampling.prompt_logprobs is not None:
            state.prompt_logprobs = [None]  # the first prompt token has no logprob
        self._requests[request_id] = state
        for child in children:
            self._children[child.request_id] = (state, child.index)
        return children

    def has_request(self, request_id: str) -> bool:
        return request_id in self._requests

    def parent_of(self, core_request_id: str) -> str | None:
        """The live request a core request id is a child of, if any."""
        child = self._children.get(core_request_id)
        return None if child is None else child[0].request_id

    def core_request_ids(self, request_id: str) -> list[str]:
        """The ids the core knows a live request by (its children); empty if it is not live."""
        state = self._requests.get(request_id)
        return [] if state is None else [c.request_id for c in state.children]

    def abort(self, request_id: str) -> RequestOutput | None:
        state = self._pop_aborted(request_id)
        return None if state is None else self._snapshot(state, finished=True)

    def abort_delta(self, request_id: str) -> RequestDelta | None:
        """Forget a request; its last delta (the held-back text, finish_reason "abort") if it was live."""
        state = self._pop_aborted(request_id)
        return None if state is None else self._delta(state)

    def process(self, updates: list[RequestUpdate]) -> list[RequestOutput]:
        """Apply one step's updates; return the requests they finished."""
        finished = []
        for state in self._apply_all(updates):
            if state.finished():
                finished.append(self._snapshot(state, finished=True))
                self._forget(state)
        return finished

    def process_deltas(self, updates: list[RequestUpdate]) -> list[RequestDelta]:
        """Apply one step's updates; return what each touched request has new (finished ones are forgotten)."""
        deltas = []
        for state in self._apply_all(updates):
            delta = self._delta(state)
            if state.finished():
                self._forget(state)
            if delta is not None:
                deltas.append(delta)
        return deltas

    def _apply_all(self, updates: list[RequestUpdate]) -> list[_RequestState]:
        touched: dict[str, _RequestState] = {}
        for update in updates:
            child = self._children.get(update.request_id)
            if child is None:
                continue  # aborted by the front end while the step ran
            state, index = child
            self._apply(state, index, update)
            touched[state.request_id] = state
        return list(touched.values())

    def _forget(self, state: _RequestState) -> None:
        del self._requests[state.request_id]
        for child in state.children:
            del self._children[child.request_id]

    def _pop_aborted(self, request_id: str) -> _RequestState | None:
        state = self._requests.get(request_id)
        if state is None:
            return None
        self._forget(state)
        for index in range(state.sampling.n):
            stream = self._stream(state, index)
            if stream.output.finish_reason is None:
                stream.output.finish_reason = "abort"
        return state

    def _delta(self, state: _RequestState) -> RequestDelta | None:
        """What `state` has that was not handed out yet; None if nothing."""
        deltas: list[StreamDelta] = []
        started = False
        for index, stream in sorted(state.streams.items()):
            out = stream.output
            started = started or bool(out.token_ids)
            done = out.finish_reason is not None
            end = len(out.text)
            if not done and stream.detokenizer is not None:
                end = stream.detokenizer.stable_length()
            text = out.text[stream.sent_text : end] if end > stream.sent_text else ""
            new_tokens = out.token_ids[stream.sent_tokens :]
            if not text and not new_tokens and (not done or stream.sent_finish):
                continue
            logprobs = out.logprobs[stream.sent_tokens :] if out.logprobs is not None else None
            stream.sent_text = max(stream.sent_text, end)
            stream.sent_tokens = len(out.token_ids)
            stream.sent_finish = done
            deltas.append(
                StreamDelta(
                    index,
                    text,
                    new_tokens,
                    logprobs,
                    out.finish_reason if done else None,
                    out.stop_reason if done else None,
                )
            )
        finished = state.finished()
        prompt_logprobs = None
        if state.prompt_logprobs is not None and not state.sent_prompt_logprobs and (started or finished):
            prompt_logprobs = list(state.prompt_logprobs)
            state.sent_prompt_logprobs = True
        if not deltas and prompt_logprobs is None:
            return None
        queue_time = None
        if state.queue_time_s is not None and not state.sent_queue_time:
            queue_time, state.sent_queue_time = state.queue_time_s, True
        return RequestDelta(
            request_id=state.request_id,
            deltas=deltas,
            prompt_token_ids=state.prompt_token_ids,
            num_cached_tokens=state.num_cached_tokens,
            prompt_logprobs=prompt_logprobs,
            finished=finished,
            queue_time_s=queue_time,
        )

    def _stream(self, state: _RequestState, index: int) -> _Stream:
        stream = state.streams.get(index)
        if stream is None:
            params = state.sampling
            detokenizer = None
            if self.tokenizer is not None and params.detokenize:
                detokenizer = IncrementalDetokenizer(
                    self.tokenizer,
                    state.prompt_token_ids,
                    skip_special_tokens=params.skip_special_tokens,
                    stop=list(params.stop or []),
                    include_stop_str_in_output=params.include_stop_str_in_output,
                )
            logprobs: list[PositionLogprobs] | None = [] if params.logprobs is not None else None
            cumulative = 0.0 if params.logprobs is not None else None
            output = CompletionOutput(index, "", [], cumulative, logprobs)
            stream = state.streams[index] = _Stream(output, detokenizer)
        return stream

    def _apply(self, state: _RequestState, index: int, update: RequestUpdate) -> None:
        if index == 0:
            state.num_cached_tokens = max(state.num_cached_tokens, update.num_cached_tokens)
            if update.queue_time_s is not None:
                state.queue_time_s = update.queue_time_s
            if update.new_prompt_logprobs and state.prompt_logprobs is not None:
                state.prompt_logprobs.extend(self._decode_logprobs(p) for p in update.new_prompt_logprobs)
        stream = self._stream(state, index)
        out = stream.output
        if out.finish_reason is not None:
            return  # finished by a stop string already; late tokens of the same step are dropped
        tokens = update.new_token_ids
        match = None
        if stream.detokenizer is not None:
            # A step may bring several tokens (speculative decoding): the burst ends at the token that
            # completes a stop string, as it would have one token at a time.
            for end, token in enumerate(tokens, start=1):
                match = stream.detokenizer.push([token])
                if match is not None:
                    tokens = tokens[:end]
                    break
            out.text = stream.detokenizer.text
        out.token_ids.extend(tokens)
        if update.new_logprobs and out.logprobs is not None:
            for entry in update.new_logprobs[: len(tokens)]:
                out.logprobs.append(self._decode_logprobs(entry))
                out.cumulative_logprob = (out.cumulative_logprob or 0.0) + entry.logprob
        if match is not None:
            out.finish_reason, out.stop_reason = "stop", match.stop
            if not update.finished:
                self.finish_stream(update.request_id, "stop", match.stop)
            return
        if update.finished:
            out.finish_reason, out.stop_reason = update.finish_reason, update.stop_reason

    def _decode_logprobs(self, entry: TokenLogprob) -> PositionLogprobs:
        position: PositionLogprobs = {}
        for rank, (token_id, logprob) in enumerate(entry.top, start=1):
            position[token_id] = Logprob(logprob, rank, self._piece(token_id))
        if entry.token_id not in position:
            position[entry.token_id] = Logprob(entry.logprob, entry.rank, self._piece(entry.token_id))
        else:
            position[entry.token_id].rank = entry.rank
        return position

    def _piece(self, token_id: int) -> str | None:
        if self.tokenizer is None:
            return None
        piece: str = self.tokenizer.decode([token_id])
        return piece

    @staticmethod
    def _snapshot(state: _RequestState, *, finished: bool) -> RequestOutput:
        outputs = [
            CompletionOutput(
                s.output.index,
                s.output.text,
                list(s.output.token_ids),
                s.output.cumulative_logprob,
                list(s.output.logprobs) if s.output.logprobs is not None else None,
                s.output.finish_reason,
                s.output.stop_reason,
            )
            for _, s in sorted(state.streams.items())
        ]
        return RequestOutput(
            request_id=state.request_id,
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
            prompt_logprobs=list(state.prompt_logprobs) if state.prompt_logprobs is not None else None,
            outputs=outputs,
            finished=finished,
            num_cached_tokens=state.num_cached_tokens,
            metrics={} if state.queue_time_s is None else {"time_in_queue": state.queue_time_s},
        )
