"""`CoreClient`: the API process's handle on the engine-core process (spawn, sockets, liveness, shutdown).

The child is a plain `subprocess` running `python -m tokenspeed.engine.core_process`
(not multiprocessing: nothing is pickled to start it, and it imports nothing
of the parent's `__main__`). Two ZMQ PUSH/PULL pipes over ipc:// sockets in a
private (0700) temp dir carry msgpack frames. The parent binds both before
spawning, so the child can never connect to nothing, and deletes the socket
files once the child is ready (connections outlive them), so not even a
SIGKILLed server leaves files behind.

No orphans, whichever side dies first: the child runs in its own session
(process group) so the group can be signalled as a whole and a terminal's
Ctrl-C reaches only the parent, which shuts it down in order; `close()` asks
politely (Shutdown), then SIGTERMs, then SIGKILLs the group; an `atexit` hook
does the same when the parent exits without `close()`; and the child itself
exits when the parent dies (see core_process).
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import logging
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import weakref
from pathlib import Path

import zmq
import zmq.asyncio

from tokenspeed.config import EngineConfig
from tokenspeed.engine import ipc
from tokenspeed.errors import EngineDead

logger = logging.getLogger("tokenspeed.engine")

_STARTUP_POLL_MS = 100
_STOP_GRACE_S = 5.0  # after Shutdown, before SIGTERM
_TERM_GRACE_S = 2.0  # after SIGTERM, before SIGKILL


class CoreClient:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.ready: ipc.Ready | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._dir: Path | None = None
        self._send_context = zmq.Context()
        self._recv_context = zmq.asyncio.Context()
        self._to_core = self._send_context.socket(zmq.PUSH)
        self._to_core.setsockopt(zmq.SNDHWM, 0)  # sends never block the event loop or drop
        self._to_core.setsockopt(zmq.LINGER, 0)
        self._from_core = self._recv_context.socket(zmq.PULL)
        self._from_core.setsockopt(zmq.LINGER, 0)
        self._closed = False

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    async def start(self) -> ipc.Ready:
        """Spawn the core and wait for it to load the model; raises the child's error if it cannot."""
        self._dir = Path(tempfile.mkdtemp(prefix="tokenspeed-ipc-"))
        to_core, from_core = f"ipc://{self._dir}/in", f"ipc://{self._dir}/out"
        self._to_core.bind(to_core)
        self._from_core.bind(from_core)
        command = [
            sys.executable, "-m", "tokenspeed.engine.core_process",
            "--input", to_core,
            "--output", from_core,
            "--config", ipc.config_to_wire(self.config),
            "--parent-pid", str(os.getpid()),
        ]  # fmt: skip
        self._proc = subprocess.Popen(command, stdin=subprocess.DEVNULL, start_new_session=True)
        _register_atexit(self)
        while True:
            if await self._from_core.poll(_STARTUP_POLL_MS):
                message = ipc.decode(await self._from_core.recv())
                if isinstance(message, ipc.Ready):
                    self.ready = message
                    self._remove_socket_files()
                    return message
                if isinstance(message, ipc.StartupFailed):
                    error = ipc.error_from_wire(message.error_type, message.message, fallback=EngineDead)
                    error.add_note(f"engine process traceback:\n{message.traceback}")
                    raise error
                raise ipc.WireFormatError(f"engine process sent {type(message).__name__} before Ready")
            code = self.returncode()
            if code is not None and not await self._from_core.poll(_STARTUP_POLL_MS):
                raise EngineDead(f"The engine process {describe_exit(code)} before it was ready.")

    def returncode(self) -> int | None:
        """None while the process runs (reaps it once it has exited)."""
        return None if self._proc is None else self._proc.poll()

    def send(self, message: ipc.Message) -> None:
        """Queue a message for the core; never blocks."""
        self._to_core.send(ipc.encode(message), zmq.NOBLOCK)

    async def recv(self) -> ipc.Message:
        return ipc.decode(await self._from_core.recv())

    async def close(self) -> None:
        """Stop the core (Shutdown, then SIGTERM, then SIGKILL to its group) and free the sockets."""
        if self._closed:
            return
        self._closed = True
        if self._proc is not None:
            if self._proc.poll() is None:
                with contextlib.suppress(zmq.ZMQError):
                    self.send(ipc.Shutdown())
                await self._wait(_STOP_GRACE_S)
            for sig in (signal.SIGTERM, signal.SIGKILL):
                if self._proc.poll() is not None:
                    break
                logger.warning("engine process %d did not stop; sending %s", self._proc.pid, sig.name)
                self._signal_group(sig)
                await self._wait(_TERM_GRACE_S)
            self._signal_group(signal.SIGKILL)  # stragglers the child may have started
        self._release()

    def kill_now(self) -> None:
        """Synchronous last resort (atexit): terminate the process group, wait briefly, kill."""
        if self._proc is not None and self._proc.poll() is None:
            self._signal_group(signal.SIGTERM)
            try:
                self._proc.wait(_TERM_GRACE_S)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self._proc.wait()
        self._closed = True
        self._release()

    async def _wait(self, timeout: float) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + timeout
        while self._proc.poll() is None and time.monotonic() < deadline:
            await asyncio.sleep(0.02)

    def _signal_group(self, sig: signal.Signals) -> None:
        assert self._proc is not None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self._proc.pid, sig)  # the child leads its own session: pgid == pid

    def _release(self) -> None:
        if self._to_core.closed:
            return
        self._to_core.close(linger=0)
        self._from_core.close(linger=0)
        self._send_context.term()
        self._recv_context.term()
        self._remove_socket_files()

    def _remove_socket_files(self) -> None:
        """Both pipes are connected once Ready arrived (the child connects before it loads the
        model); connections outlive their socket files, so removing them now leaves nothing
        behind even if this process is SIGKILLed later."""
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def describe_exit(code: int) -> str:
    if code < 0:
        try:
            return f"was killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"was killed by signal {-code}"
    return f"exited with code {code}"


_LIVE: weakref.WeakSet[CoreClient] = weakref.WeakSet()
_atexit_registered = False


def _register_atexit(client: CoreClient) -> None:
    global _atexit_registered
    _LIVE.add(client)
    if not _atexit_registered:
        atexit.register(_kill_all)
        _atexit_registered = True


def _kill_all() -> None:
    for client in list(_LIVE):
        with contextlib.suppress(Exception):
            client.kill_now()
