"""`n > 1` as fan-out: one user request becomes n single-sample requests to the core.

The scheduler knows only single-sample requests. A request for n samples is
split here, in the front end (`LLM`, `AsyncEngine`), into n children that the
core schedules like any others; they share the prompt's KV pages through the
prefix cache (the scheduler indexes a row's pages when it schedules it, so
children admitted in the same step compute the prompt's full pages once). The
`OutputProcessor` regroups the children's outputs by index under the parent.

Children's ids are derived from the parent's (`f"{parent}#{index}"`; n = 1
keeps the id as it is), so aborting the parent aborts the children by name.
Child i samples with seed `seed + i` (when a seed is given): the same draws
the scheduler used to give its i-th fork, so a seeded `n > 1` request returns
the same n outputs it did when the scheduler forked it
(`tests/test_n_samples_fixture.py`). An unseeded child gets its own seed from
the scheduler's generator. Only child 0 returns prompt logprobs (they are
the parent's, one set); the others are then free to take the prompt's pages
from the cache, which a request that scores its prompt cannot.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from tokenspeed.scheduler.sampling_params import SamplingParams


@dataclass(frozen=True, slots=True)
class ChildRequest:
    """One sample of a user request, as the core sees it."""

    request_id: str
    index: int  # position among the parent's n outputs
    params: SamplingParams  # n = 1


def fan_out(parent_id: str, params: SamplingParams) -> list[ChildRequest]:
    """The n core requests of `parent_id`, in index order."""
    n = params.n
    if n == 1:
        return [ChildRequest(parent_id, 0, params)]
    return [
        ChildRequest(
            f"{parent_id}#{i}",
            i,
            dataclasses.replace(
                params,
                n=1,
                seed=None if params.seed is None else params.seed + i,
                prompt_logprobs=params.prompt_logprobs if i == 0 else None,
            ),
        )
        for i in range(n)
    ]
