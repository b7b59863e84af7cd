"""Run a function on N CPU ranks (spawned processes, gloo) and collect what each returns.

`run_ranks(fn, *args, world_size=2)` spawns one process per rank with
`torch.multiprocessing`'s spawn context, joins them to one gloo world over a
free TCP port on 127.0.0.1 (`placement.init_distributed`), calls
`fn(rank, world_size, *args)` and returns the results in rank order. A rank
that raises fails the test with its traceback; a world that does not finish
within `timeout_s` is killed (every process we started, by its own handle)
and fails the test: a hung collective can never hang the suite.

`fn` must be a module-level function (spawn pickles it by name) and its
arguments and result picklable. Each spawn costs a Python start and a torch
import per rank (~2 s on the CPU machine), so tests put several checks in one
rank function rather than spawning per check.
"""

from __future__ import annotations

import queue
import socket
import time
import traceback
from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from tokenspeed.placement.process_groups import init_distributed


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _rank_main(
    fn: Callable[..., Any], rank: int, world_size: int, port: int, results: Any, args: tuple[Any, ...]
) -> None:
    torch.set_num_threads(1)  # N ranks share the machine's few cores
    try:
        init_distributed(rank, world_size, f"tcp://127.0.0.1:{port}", timeout_s=60)
        results.put((rank, True, fn(rank, world_size, *args)))
    except BaseException:
        results.put((rank, False, traceback.format_exc()))
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_ranks(fn: Callable[..., Any], *args: Any, world_size: int = 2, timeout_s: float = 120.0) -> list[Any]:
    context = mp.get_context("spawn")
    results = context.Queue()
    port = free_port()
    processes = [
        context.Process(target=_rank_main, args=(fn, rank, world_size, port, results, args), daemon=True)
        for rank in range(world_size)
    ]
    for process in processes:
        process.start()
    deadline = time.monotonic() + timeout_s
    collected: dict[int, Any] = {}
    finished = False
    try:
        while len(collected) < world_size:
            remaining = deadline - time.monotonic()
            try:
                rank, ok, value = results.get(timeout=max(remaining, 0.01))
            except queue.Empty:
                missing = sorted(set(range(world_size)) - set(collected))
                raise TimeoutError(f"ranks {missing} did not finish within {timeout_s:.0f} s") from None
            if not ok:
                raise AssertionError(f"rank {rank} of {world_size} failed:\n{value}")
            collected[rank] = value
        finished = True
    finally:
        for process in processes:  # after a failure the others may wait in a collective: end them now
            process.join(timeout=30 if finished else 0)
            if process.is_alive():
                process.kill()
                process.join(timeout=5)
    return [collected[rank] for rank in range(world_size)]
