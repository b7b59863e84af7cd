"""The progress bar of `LLM.generate`, counted in output tokens.

A bar of requests says nothing while one long generation runs (it sits at
0/1), so the bar counts tokens: its total is every request's token budget
(`max_tokens`, or what the context leaves), each step advances it by the
tokens generated, and a request that ends early (EOS, a stop string) hands
back the rest of its budget at once. The rate is then output tokens per
second, and the bar ends full.

When it shows: at once for 8 prompts or more; for fewer, only once the call
has run `DELAY_S` seconds, so a quick call prints nothing while a long one
still shows it is alive.
"""

from __future__ import annotations

from types import TracebackType

from tqdm.auto import tqdm

from tokenspeed.scheduler.updates import RequestUpdate

MIN_PROMPTS_AT_ONCE = 8
DELAY_S = 2.0


class GenerationProgress:
    def __init__(self, budgets: dict[str, int], num_prompts: int, *, enabled: bool) -> None:
        """`budgets`: the most tokens each engine request (an n > 1 child each) may generate."""
        self._left = dict(budgets)
        self._bar = tqdm(
            total=sum(budgets.values()),
            desc=f"Generating ({num_prompts} prompt{'s' if num_prompts != 1 else ''})",
            unit="tok",
            delay=0.0 if num_prompts >= MIN_PROMPTS_AT_ONCE else DELAY_S,
            disable=not enabled,
        )

    def advance(self, updates: list[RequestUpdate]) -> None:
        done = 0
        for update in updates:
            left = self._left.get(update.request_id, 0)
            used = left if update.finished else min(left, len(update.new_token_ids))
            self._left[update.request_id] = left - used
            done += used
        if done:
            self._bar.update(done)

    def __enter__(self) -> GenerationProgress:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self._bar.close()
