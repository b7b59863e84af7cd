"""The entry-point plugin loader, end to end, with the example package `examples/kernel_plugin/`.

The example is pip-installed (offline, no dependencies, no build isolation)
into a temporary directory that goes on a fresh interpreter's path, exactly as
a site-packages install would be found: `importlib.metadata` reads its
dist-info and entry points. Fresh interpreters, because the registry loads
plugins once per process.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
EXAMPLE = REPO / "examples" / "kernel_plugin"

SELECT = """
import torch
from tokenspeed.kernels import select_kernel
from tokenspeed.kernels.activation.reference import silu_and_mul_reference
spec = select_kernel("activation", "silu_and_mul", platform="cpu", dtype=torch.float32)
x = torch.randn(5, 16, generator=torch.Generator().manual_seed(0))
torch.testing.assert_close(spec.impl(x), silu_and_mul_reference(x))
print(spec.name, spec.band.name)
"""


@pytest.fixture(scope="module")
def site(tmp_path_factory: pytest.TempPathFactory) -> Path:
    root = tmp_path_factory.mktemp("plugin")
    source = shutil.copytree(EXAMPLE, root / "source")  # the build leaves files beside its source
    target = root / "site"
    subprocess.run(
        [sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--no-build-isolation", "--no-index",
         "--target", str(target), str(source)],
        check=True,
    )
    assert (target / "tokenspeed_example_plugin-0.1.0.dist-info" / "entry_points.txt").is_file()
    return target


def run(site: Path, *args: str, **env: str) -> str:
    path = os.pathsep.join([str(site), str(REPO), os.environ.get("PYTHONPATH", "")])
    done = subprocess.run(
        [sys.executable, *args], env={**os.environ, "PYTHONPATH": path, **env},
        capture_output=True, text=True, check=True,
    )
    return done.stdout


def test_tokenspeed_kernels_lists_the_plugin_in_the_plugin_band_and_picks_it(site: Path) -> None:
    listing = run(site, "-m", "tokenspeed.cli", "kernels", "--family", "activation")
    assert "activation.silu_and_mul [platform=cpu dtype=float32] -> example_plugin" in listing
    assert re.search(r"\* example_plugin +PLUGIN +eligible", listing), listing


def test_selection_picks_the_plugin_and_the_override_switches_it_off(site: Path) -> None:
    assert run(site, "-c", SELECT).split() == ["example_plugin", "PLUGIN"]
    off = run(site, "-c", SELECT, TOKENSPEED_KERNEL_ACTIVATION_SILU_AND_MUL="reference")
    assert off.split() == ["reference", "REFERENCE"]


def test_without_the_plugin_installed_the_builtin_is_picked() -> None:
    listing = run(Path(), "-m", "tokenspeed.cli", "kernels", "--family", "activation")
    assert "example_plugin" not in listing
