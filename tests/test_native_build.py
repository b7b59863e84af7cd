"""`native_build.build_library`: a build is keyed on the source and the headers it includes."""

from __future__ import annotations

import ctypes
import shutil
from pathlib import Path

import pytest

from tokenspeed.kernels.native_build import build_library

pytestmark = pytest.mark.skipif(shutil.which("cc") is None, reason="no C compiler")


def test_an_edited_header_gives_a_new_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOKENSPEED_CACHE_DIR", str(tmp_path / "cache"))
    (tmp_path / "inc").mkdir()
    header = tmp_path / "inc" / "value.h"
    source = tmp_path / "lib.c"
    source.write_text('#include "inc/value.h"\nint value(void) { return VALUE; }\n')
    results = []
    for value in (1, 2):
        header.write_text(f"#define VALUE {value}\n")
        path = build_library(source, "value", ["-O1"])
        results.append((path, ctypes.CDLL(str(path)).value()))
    assert [r[1] for r in results] == [1, 2] and results[0][0] != results[1][0]
    assert build_library(source, "value", ["-O1"]) == results[1][0]  # unchanged: the cached library
