"""Test helpers for the native (C) CPU kernels: a machine without a compiler, simulated."""

from __future__ import annotations

from pathlib import Path

import pytest

from tokenspeed.kernels.native_build import NativeLibrary


def without_a_compiler(monkeypatch: pytest.MonkeyPatch, tmp_path: Path, native: NativeLibrary) -> None:
    """As on a machine with no C compiler: `CC` names nothing, nothing is cached, `native` is not loaded yet."""
    monkeypatch.setenv("CC", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("TOKENSPEED_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(native, "lib", None)
    monkeypatch.setattr(native, "tried", False)
