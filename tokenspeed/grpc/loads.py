"""One replica's load, as the gateway reads it (`GetLoads` and the record on every KV-event batch).

The numbers come from the stats the engine core sends after every step, so
they are at most one step old and cost nothing to read. Two are derived
here: the generation rate (tokens per second over the last second or more
between reads) and the prefix-cache hit rate (cached prompt tokens over all
prompt tokens since the start), which is the figure that shows whether a
cache-aware router keeps sessions on the replica that holds their prefix.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from smg_grpc_proto.generated import common_pb2
from smg_grpc_proto.generated import tokenspeed_scheduler_pb2 as pb

from tokenspeed.engine.stream import EngineStats

_RATE_WINDOW_S = 1.0


class LoadReporter:
    def __init__(
        self,
        stats: Callable[[], EngineStats],
        *,
        page_size: int,
        max_num_seqs: int,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._stats = stats
        self.page_size = page_size
        self.max_num_seqs = max_num_seqs
        self._clock = clock
        self._rate = 0.0
        self._mark = (clock(), 0)  # (time, generation_tokens_total) of the last rate sample

    def gen_throughput(self, stats: EngineStats) -> float:
        now = self._clock()
        then, tokens = self._mark
        if now - then >= _RATE_WINDOW_S:
            self._rate = (stats.generation_tokens_total - tokens) / (now - then)
            self._mark = (now, stats.generation_tokens_total)
        return self._rate

    @staticmethod
    def cache_hit_rate(stats: EngineStats) -> float:
        return stats.cached_tokens_total / stats.prompt_tokens_total if stats.prompt_tokens_total else 0.0

    def scheduler_load(self, include: list[str]) -> pb.SchedulerLoad:
        stats = self._stats()
        total = max(1, stats.kv_pages_total)
        used_pages = stats.kv_pages_total - stats.kv_pages_free
        load = pb.SchedulerLoad(
            dp_rank=0,
            num_running_reqs=stats.num_running,
            num_waiting_reqs=stats.num_waiting,
            num_total_reqs=stats.num_running + stats.num_waiting,
            num_used_tokens=used_pages * self.page_size,
            max_total_num_tokens=stats.kv_pages_total * self.page_size,
            max_running_requests=self.max_num_seqs,
            token_usage=used_pages / total,
            active_token_usage=stats.kv_pages_referenced / total,
            gen_throughput=self.gen_throughput(stats),
            cache_hit_rate=self.cache_hit_rate(stats),
            utilization=stats.num_running / self.max_num_seqs,
        )
        if "queues" in include or "all" in include:
            load.queues.CopyFrom(pb.QueueMetrics(waiting=stats.num_waiting))
        return load

    def engine_load(self) -> common_pb2.EngineLoad:
        """The record a KV-event batch carries (`sample`/`load_only` are the stream's to set)."""
        load = self.scheduler_load(["queues"])
        return common_pb2.EngineLoad(
            running_requests=load.num_running_reqs,
            waiting_requests=load.num_waiting_reqs,
            token_usage=load.token_usage,
            active_token_usage=load.active_token_usage,
            gen_throughput=load.gen_throughput,
            max_running_requests=load.max_running_requests,
            cache_hit_rate=load.cache_hit_rate,
            num_used_tokens=load.num_used_tokens,
            max_total_num_tokens=load.max_total_num_tokens,
            queues=common_pb2.EngineQueues(waiting=load.num_waiting_reqs),
        )

    def loads_response(self, request: pb.GetLoadsRequest) -> pb.GetLoadsResponse:
        if request.HasField("dp_rank") and request.dp_rank != 0:
            return pb.GetLoadsResponse(timestamp=_now_iso(), version="1", dp_rank_count=1)
        load = self.scheduler_load(list(request.include))
        return pb.GetLoadsResponse(
            timestamp=_now_iso(),
            version="1",
            dp_rank_count=1,
            loads=[load],
            aggregate=pb.AggregateMetrics(
                total_running_reqs=load.num_running_reqs,
                total_waiting_reqs=load.num_waiting_reqs,
                total_reqs=load.num_total_reqs,
                avg_token_usage=load.token_usage,
                avg_throughput=load.gen_throughput,
                avg_utilization=load.utilization,
            ),
        )


def _now_iso() -> str:
    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())
