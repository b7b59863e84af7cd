"""Length and timing distributions of coding-agent traffic.

Each distribution is fitted to quantiles published for coding-agent sessions
(rather than to a mean), because the tails are what stress a server: one 20K
token tool output in a batch of 900-token ones decides the prefill stall that
every running decode feels.  A lognormal is pinned by its median and one upper
quantile: ``mu = ln(median)``, ``sigma = ln(q / median) / z(q)``.

All draws take an explicit `random.Random`, so a workload is a pure function
of its seed.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

Z90 = 1.2815515655446004  # standard normal quantile at 0.90


@dataclass(slots=True, frozen=True)
class LogNormal:
    """Lognormal pinned by its median and its 90th percentile, clipped to [low, high]."""

    median: float
    p90: float
    low: int = 1
    high: int = 1 << 30

    @property
    def sigma(self) -> float:
        return math.log(self.p90 / self.median) / Z90

    def quantile(self, z: float) -> float:
        """Unclipped value at standard-normal quantile `z` (for tests and docs)."""
        return self.median * math.exp(self.sigma * z)

    def sample(self, rng: random.Random) -> int:
        value = rng.lognormvariate(math.log(self.median), self.sigma)
        return int(min(max(round(value), self.low), self.high))


# Tool output appended per turn: median ~900, p90 ~5K, p99 ~20K tokens (the
# p99 follows from the first two: 900 * exp(2.326 * 1.338) ~= 20.3K).
TOOL_OUTPUT_TOKENS = LogNormal(median=900, p90=5000, low=8, high=32768)
# Model reply per turn: median ~220, p90 ~1.5K tokens.
REPLY_TOKENS = LogNormal(median=220, p90=1500, low=4, high=16384)
# First user message (the task statement).
TASK_TOKENS = LogNormal(median=300, p90=900, low=32, high=4096)
# Shared system + tool-schema prefix, one per workload.
PREFIX_TOKENS_RANGE = (12_000, 24_000)


@dataclass(slots=True, frozen=True)
class TurnCount:
    """Turns per session: 10 + a lognormal tail, capped at 40 (median ~16, p90 ~29)."""

    minimum: int = 10
    maximum: int = 40
    extra: LogNormal = LogNormal(median=6, p90=19, low=0, high=1 << 30)

    def sample(self, rng: random.Random) -> int:
        return min(self.minimum + self.extra.sample(rng), self.maximum)


TURNS = TurnCount()

# Gap between a reply and the next turn (the tool running, or the agent
# thinking): 86% under 1 s, 95% under 10 s, ~4% over a minute.  A mixture of
# log-uniform bands reproduces those three published points exactly, which a
# single lognormal cannot (the mass is bimodal: instant tools vs. test runs).
GAP_BANDS: tuple[tuple[float, float, float], ...] = (
    # (probability, low seconds, high seconds)
    (0.86, 0.05, 1.0),
    (0.09, 1.0, 10.0),
    (0.01, 10.0, 60.0),
    (0.04, 60.0, 300.0),
)


def sample_gap_s(rng: random.Random) -> float:
    """Seconds the agent is away between receiving a reply and sending the next turn."""
    pick = rng.random()
    cumulative = 0.0
    for probability, low, high in GAP_BANDS:
        cumulative += probability
        if pick < cumulative:
            return math.exp(rng.uniform(math.log(low), math.log(high)))
    _, low, high = GAP_BANDS[-1]
    return math.exp(rng.uniform(math.log(low), math.log(high)))
