"""Prometheus metrics of the server: engine gauges/counters and per-request latencies.

Engine-side numbers (running/waiting requests, KV pages, token totals) are
read from `engine.stats()` at scrape time by a custom collector, so they are
never stale and cost nothing between scrapes. Latencies are only visible
here, where the client's clock starts: TTFT runs from the request's arrival
to its first token (the queue time, measured by the scheduler from submit to
first admission, is the part of it spent waiting for a slot or pages),
inter-token latency is observed once per token (a step that delivers k
tokens, e.g. speculative decoding, counts k gaps of 1/k), and end-to-end
latency runs to the last token. Each app has its own registry, so
several apps (tests) never collide in the global one.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from tokenspeed.api.engine_client import EngineClient
from tokenspeed.engine.stream import EngineStats

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
_LATENCY_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0, 20.0)
_E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0, 320.0, 640.0)
_QUEUE_BUCKETS = (0.001, 0.005, 0.01, 0.025, 0.05, *_E2E_BUCKETS)


class _EngineCollector(Collector):
    def __init__(self, engine: EngineClient) -> None:
        self.engine = engine

    def collect(self) -> Iterator[Metric]:
        stats = self.engine.stats()
        yield GaugeMetricFamily("tokenspeed_num_requests_running", "Requests being prefilled or decoded.",
                                value=stats.num_running)
        yield GaugeMetricFamily("tokenspeed_num_requests_waiting", "Requests queued for admission.",
                                value=stats.num_waiting)
        pages = GaugeMetricFamily("tokenspeed_kv_cache_pages", "KV cache pages by state.", labels=["state"])
        pages.add_metric(["free"], stats.kv_pages_free)
        pages.add_metric(["referenced"], stats.kv_pages_referenced)
        pages.add_metric(["cached"], stats.kv_pages_cached)
        yield pages
        yield GaugeMetricFamily("tokenspeed_kv_cache_pages_total", "KV cache pages in the pool.",
                                value=stats.kv_pages_total)
        usage = stats.kv_pages_referenced / stats.kv_pages_total if stats.kv_pages_total else 0.0
        yield GaugeMetricFamily("tokenspeed_kv_cache_usage_ratio",
                                "Fraction of KV pages referenced by live requests.", value=usage)
        yield CounterMetricFamily("tokenspeed_prompt_tokens", "Prompt tokens processed.",
                                  value=stats.prompt_tokens_total)
        yield CounterMetricFamily("tokenspeed_generation_tokens", "Tokens generated.",
                                  value=stats.generation_tokens_total)
        yield CounterMetricFamily("tokenspeed_cached_prompt_tokens", "Prompt tokens served from the prefix cache.",
                                  value=stats.cached_tokens_total)
        yield GaugeMetricFamily("tokenspeed_engine_healthy", "1 while the engine process is alive.",
                                value=1.0 if self.engine.is_healthy() else 0.0)
        if stats.spec_method:
            yield from _speculation_metrics(stats)
        if stats.kv_tiers:
            yield from _kv_tier_metrics(stats)


_TIER_PAGE_EVENTS = (
    ("retracted", "pages_retracted"),
    ("retracted_full", "pages_retracted_full"),
    ("retract_lost", "pages_retract_lost"),
    ("restored", "pages_restored"),
    ("reacquired", "pages_reacquired"),
    ("spilled", "pages_spilled"),
    ("spilled_to_disk", "pages_spilled_to_disk"),
    ("device_dropped", "device_drops"),
    ("host_dropped", "host_drops"),
    ("disk_bad_file", "disk_bad_files"),
)


def _kv_tier_metrics(stats: EngineStats) -> Iterator[Metric]:
    """The KV tiers (kvcache/tier_stats.py): page events, hits in tokens, bytes each way, the host pool."""
    tiers = stats.kv_tiers
    counters, page_size = tiers["counters"], tiers["page_size"]
    pages = CounterMetricFamily("tokenspeed_kv_tier_pages", "KV pages moved or lost between tiers, by event.",
                                labels=["event"])
    for label, key in _TIER_PAGE_EVENTS:
        pages.add_metric([label], counters[key])
    yield pages
    hits = CounterMetricFamily("tokenspeed_kv_tier_hit_tokens", "Prompt tokens loaded from a lower tier "
                               "instead of recomputed.", labels=["tier"])
    hits.add_metric(["host"], counters["host_hit_pages"] * page_size)
    hits.add_metric(["disk"], counters["disk_hit_pages"] * page_size)
    yield hits
    moved = CounterMetricFamily("tokenspeed_kv_tier_bytes", "KV bytes copied between tiers.", labels=["direction"])
    for direction in ("device_to_host", "host_to_device", "host_to_disk", "disk_to_host"):
        moved.add_metric([direction], counters[f"bytes_{direction}"])
    yield moved
    yield CounterMetricFamily("tokenspeed_kv_retention_evictions", "Session-retained pages evicted before "
                              "their TTL.", value=counters["retention_evictions"])
    yield GaugeMetricFamily("tokenspeed_num_requests_retracted", "Requests whose KV waits on the host tier.",
                            value=stats.num_retracted)
    host = tiers.get("host")
    if host is not None:
        books = GaugeMetricFamily("tokenspeed_kv_host_pages", "KV host tier slots by state.", labels=["state"])
        for state in ("free", "owned", "cached", "draining", "retained"):
            books.add_metric([state], host[state])
        yield books


def _speculation_metrics(stats: EngineStats) -> Iterator[Metric]:
    """vLLM's spec_decode counters (per drafter), plus the two ratios dashboards want."""
    method = [stats.spec_method]
    for name, text, value in (
        ("num_drafts", "Verify rows that carried drafts.", stats.spec_num_drafts),
        ("num_draft_tokens", "Draft tokens verified.", stats.spec_num_draft_tokens),
        ("num_accepted_tokens", "Draft tokens accepted.", stats.spec_num_accepted_tokens),
    ):
        counter = CounterMetricFamily(f"tokenspeed_spec_decode_{name}", text, labels=["method"])
        counter.add_metric(method, value)
        yield counter
    per_position = CounterMetricFamily("tokenspeed_spec_decode_num_accepted_tokens_per_pos",
                                       "Draft tokens accepted at each draft position.", labels=["method", "position"])
    for position, value in enumerate(stats.spec_accepted_per_position):
        per_position.add_metric([stats.spec_method, str(position)], value)
    yield per_position
    drafted, accepted = stats.spec_num_draft_tokens, stats.spec_num_accepted_tokens
    rate = GaugeMetricFamily("tokenspeed_spec_decode_acceptance_rate", "Accepted / drafted tokens since start.",
                             labels=["method"])
    rate.add_metric(method, accepted / drafted if drafted else 0.0)
    yield rate
    length = GaugeMetricFamily("tokenspeed_spec_decode_mean_accepted_length",
                               "Tokens emitted per verify row (accepted drafts + 1) since start.", labels=["method"])
    length.add_metric(method, 1.0 + accepted / stats.spec_num_drafts if stats.spec_num_drafts else 0.0)
    yield length


