"""The processes of gateway mode: N engine replicas and the `smg` router, started and stopped as one.

Each child leads its own process group (so a Ctrl-C in the terminal reaches
only the launcher, which decides what each child gets) and is stopped by
signalling the group: a replica's engine-core process goes with it. Replicas
also ask the kernel to SIGTERM them if the launcher dies
(`--parent-pid`), so even a SIGKILLed launcher leaves no orphan serving.

CPU placement: replica i gets its own slice of the cores this process may
use (`cpu_slices`), as affinity and as its torch thread count, so two
replicas never fight over one core's caches; on GPUs replica i sees only
device i (`CUDA_VISIBLE_DEVICES`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field

from tokenspeed.config import EngineConfig
from tokenspeed.engine import ipc


def free_port(host: str = "127.0.0.1") -> int:
    """A port nothing listens on now (the OS picks; a tiny window remains before the child binds it)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((host, 0))
        port: int = sock.getsockname()[1]
        return port


def cpu_slices(cores: list[int], replicas: int) -> list[list[int]]:
    """`replicas` disjoint, near-equal slices of `cores` (cores are shared when there are fewer)."""
    if len(cores) < replicas:
        return [[cores[i % len(cores)]] for i in range(replicas)]
    size, extra = divmod(len(cores), replicas)
    slices, start = [], 0
    for i in range(replicas):
        end = start + size + (1 if i < extra else 0)
        slices.append(cores[start:end])
        start = end
    return slices


@dataclass(slots=True)
class Child:
    name: str
    command: list[str]
    env: dict[str, str] = field(default_factory=dict)
    cores: list[int] | None = None
    proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        cores = self.cores

        def place() -> None:  # runs in the child before exec
            if cores is not None:
                os.sched_setaffinity(0, cores)

        self.proc = subprocess.Popen(
            self.command,
            stdin=subprocess.DEVNULL,
            env={**os.environ, **self.env},
            start_new_session=True,
            preexec_fn=place if cores is not None else None,
        )

    @property
    def pid(self) -> int | None:
        return None if self.proc is None else self.proc.pid

    def returncode(self) -> int | None:
        return None if self.proc is None else self.proc.poll()

    def signal(self, sig: signal.Signals) -> None:
        if self.proc is not None:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(self.proc.pid, sig)

    def wait(self, timeout: float) -> bool:
        """True once the process has exited (waits at most `timeout` seconds)."""
        if self.proc is None:
            return True
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            return False
        return True


def stop_all(children: list[Child], first: signal.Signals | None, grace_s: float) -> None:
    """`first` to every child (None: they were signalled already), SIGKILL to the groups still there
    after `grace_s` (no orphans either way)."""
    for child in children:
        if first is not None and child.returncode() is None:
            child.signal(first)
    deadline = time.monotonic() + grace_s
    for child in children:
        child.wait(max(0.0, deadline - time.monotonic()))
    for child in children:
        child.signal(signal.SIGKILL)  # the group: stragglers the child started (its engine core)
        child.wait(5.0)


def replica_child(
    index: int,
    config: EngineConfig,
    *,
    port: int,
    served_model_name: str,
    max_waiting_requests: int | None,
    cores: list[int] | None,
    gpu: str | None,
    log_level: str,
) -> Child:
    if cores is not None and config.cpu_threads is None:
        # As `default_cpu_threads`: a slice of several cores leaves one to the replica's front process.
        config = dataclasses.replace(config, cpu_threads=max(1, len(cores) - 1))
    command = [
        sys.executable, "-m", "tokenspeed.grpc.server",
        "--config", ipc.config_to_wire(config),
        "--host", "127.0.0.1",
        "--port", str(port),
        "--served-model-name", served_model_name,
        "--parent-pid", str(os.getpid()),
        "--log-level", log_level,
    ]  # fmt: skip
    if max_waiting_requests is not None:
        command += ["--max-waiting-requests", str(max_waiting_requests)]
    env = {"CUDA_VISIBLE_DEVICES": gpu} if gpu is not None else {}
    return Child(f"replica {index}", command, env=env, cores=None if gpu is not None else cores)


def replica_gpus(replicas: int) -> list[str]:
    """The device each replica sees (`CUDA_VISIBLE_DEVICES` entries); ValueError if there are too few."""
    import torch

    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    devices = [d.strip() for d in visible.split(",") if d.strip()] if visible else [
        str(i) for i in range(torch.cuda.device_count())
    ]
    if len(devices) < replicas:
        raise ValueError(f"--data-parallel-size {replicas} needs {replicas} GPUs (one per replica); "
                         f"{len(devices)} visible")
    return devices[:replicas]
