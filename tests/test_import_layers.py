"""Packages import only downward: every `tokenspeed` import, read from the source, respects LAYERS.

A package may import itself and anything earlier in LAYERS, never anything
later. Every import counts, also those inside functions and under
`TYPE_CHECKING`: a lazy or type-only import upward is still a dependency
upward. `placement` and `spec` do not exist yet; their places are reserved
so that tensor parallelism and speculative decoding land where they belong.
The order is explained in docs/architecture.md.
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "tokenspeed"

LAYERS = (
    "errors",  # typed errors, no dependencies
    "kvcache",  # page pool, block tables, prefix index (no torch)
    "scheduler",  # request FSM, plans, sampling parameters, admission (no torch)
    "batch",  # ForwardBatch, AttentionMetadata, HostBatch, PagedKVStorage: records of one step
    "kernels",  # registry and kernels
    "placement",  # parallel layouts, the placement compiler, process groups and collectives
    "layers",  # nn.Modules, attention backends, MLA/MoE/rope configs
    "models",  # HF config -> model, weight loading, presets
    "config",  # EngineConfig
    "executor",  # Executor, runner, sampler, CUDA graphs, page tables
    "spec",  # speculative decoding: drafters, verification
    "grammar",  # structured output: grammar compilation, per-request matchers, masks per step
    "engine",  # EngineCore, LLM, AsyncEngine, IPC, detokenizer
    "tokenspeed",  # the package facade (`from tokenspeed import LLM, SamplingParams`)
    "engine_args",  # command-line engine options
    "eval_ppl",  # `tokenspeed eval-ppl`: held-out bits per byte through the engine
    "api",  # HTTP server
    "grpc",  # the TokenSpeedScheduler gRPC service of one engine replica (smg's worker protocol)
    "gateway",  # smg in front of N replicas: starts, watches and stops them
    "bench",  # benchmarks
    "cli",  # the `tokenspeed` command
)
RANK = {name: rank for rank, name in enumerate(LAYERS)}
TOP_LEVEL = {p.stem for p in PACKAGE.iterdir() if p.suffix == ".py" and p.stem != "__init__"} | {
    p.name for p in PACKAGE.iterdir() if (p / "__init__.py").is_file()
}


def _layer_of_file(path: Path) -> str:
    parts = path.relative_to(PACKAGE).with_suffix("").parts
    return "tokenspeed" if parts == ("__init__",) else parts[0]


def _imported_layers(source: str, package: tuple[str, ...]) -> list[tuple[int, str]]:
    """(line, layer) of every `tokenspeed` import in one module's source, in line order; `package` is
    the module's package (`("tokenspeed", "kernels")`), against which relative imports resolve."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(source)):
        targets: list[list[str]] = []
        if isinstance(node, ast.Import):
            targets = [alias.name.split(".") for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module.split(".") if node.module else []
            if node.level:
                base = list(package[: len(package) - node.level + 1]) + base
            if base == ["tokenspeed"]:  # `from tokenspeed import errors` names a module, `LLM` the facade
                targets = [["tokenspeed", alias.name] for alias in node.names]
            else:
                targets = [base]
        for parts in targets:
            if parts[0] == "tokenspeed":
                found.append((node.lineno, parts[1] if len(parts) > 1 and parts[1] in TOP_LEVEL else "tokenspeed"))
    return sorted(found)


def test_every_package_has_a_layer() -> None:
    assert not TOP_LEVEL - set(LAYERS), f"add {sorted(TOP_LEVEL - set(LAYERS))} to LAYERS (and docs/architecture.md)"


def test_no_package_imports_upward() -> None:
    upward: list[str] = []
    files = sorted(PACKAGE.rglob("*.py"))
    assert len(files) > 100
    for path in files:
        layer = _layer_of_file(path)
        package = path.relative_to(PACKAGE.parent).parts[:-1]
        for line, target in _imported_layers(path.read_text(), package):
            if RANK[target] > RANK[layer]:
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {layer} imports {target}")
    assert not upward, "upward imports:\n" + "\n".join(upward)


def test_the_walker_sees_upward_imports() -> None:
    """The check can fail: an import of each kind is attributed to the layer it reaches."""
    source = (
        "from __future__ import annotations\n"
        "from typing import TYPE_CHECKING\n"
        "if TYPE_CHECKING:\n"
        "    from tokenspeed.executor.sampler import Sampler\n"
        "def f():\n"
        "    import tokenspeed.engine.core\n"
        "from tokenspeed import LLM\n"
        "from tokenspeed import errors\n"
        "from ..layers import attention\n"
        "from . import registry\n"
    )
    found = _imported_layers(source, ("tokenspeed", "kernels"))
    assert [layer for _, layer in found] == ["executor", "engine", "tokenspeed", "errors", "layers", "kernels"]
    assert all(RANK[layer] > RANK["kernels"] for layer in ("executor", "engine", "tokenspeed", "layers"))