class ServerMetrics:
    def __init__(self, engine: EngineClient) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(engine))
        self.ttft = Histogram("tokenspeed_time_to_first_token_seconds", "Arrival to first output token.",
                              buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.inter_token = Histogram("tokenspeed_inter_token_latency_seconds", "Gap between output tokens.",
                                     buckets=_LATENCY_BUCKETS, registry=self.registry)
        self.queue = Histogram("tokenspeed_request_queue_time_seconds", "Submit to first admission in the "
                               "scheduler: the part of TTFT spent waiting for a slot or KV pages.",
                               buckets=_QUEUE_BUCKETS, registry=self.registry)
        self.e2e = Histogram("tokenspeed_e2e_request_latency_seconds", "Arrival to last output token.",
                             buckets=_E2E_BUCKETS, registry=self.registry)
        self.finished = Counter("tokenspeed_requests", "Finished requests by finish reason.",
                                ["finish_reason"], registry=self.registry)

    def render(self) -> bytes:
        return generate_latest(self.registry)

    def timer(self) -> RequestTimer:
        return RequestTimer(self)


class RequestTimer:
    """Latency bookkeeping of one request, fed by the route as tokens arrive."""

    def __init__(self, metrics: ServerMetrics) -> None:
        self.metrics = metrics
        self.arrival = time.perf_counter()
        self._last_token: float | None = None
        self._done = False

    def tokens(self, count: int) -> None:
        if count <= 0:
            return
        now = time.perf_counter()
        if self._last_token is None:
            self.metrics.ttft.observe(now - self.arrival)
        else:
            gap = (now - self._last_token) / count
            for _ in range(count):
                self.metrics.inter_token.observe(gap)
        self._last_token = now

    def queued(self, seconds: float) -> None:
        """The engine's queue time of this request (reported once, with its first tokens)."""
        self.metrics.queue.observe(seconds)

    def finished(self, reasons: list[str]) -> None:
        if self._done:
            return
        self._done = True
        self.metrics.e2e.observe(time.perf_counter() - self.arrival)
        for reason in reasons:
            self.metrics.finished.labels(finish_reason=reason).inc()
