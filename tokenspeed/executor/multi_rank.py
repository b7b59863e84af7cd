"""`MultiRankExecutor`: one engine on N ranks, behind the one-device `ModelExecutor` interface.

Rank 0 lives in the engine's process: the scheduler plans as always and this
executor hands each plan to every rank. The other N-1 ranks are worker
processes it spawns (`torch.multiprocessing`, spawn context), each building
its own `Executor` for its rank (`rank_setup.join_world`: gloo on the CPU,
NCCL on CUDA, device `cuda:<rank>`). A step:

1. `launch(plan)`: the plan, pickled once, goes onto every worker's queue;
   then rank 0 launches it on its own executor. Every rank runs the same
   forward pass (the compiled plan's collectives keep them in lock-step),
   gathers the whole logits and samples with the same seeds, so every rank
   holds the step's sampled ids on its device: the next plan's placeholder
   inputs (overlap scheduling) resolve locally, nothing is sent back. Under
   DP attention each rank runs attention over its own requests' rows only
   (`attention_ranks.py` places them, the same way on every rank); the
   gathered logits and the sampling are still whole on every rank.
2. `collect(handle)`: rank 0's result, as on one device.

Failure, never a hang: every collective has a bounded timeout
(`rank_setup.step_timeout_s`: 10 s on the CPU, 60 s under NCCL), a watchdog thread notices a worker that
exited, and a worker that fails reports its traceback before exiting. Any of
these turns the next (or the blocked) call into `EngineDead`, and the
executor then ends its workers. Workers poll their parent too: a worker
whose engine process vanished exits by itself. `close()` stops the workers
(a None plan), joins them, and kills any that do not exit in time, so no
process outlives the engine.
"""

from __future__ import annotations

import logging
import os
import pickle
import queue
import socket
import threading
import time
import traceback
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from tokenspeed.config import EngineConfig, resolve_device
from tokenspeed.errors import EngineDead
from tokenspeed.executor.executor import Executor
from tokenspeed.executor.model_runner import StepHandle
from tokenspeed.executor.rank_setup import STARTUP_TIMEOUT_S, join_world, leave_world
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.parallel.fp8_sharding import check_fp8_sharding
from tokenspeed.models.parallel.sharded_reader import ReadStats
from tokenspeed.models.quant_config import resolve_quantization
from tokenspeed.placement.parallel_config import ParallelConfigError, Topology
from tokenspeed.scheduler.plan import ExecutionPlan, ExecutionResult, ExecutorLimits

logger = logging.getLogger("tokenspeed.executor")

