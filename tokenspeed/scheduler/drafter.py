"""`Drafter`: what the scheduler asks of a host-side drafter (n-gram, suffix).

A host drafter proposes up to k next tokens of a request from text it has
seen; the target model verifies them in one forward pass (`spec/verify.py`).
It never decides what is emitted, so a bad proposal costs compute, never
correctness: outputs with speculation on equal outputs with it off.

The scheduler owns the drafter and calls it from `next_plan` for decode rows
whose history is fully known (no overlap placeholder at the end):

* `propose(request_id, prompt, output, max_tokens)` hands over the request's
  whole history each time; the drafter remembers how much of it it has
  indexed and indexes only the new tail (accepted tokens since the last call:
  that is how it learns from accepted outputs), so the cost per step is
  O(new tokens + k), never O(context);
* `release(request_id, prompt, output)` says the request is gone (finished
  or aborted): the drafter drops its per-request state and may keep what it
  learnt (the suffix drafter adds the output to its corpus of recent outputs).
  A preempted request is not released: its tokens do not change.

Drafters that run on the device (EAGLE, MTP, a draft model) are not objects
the scheduler calls: the plan asks the executor for k drafts per row
(`ScheduledRow.num_draft_tokens` with no `draft_token_ids`).

The scheduler defines the interface it calls; `spec/` implements it (import order: scheduler < spec).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol


class Drafter(Protocol):
    @property
    def method(self) -> str:
        """The `speculative_config` method this drafter implements (a metrics label)."""
        ...

    def propose(
        self, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int], max_tokens: int
    ) -> list[int]:
        """Up to `max_tokens` tokens likely to follow prompt + output (possibly none)."""
        ...

    def release(self, request_id: str, prompt_token_ids: Sequence[int], output_token_ids: Sequence[int]) -> None:
        """The request finished or was aborted with these tokens; forget its per-request state."""
        ...
