"""Build a small C source into a shared library once, cached on disk, for ctypes.

Why one helper: the native pieces (`spec/native_automaton.py`, the CPU kernels under `kernels/`)
are single C files compiled on first use with the system compiler (`$CC`, else `cc`) rather than
shipped as wheels; each build is keyed by the source (with the headers it includes), the flags and (for `-march=native`) the CPU's
feature flags, so an edited source, other flags or a cache directory shared with another machine
never load a stale or illegal library. Cache: `$TOKENSPEED_CACHE_DIR/native` (default
`~/.cache/tokenspeed/native`). Callers catch the exception where no compiler works and fall back.
"""

from __future__ import annotations

import ctypes
import hashlib
import logging
import os
import platform
import re
import subprocess
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path


def _cpu_identity() -> bytes:
    """What `-march=native` compiles for: the machine and, on Linux, the CPU's feature flags."""
    identity = platform.machine().encode()
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return identity + line.encode()
    except OSError:
        pass
    return identity


def _source_text(source: Path) -> bytes:
    """The source and every header it includes by a quoted path (recursively): what a build depends on."""
    text = source.read_bytes()
    for name in re.findall(rb'^#include "([^"]+)"', text, flags=re.MULTILINE):
        text += _source_text(source.parent / name.decode())
    return text


def build_library(source: Path, name: str, flags: Sequence[str]) -> Path:
    """`source` compiled with `flags` (plus `-shared -fPIC`) into `<cache>/native/<name>-<key>.so`, built
    once per key; raises where the compiler fails."""
    compiler = os.environ.get("CC", "cc")
    key = hashlib.sha256(_source_text(source))
    key.update("\0".join([compiler, *flags]).encode())
    if "-march=native" in flags:
        key.update(_cpu_identity())
    folder = Path(os.environ.get("TOKENSPEED_CACHE_DIR", Path.home() / ".cache" / "tokenspeed")) / "native"
    target = folder / f"{name}-{key.hexdigest()[:16]}.so"
    if target.exists():
        return target
    folder.mkdir(parents=True, exist_ok=True)
    handle, scratch = tempfile.mkstemp(suffix=".so", dir=folder)
    os.close(handle)
    try:
        subprocess.run([compiler, *flags, "-shared", "-fPIC", "-o", scratch, str(source)],
                       check=True, capture_output=True, timeout=120)
        os.replace(scratch, target)  # atomic: concurrent builders each publish a whole library
    finally:
        if os.path.exists(scratch):
            os.unlink(scratch)
    return target


def load_vector_library(source: Path, name: str) -> ctypes.CDLL:
    """`source` built for this CPU (`-O3 -march=native`) and loaded; with a compiler that cannot target
    the host CPU, the portable build of the same GCC vector-extension code instead."""
    try:
        path = build_library(source, name, ["-O3", "-march=native", "-std=gnu99"])
    except Exception:  # a compiler without -march=native: the generic vector code
        path = build_library(source, name, ["-O3", "-std=gnu99", "-Wno-psabi"])
    return ctypes.CDLL(str(path))


class NativeLibrary:
    """One native piece's library, built and loaded on its first use, then kept for the process.

    `load` builds and declares it (ctypes signatures); where that raises (no compiler, an unwritable
    cache, ...) `get` logs `fallback` once at `level` and returns None ever after, and the caller keeps
    its torch or Python path.
    """

    def __init__(self, load: Callable[[], ctypes.CDLL], logger: logging.Logger, fallback: str,
                 level: int = logging.INFO) -> None:
        self._load, self._logger, self._fallback, self._level = load, logger, fallback, level
        self.lib: ctypes.CDLL | None = None
        self.tried = False

    def get(self) -> ctypes.CDLL | None:
        if not self.tried:
            self.tried = True
            try:
                self.lib = self._load()
            except Exception as err:
                self._logger.log(self._level, "%s (%s)", self._fallback, err)
                self.lib = None
        return self.lib