_POLL_S = 0.2
_JOIN_S = 5.0


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def rank_config(config: EngineConfig, rank: int) -> EngineConfig:
    """Rank `rank`'s engine config: its own device on CUDA; the CPU's cores shared between the ranks."""
    device = resolve_device(config.device)
    if device.type == "cuda":
        return config.replace(device=f"cuda:{rank}")
    if config.cpu_threads is None:
        cores = len(os.sched_getaffinity(0))
        return config.replace(cpu_threads=max(1, cores // config.tensor_parallel_size))
    return config


def check_topology(config: EngineConfig, model_config: ModelConfig) -> Topology:
    """The topology, after refusing what the model or the machine cannot take (clear message, at start)."""
    parallel = config.parallel_config()
    topology = parallel.validate_for_model(model_config)
    device = resolve_device(config.device)
    available = torch.cuda.device_count() if device.type == "cuda" else 0
    parallel.check_devices(available, device.type)
    if topology.moe_all_to_all:
        raise ParallelConfigError(
            "all2all_backend='alltoall' is not executed yet: the MoE all-to-all has a compiled plan but no "
            "multi-rank execution; use the all-gather / reduce-scatter backend"
        )
    if topology.dp_attention:
        check_dp_attention(model_config, topology)
    check_fp8_sharding(model_config, resolve_quantization(model_config.raw, config.quantization), topology)
    return topology


def check_dp_attention(model_config: ModelConfig, topology: Topology) -> None:
    """DP attention as executed: one rank per attention group (data_parallel_size == world), an untied LM head.

    Meant for MLA models (DeepSeek V2/V3, Kimi), whose one latent head TP cannot split; GQA models run
    it too (each rank holds all kv heads of its own requests). A tied LM head cannot: the embedding is
    whole on every rank under DP attention while the head is vocab-parallel."""
    if model_config.tie_word_embeddings:
        raise ParallelConfigError(
            f"enable_dp_attention cannot run {model_config.architecture} with tied word embeddings (each rank "
            "embeds with the whole table, the LM head is split by vocabulary); drop enable_dp_attention"
        )
    if topology.attn_tp != 1:
        raise ParallelConfigError(
            f"enable_dp_attention needs data_parallel_size == tensor_parallel_size (one rank per attention "
            f"group); got {topology.attn_dp} groups of {topology.attn_tp} ranks"
        )


def _worker_main(
    config: EngineConfig,
    model_folder: Path,
    dummy_weights: bool,
    topology: Topology,
    rank: int,
    init_method: str,
    plans: Any,
    events: Any,
) -> None:
    parent = os.getppid()
    try:
        config = rank_config(config, rank)
        setup = join_world(topology, rank, init_method, resolve_device(config.device).type)
        executor = Executor(config, model_folder, dummy_weights=dummy_weights, rank=setup)
        events.put(("ready", rank, executor.read_stats))
        previous: StepHandle | None = None
        while True:
            try:
                data = plans.get(timeout=_POLL_S)
            except queue.Empty:
                if os.getppid() != parent:  # the engine process is gone: do not outlive it
                    return
                continue
            if data is None:  # shutdown: the process ends now, and its memory and device with it
                os._exit(0)
            previous = executor.launch(pickle.loads(data), previous)
    except BaseException:
        events.put(("error", rank, traceback.format_exc()))
    finally:
        leave_world()


class MultiRankExecutor:
    """N ranks behind `ModelExecutor` (see the module docstring)."""

    def __init__(
        self, config: EngineConfig, model_folder: Path, *, dummy_weights: bool = False, progress: bool = False
    ) -> None:
        model_config = ModelConfig.from_pretrained(model_folder)
        topology = check_topology(config, model_config)
        self.world_size = topology.world_size
        self._dead: str | None = None
        self._closed = False
        context = mp.get_context("spawn")
        init_method = f"tcp://127.0.0.1:{_free_port()}"
        self._events = context.Queue()
        self._plans = [context.Queue() for _ in range(1, self.world_size)]
        self._workers = [
            context.Process(
                target=_worker_main,
                args=(config, model_folder, dummy_weights, topology, rank, init_method, plans, self._events),
                name=f"tokenspeed-rank{rank}",
                daemon=True,
            )
            for rank, plans in zip(range(1, self.world_size), self._plans, strict=True)
        ]
        for plans in self._plans:
            plans.cancel_join_thread()  # a dead worker's unread plans must not hold this process at exit
        for worker in self._workers:
            worker.start()
        try:
            local = rank_config(config, 0)
            setup = join_world(topology, 0, init_method, resolve_device(local.device).type)
            self.local = Executor(local, model_folder, dummy_weights=dummy_weights, progress=progress, rank=setup)
            self._wait_ready()
        except BaseException as error:
            reason = self._worker_failure() or f"{type(error).__name__}: {error}"
            self._stop_workers()
            leave_world()
            if isinstance(error, ParallelConfigError):
                raise
            raise EngineDead(f"starting {self.world_size} ranks failed: {reason}") from error
        self._watchdog = threading.Thread(target=self._watch, name="tokenspeed-rank-watchdog", daemon=True)
        self._watchdog.start()
        logger.info("%d ranks ready: %s", self.world_size, topology.describe())

    # ---- the ModelExecutor interface ----------------------------------------------------

    @property
    def limits(self) -> ExecutorLimits:
        return self.local.limits

    @property
    def worker_pids(self) -> list[int]:
        return [w.pid for w in self._workers if w.pid is not None]

    def launch(self, plan: ExecutionPlan, previous: StepHandle | None = None) -> StepHandle:
        self._check_alive()
        data = pickle.dumps(plan, protocol=pickle.HIGHEST_PROTOCOL)
        for plans in self._plans:
            plans.put(data)
        return self._guard(lambda: self.local.launch(plan, previous))

    def collect(self, handle: StepHandle) -> ExecutionResult:
        return self._guard(lambda: self.local.collect(handle))

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        for plans in self._plans:
            plans.put(None)
        self._stop_workers()
        if self._dead is None:
            self.local.close()
        leave_world()

    # ---- failure ---------------------------------------------------------------------

    def _guard(self, call: Any) -> Any:
        try:
            return call()
        except EngineDead:
            raise
        except Exception as error:
            # a collective failed: a peer died or did not answer within the timeout
            reason = self._worker_failure() or f"{type(error).__name__}: {error}"
            self._die(reason)
            raise EngineDead(f"a rank of the {self.world_size}-rank engine failed: {reason}") from error

    def _check_alive(self) -> None:
        if self._closed:
            raise EngineDead("The engine is shut down: its ranks are stopped.")
        if self._dead is None:
            failure = self._worker_failure()
            if failure is not None:
                self._die(failure)
        if self._dead is not None:
            raise EngineDead(f"a rank of the {self.world_size}-rank engine failed: {self._dead}")

    def _worker_failure(self) -> str | None:
        try:
            while True:
                kind, rank, detail = self._events.get_nowait()
                if kind == "error":
                    return f"rank {rank} raised:\n{detail}"
        except queue.Empty:
            pass
        for rank, worker in enumerate(self._workers, start=1):
            if not worker.is_alive():
                return f"rank {rank} (pid {worker.pid}) exited with code {worker.exitcode}"
        return None

    def _die(self, reason: str) -> None:
        if self._dead is None:
            self._dead = reason
            logger.error("multi-rank engine dead: %s", reason)
        self._stop_workers()

    def _watch(self) -> None:
        """Notice a worker that exited while rank 0 waits for it (its gloo peers then fail at once)."""
        while not self._closed and self._dead is None:
            for rank, worker in enumerate(self._workers, start=1):
                if not worker.is_alive() and not self._closed:
                    self._dead = f"rank {rank} (pid {worker.pid}) exited with code {worker.exitcode}"
                    logger.error("multi-rank engine dead: %s", self._dead)
                    return
            time.sleep(_POLL_S)

    def _wait_ready(self) -> None:
        ready: set[int] = set()
        self.read_stats: list[ReadStats | None] = [self.local.read_stats] + [None] * len(self._workers)
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        while len(ready) < len(self._workers):
            try:
                kind, rank, detail = self._events.get(timeout=_POLL_S)
            except queue.Empty:
                for rank, worker in enumerate(self._workers, start=1):
                    if rank not in ready and not worker.is_alive():
                        raise EngineDead(f"rank {rank} exited with code {worker.exitcode} while starting") from None
                if time.monotonic() > deadline:
                    raise EngineDead(f"ranks did not start within {STARTUP_TIMEOUT_S:.0f} s") from None
                continue
            if kind == "error":
                raise EngineDead(f"rank {rank} failed to start:\n{detail}")
            ready.add(rank)
            self.read_stats[rank] = detail  # what the rank read of the checkpoint (None: dummy weights)

    def _stop_workers(self) -> None:
        for worker in self._workers:
            worker.join(timeout=_JOIN_S if not self._dead else 0.5)
            if worker.is_alive():
                worker.kill()
                worker.join(timeout=_JOIN_S)
