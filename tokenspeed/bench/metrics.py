"""Per-concurrency-point metrics: the two Pareto axes and the latency tails behind them.

Definitions (the figure of merit is TPM/GPU while every user keeps >= 70 TPS):

* TPS/user = 1000 / mean TPOT in ms, TPOT averaged over requests (each
  request counts once, whatever its length, as each user does).
* output tokens/s, tokens/min/GPU: server-counted tokens over the point's wall
  time (first send to last reply, think time included: an agent fleet pays
  for it too), divided by `gpus`.  "Total" counts prompt + output tokens.
* cache hit rate = cached prompt tokens / prompt tokens, from usage.
* p50/p90/p99 by linear interpolation between order statistics (numpy's
  default), so small samples give stable, comparable numbers.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import asdict, dataclass

from tokenspeed.bench.client import RequestRecord

PERCENTILES = (50, 90, 99)
LATENCIES = ("ttft", "itl", "tpot", "e2e")


def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0-100) with linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    ordered = sorted(values)
    rank = (len(ordered) - 1) * q / 100.0
    low = math.floor(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else math.nan


@dataclass(slots=True)
class PointMetrics:
    """One row of results: a concurrency point of one labelled run."""

    concurrency: int
    sessions: int
    requests: int
    errors: int
    duration_s: float
    prompt_tokens: int
    cached_tokens: int
    output_tokens: int
    tps_per_user: float
    output_tokens_per_s: float
    total_tpm_per_gpu: float
    output_tpm_per_gpu: float
    request_throughput: float
    cache_hit_rate: float
    latency_ms: dict[str, dict[str, float]]  # "ttft" -> {"mean", "p50", "p90", "p99"}

    def flat(self) -> dict[str, float | int]:
        """Columns for CSV/JSON: latencies become `ttft_p90_ms` and so on."""
        row = asdict(self)
        latency = row.pop("latency_ms")
        for name in LATENCIES:
            for stat, value in latency[name].items():
                row[f"{name}_{stat}_ms"] = value
        return row


def _stats_ms(values_s: Sequence[float]) -> dict[str, float]:
    values = [v * 1000.0 for v in values_s]
    stats = {"mean": mean(values)}
    stats.update({f"p{q}": percentile(values, q) for q in PERCENTILES})
    return stats


def summarize(
    records: Sequence[RequestRecord], concurrency: int, sessions: int, duration_s: float, gpus: int = 1
) -> PointMetrics:
    """Aggregate the requests of one point; failed requests count only as errors."""
    ok = [r for r in records if r.ok]
    prompt = sum(r.prompt_tokens for r in ok)
    cached = sum(r.cached_tokens for r in ok)
    output = sum(r.output_tokens for r in ok)
    tpots = [t for r in ok if (t := r.tpot_s) is not None]
    latencies = {
        "ttft": [r.ttft_s for r in ok if r.ttft_s is not None],
        "itl": [gap for r in ok for gap in r.itl_s],
        "tpot": tpots,
        "e2e": [r.e2e_s for r in ok],
    }
    mean_tpot_ms = mean(tpots) * 1000.0
    per_s = 1.0 / duration_s if duration_s > 0 else math.nan
    return PointMetrics(
        concurrency=concurrency,
        sessions=sessions,
        requests=len(records),
        errors=len(records) - len(ok),
        duration_s=duration_s,
        prompt_tokens=prompt,
        cached_tokens=cached,
        output_tokens=output,
        tps_per_user=1000.0 / mean_tpot_ms if mean_tpot_ms > 0 else math.nan,
        output_tokens_per_s=output * per_s,
        total_tpm_per_gpu=(prompt + output) * per_s * 60.0 / gpus,
        output_tpm_per_gpu=output * per_s * 60.0 / gpus,
        request_throughput=len(ok) * per_s,
        cache_hit_rate=cached / prompt if prompt else 0.0,
        latency_ms={name: _stats_ms(values) for name, values in latencies.items()},
    )
