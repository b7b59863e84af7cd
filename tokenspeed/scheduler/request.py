"""`Request`: one generation stream's tokens, progress and FSM state.

The token model is deliberately uniform: `all_tokens = prompt + output`, and
`num_computed_tokens` counts the leading tokens whose K/V are in the
request's pages. A step feeds the next uncomputed slice and samples iff the
slice reaches the end. Prefill, decode, chunked prefill and recompute after
preemption (prompt + outputs so far) are all the same rule, so there is no
special case to get wrong. Decoding <=> exactly one uncomputed token.

A request is one generation stream with one seed: the front end fans an
`n > 1` request out into n of them (`engine/fan_out.py`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, overload

from tokenspeed.kvcache import BlockTable
from tokenspeed.scheduler.fsm import (
    Decoding,
    Event,
    Prefilling,
    State,
    Waiting,
    transition,
)
from tokenspeed.scheduler.sampling_params import SamplingParams

if TYPE_CHECKING:
    from tokenspeed.scheduler.speculation import DraftState


class TokenView(Sequence[int]):
    """prompt + output as one read-only sequence, without concatenating (contexts reach 50K+)."""

    __slots__ = ("_prompt", "_output")

    def __init__(self, prompt: list[int], output: list[int]) -> None:
        self._prompt = prompt
        self._output = output

    def __len__(self) -> int:
        return len(self._prompt) + len(self._output)

    @overload
    def __getitem__(self, index: int) -> int: ...

    @overload
    def __getitem__(self, index: slice) -> list[int]: ...

    def __getitem__(self, index: int | slice) -> int | list[int]:
        num_prompt = len(self._prompt)
        if isinstance(index, slice):
            start, stop, step = index.indices(len(self))
            if step != 1:
                raise ValueError("TokenView slices must be contiguous")
            if stop <= num_prompt:
                return self._prompt[start:stop]
            if start >= num_prompt:
                return self._output[start - num_prompt : stop - num_prompt]
            return self._prompt[start:] + self._output[: stop - num_prompt]
        if index < 0:
            index += len(self)
        if not 0 <= index < len(self):
            raise IndexError("token index out of range")
        return self._prompt[index] if index < num_prompt else self._output[index - num_prompt]


@dataclass(slots=True, eq=False)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling: SamplingParams
    arrival: int  # submission order (unique): the queues' sort key
    seed: int  # the effective seed: sampling.seed, or drawn by the scheduler when that is None
    max_output_tokens: int  # min(max_tokens, max_model_len - prompt length)
    stop_token_ids: frozenset[int]
    output_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_cached_tokens: int = -1  # prefix-cache hit at the first admission; -1 until then
    submitted_at: float = 0.0  # the scheduler's clock at submit
    queue_time_s: float | None = None  # submit to first admission; None until then (reported once)
    prompt_logprobs_next: int = 0  # first prompt position whose logprob was not returned yet
    num_pages_sent: int = 0  # leading pages of the table the executor holds (plans are incremental)
    draft_state: DraftState | None = None  # recent draft acceptance (speculative decoding), once it drafted
    # False while the engine prepares something the request needs before it can run (its grammar, compiled
    # in a thread): admission passes it over, and the requests behind it go ahead.
    ready: bool = True
    state: State = field(default_factory=Waiting)

    # ---- tokens -------------------------------------------------------------------

    @property
    def all_token_ids(self) -> TokenView:
        return TokenView(self.prompt_token_ids, self.output_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def needs_prompt_logprobs(self) -> bool:
        """Prompt logprobs were asked for and some were not returned yet (then no prefix matching)."""
        return (
            self.sampling.prompt_logprobs is not None
            and self.prompt_logprobs_next < self.num_prompt_tokens - 1
        )

    # ---- state --------------------------------------------------------------------

    @property
    def is_running(self) -> bool:
        return isinstance(self.state, (Prefilling, Decoding))

    @property
    def table(self) -> BlockTable:
        state = self.state
        if not isinstance(state, (Prefilling, Decoding)):
            raise AttributeError(f"request {self.request_id} owns no pages in state {type(state).__name__}")
        return state.table

    def apply(self, event: Event) -> list[BlockTable]:
        """Move to the next state; returns the handles the caller must publish/release.

        A retraction the new state gives up (finished while retracted) is discarded here: its
        host copies are worth nothing once the request is gone.
        """
        result = transition(self.state, event)
        self.state = result.state
        if result.retraction is not None:
            result.retraction.discard()
        return result.dropped
