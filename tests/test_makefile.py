"""What `make setup` (hence `make run` / `make test`) installs, checked without installing anything.

The venv's python is a stand-in that logs its arguments and answers
`import torch` as told, so the recipe's real commands run as they would on a
fresh machine (issue 19, item 10): torch only when absent, the CPU build from
PyTorch's CPU index (never PyPI's CUDA wheel, never a machine-local cache).
"""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _setup(tmp_path: Path, *, torch_present: bool, **variables: str) -> list[str]:
    venv, log = tmp_path / "venv", tmp_path / "calls.log"
    (venv / "bin").mkdir(parents=True)
    python = venv / "bin" / "python"
    python.write_text(f'#!/bin/sh\necho "$*" >> {log}\n[ "$1" = "-c" ] && exit {0 if torch_present else 1}\nexit 0\n')
    python.chmod(0o755)
    settings = [f"{key}={value}" for key, value in variables.items()]
    subprocess.run(["make", "-s", "-C", str(REPO), "setup", f"VENV={venv}", *settings], check=True,
                   capture_output=True, text=True)
    assert (venv / ".installed").is_file()
    return log.read_text().splitlines()


def test_without_torch_the_cpu_build_comes_from_the_cpu_index(tmp_path):
    calls = _setup(tmp_path, torch_present=False)
    assert calls == [
        "-c import torch",
        f"-m pip install -q --retries 1 --timeout 10 --no-deps torch==2.13.0+cpu --extra-index-url {CPU_INDEX}",
        "-m pip install -q -e .[dev]",
    ]


def test_an_installed_torch_is_kept(tmp_path):
    assert _setup(tmp_path, torch_present=True) == ["-c import torch", "-m pip install -q -e .[dev]"]


def test_macos_takes_the_plain_wheel(tmp_path):
    """PyPI's macOS wheel is the CPU build, and the CPU index has no `+cpu` one for macOS."""
    calls = _setup(tmp_path, torch_present=False, UNAME_S="Darwin")
    assert calls[1] == f"-m pip install -q --retries 1 --timeout 10 --no-deps torch==2.13.0 --extra-index-url {CPU_INDEX}"


def test_the_readme_says_what_the_makefile_does():
    readme, makefile = (REPO / "README.md").read_text(), (REPO / "Makefile").read_text()
    version = re.search(r"^TORCH_VERSION \?= (\S+)$", makefile, re.M)
    assert version is not None and f"torch=={version.group(1)}+cpu" in readme
    assert CPU_INDEX in readme and CPU_INDEX in makefile
    assert "../shared" not in readme and "DESIGN.md" not in readme


@pytest.mark.parametrize("target", ["run", "test"])
def test_the_readme_commands_set_up_first(target):
    dry = subprocess.run(["make", "-n", "-C", str(REPO), target, "VENV=/nonexistent/venv"], check=True,
                         capture_output=True, text=True).stdout
    assert dry.index("python3 -m venv /nonexistent/venv") < dry.index("pip install -q -e '.[dev]'")
