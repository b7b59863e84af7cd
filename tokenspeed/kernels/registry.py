"""Kernel registry: every hot op is looked up here once, when a model is built.

Why a registry rather than direct calls: the same layer code must run on a
laptop CPU (torch reference), on any GPU (Triton), and on one tuned chip
(specialised kernels or third-party plugins), and a user must be able to force
any of them (`--kernel attention.decode=reference`) to bisect a numerical
problem. Layers therefore ask `select_kernel(family, mode, ...)` in their
constructor and keep the returned callable; nothing is looked up per call.

Selection rules, in order:
1. an override (API `set_kernel_override`, then env
   `TOKENSPEED_KERNEL_<FAMILY>_<MODE>`) names the kernel outright; it must
   still support the request, otherwise selection fails loudly;
2. keep kernels whose platforms contain the platform, whose dtypes (if
   declared) contain the dtype, whose declared traits accept the requested
   traits, and whose workload ranges cover the requested workload;
3. on a non-CPU platform drop REFERENCE kernels when anything else is left;
4. take the highest band; ties go to the earliest registration.

Traits and workload ranges on a kernel are *restrictions*: a kernel that does
not mention a trait accepts any value of it. A kernel that restricts a
workload dimension is only chosen when the caller states that dimension.
"""

from __future__ import annotations

import logging
import os
import re
import threading
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from enum import IntEnum
from importlib import import_module, metadata
from typing import Any, TypeVar, overload

import torch

from tokenspeed.errors import TokenSpeedError

logger = logging.getLogger("tokenspeed.kernels")

F = TypeVar("F", bound=Callable[..., Any])
WorkloadValue = int | tuple[int, int]

ENV_PREFIX = "TOKENSPEED_KERNEL_"
PLUGIN_ENTRY_POINT_GROUP = "tokenspeed.kernels"

# Modules whose import registers the built-in kernels. Loaded lazily on the first
# query so importing the registry stays cheap and free of import cycles.
_BUILTIN_MODULES = (
    "tokenspeed.kernels.attention.paged_reference",
    "tokenspeed.kernels.attention.decode_torch_batched",
    "tokenspeed.kernels.attention.extend_torch_sdpa",
    "tokenspeed.kernels.kvstore.reference",
    "tokenspeed.kernels.norm.rms_reference",
    "tokenspeed.kernels.norm.rms_cpu",
    "tokenspeed.kernels.rope.reference",
    "tokenspeed.kernels.activation.reference",
    "tokenspeed.kernels.sampling.reference",
    "tokenspeed.kernels.sampling.bitmask_reference",
    "tokenspeed.kernels.gemm.reference",
    "tokenspeed.kernels.gemm.fp8_reference",
    "tokenspeed.kernels.quant.fp8",
    "tokenspeed.kernels.mla.reference",
    "tokenspeed.kernels.moe.routing_reference",
    "tokenspeed.kernels.moe.experts_reference",
    "tokenspeed.kernels.moe.experts_grouped_mm",
    "tokenspeed.kernels.moe.experts_fp8_reference",
    "tokenspeed.kernels.comm.reference",
    "tokenspeed.kernels.staging.step_inputs",
)
# Triton (PORTABLE) kernels: skipped, with a debug note, where triton is not installed.
_TRITON_MODULES = (
    "tokenspeed.kernels.kvstore.write_triton",
    "tokenspeed.kernels.kvstore.rope_write_triton",
    "tokenspeed.kernels.attention.decode_triton",
    "tokenspeed.kernels.attention.extend_triton",
    "tokenspeed.kernels.norm.rms_triton",
    "tokenspeed.kernels.rope.rope_triton",
    "tokenspeed.kernels.activation.silu_triton",
    "tokenspeed.kernels.sampling.sample_triton",
    "tokenspeed.kernels.sampling.argmax_triton",
    "tokenspeed.kernels.sampling.bitmask_triton",
    "tokenspeed.kernels.moe.experts_triton",
    "tokenspeed.kernels.moe.experts_fp8_triton",
    "tokenspeed.kernels.moe.routing_triton",
    "tokenspeed.kernels.moe.router_logits_triton",
    "tokenspeed.kernels.mla.write_triton",
    "tokenspeed.kernels.mla.decode_triton",
    "tokenspeed.kernels.mla.extend_triton",
    "tokenspeed.kernels.gemm.gemv_triton",
    "tokenspeed.kernels.gemm.fp8_gemm_triton",
    "tokenspeed.kernels.gemm.fp8_gemv_triton",
    "tokenspeed.kernels.gemm.fp8_scaled_mm",
    "tokenspeed.kernels.quant.quantize_triton",
    "tokenspeed.kernels.comm.fused_allreduce_rmsnorm_triton",
    "tokenspeed.kernels.staging.step_inputs_triton",
)


class Band(IntEnum):
    """How much a kernel is trusted to be fast; higher wins."""

    REFERENCE = 0  # torch, obviously correct, the oracle of tests
    PORTABLE = 1  # Triton, runs on any supported GPU
    PERFORMANT = 2  # hand-tuned library kernels
    SPECIALIZED = 3  # tuned for one chip or shape
    PLUGIN = 4  # third party, from the `tokenspeed.kernels` entry-point group


class KernelSelectionError(TokenSpeedError, LookupError):
    """No kernel fits the request, or an override names one that cannot serve it."""


@dataclass(frozen=True, slots=True)
class KernelSpec:
    family: str
    mode: str
    name: str
    band: Band
    platforms: frozenset[str]
    impl: Callable[..., Any]
    dtypes: frozenset[torch.dtype] | None = None
    traits: Mapping[str, Any] = field(default_factory=dict)
    workload: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    @property
    def key(self) -> str:
        return f"{self.family}.{self.mode}"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        return self.impl(*args, **kwargs)

    def rejection(
        self,
        platform: str,
        dtype: torch.dtype | None,
        traits: Mapping[str, Any],
        workload: Mapping[str, WorkloadValue],
    ) -> str | None:
        """Why this kernel cannot serve the request, or None when it can."""
        if platform not in self.platforms:
            return f"platform {platform!r} not in {sorted(self.platforms)}"
        if dtype is not None and self.dtypes is not None and dtype not in self.dtypes:
            return f"dtype {dtype} not in {sorted(str(d) for d in self.dtypes)}"
        for key, wanted in traits.items():
            if key in self.traits and not _trait_accepts(self.traits[key], wanted):
                return f"trait {key}={wanted!r} not accepted (kernel has {self.traits[key]!r})"
        for key, (lo, hi) in self.workload.items():
            if key not in workload:
                return f"workload {key!r} restricted to [{lo}, {hi}] but not stated"
            want_lo, want_hi = _as_range(workload[key])
            if want_lo < lo or want_hi > hi:
                return f"workload {key}={workload[key]!r} outside [{lo}, {hi}]"
        return None


@dataclass(frozen=True, slots=True)
class CandidateVerdict:
    name: str
    band: Band
    rejected_because: str | None  # None: eligible


@dataclass(frozen=True, slots=True)
class SelectionReport:
    """What `select_kernel` would pick for one request, and why."""

    family: str
    mode: str
    platform: str
    dtype: torch.dtype | None
    chosen: str | None
    reason: str
    candidates: tuple[CandidateVerdict, ...]
    reference_fallback: bool = False  # a REFERENCE kernel won on a non-CPU platform

    def __str__(self) -> str:
        dtype = "any" if self.dtype is None else str(self.dtype).removeprefix("torch.")
        lines = [
            f"{self.family}.{self.mode} [platform={self.platform} dtype={dtype}] -> {self.chosen}: {self.reason}"
        ]
        for c in self.candidates:
            mark = "*" if c.name == self.chosen else " "
            verdict = "eligible" if c.rejected_because is None else f"rejected: {c.rejected_because}"
            lines.append(f"  {mark} {c.name:<24} {c.band.name:<12} {verdict}")
        return "\n".join(lines)


_lock = threading.RLock()
_kernels: dict[tuple[str, str], list[KernelSpec]] = {}
_overrides: dict[tuple[str, str], str] = {}
_builtins_loaded = False
_fallbacks_warned: set[tuple[str, str, str]] = set()
_plugins_loaded = False


def _trait_accepts(declared: Any, wanted: Any) -> bool:
    if isinstance(declared, Collection) and not isinstance(declared, str | bytes):
        return wanted in declared
    return bool(declared == wanted)


def _as_range(value: WorkloadValue) -> tuple[int, int]:
    if isinstance(value, tuple):
        return int(value[0]), int(value[1])
    return int(value), int(value)


def _normalise(name: str) -> str:
    return name.strip().lower()


@overload
def register_kernel(
    family: str,
    mode: str,
    *,
    name: str,
    band: Band,
    platforms: Iterable[str],
    dtypes: Iterable[torch.dtype] | None = None,
    traits: Mapping[str, Any] | None = None,
    workload: Mapping[str, tuple[int, int]] | None = None,
    impl: None = None,
) -> Callable[[F], F]: ...


@overload
def register_kernel(
    family: str,
    mode: str,
    *,
    name: str,
    band: Band,
    platforms: Iterable[str],
    dtypes: Iterable[torch.dtype] | None = None,
    traits: Mapping[str, Any] | None = None,
    workload: Mapping[str, tuple[int, int]] | None = None,
    impl: F,
) -> F: ...


def register_kernel(
    family: str,
    mode: str,
    *,
    name: str,
    band: Band,
    platforms: Iterable[str],
    dtypes: Iterable[torch.dtype] | None = None,
    traits: Mapping[str, Any] | None = None,
    workload: Mapping[str, tuple[int, int]] | None = None,
    impl: F | None = None,
) -> F | Callable[[F], F]:
    """Register `impl` (or, used as a decorator, the decorated function) as `family.mode=name`."""

    def add(fn: F) -> F:
        spec = KernelSpec(
            family=_normalise(family),
            mode=_normalise(mode),
            name=_normalise(name),
            band=Band(band),
            platforms=frozenset(p.lower() for p in platforms),
            impl=fn,
            dtypes=None if dtypes is None else frozenset(dtypes),
            traits=dict(traits or {}),
            workload={k: (int(lo), int(hi)) for k, (lo, hi) in (workload or {}).items()},
        )
        with _lock:
            specs = _kernels.setdefault((spec.family, spec.mode), [])
            for i, old in enumerate(specs):
                if old.name == spec.name:
                    if getattr(old.impl, "__qualname__", None) != getattr(fn, "__qualname__", None):
                        raise ValueError(f"kernel {spec.key}={spec.name} is already registered")
                    specs[i] = spec  # module re-import: same kernel, replace in place
                    return fn
            specs.append(spec)
        return fn

    if impl is not None:
        return add(impl)
    return add


def unregister_kernel(family: str, mode: str, name: str) -> None:
    """Remove one kernel (tests, or a plugin withdrawing a kernel it found broken); unknown names raise."""
    key = (_normalise(family), _normalise(mode))
    with _lock:
        specs = _kernels.get(key, [])
        kept = [s for s in specs if s.name != _normalise(name)]
        if len(kept) == len(specs):
            raise KernelSelectionError(f"no kernel {family}.{mode}={name} to unregister")
        if kept:
            _kernels[key] = kept
        else:
            del _kernels[key]


def set_kernel_override(family: str, mode: str, name: str | None) -> None:
    """Force `family.mode` to the kernel `name` (None clears). Wins over the environment variable.

    An override naming no registered family, mode or kernel raises at once, listing the valid
    ones: one that selected nothing would be silently ignored (no layer ever asks for it).
    """
    if name is not None:
        check_kernel_override(family, mode, name)
    with _lock:
        key = (_normalise(family), _normalise(mode))
        if name is None:
            _overrides.pop(key, None)
        else:
            _overrides[key] = _normalise(name)


def clear_kernel_overrides() -> None:
    with _lock:
        _overrides.clear()


@contextmanager
def scoped_kernel_overrides(overrides: Iterable[tuple[str, str, str]]) -> Iterator[None]:
    """Apply `(family, mode, name)` overrides inside the block, then put back what was there.

    An engine's `kernel_overrides` are its own: layers pick their kernels while the model is
    built, so the overrides need to hold only then. Left in place they would silently change
    the kernels of the next engine (or test) built in the same process.
    """
    with _lock:
        saved = dict(_overrides)
    try:
        for family, mode, name in overrides:
            set_kernel_override(family, mode, name)
        yield
    finally:
        with _lock:
            _overrides.clear()
            _overrides.update(saved)


def check_kernel_override(family: str, mode: str, name: str) -> None:
    """Raise KernelSelectionError, listing what exists, unless `family.mode=name` is a registered kernel."""
    family, mode, name = _normalise(family), _normalise(mode), _normalise(name)
    names = [s.name for s in _candidates(family, mode)]  # raises on an unknown family or mode
    if name not in names:
        raise KernelSelectionError(f"no kernel {name!r} serves {family}.{mode}; known: {', '.join(names)}")


def check_override_environment() -> None:
    """Raise KernelSelectionError for a `TOKENSPEED_KERNEL_*` variable that names no family.mode.

    Selection reads only the variables of the modes layers ask for, so a misspelt
    one would otherwise be ignored without a word.
    """
    _ensure_loaded()
    with _lock:
        known = {override_env_var(family, mode): f"{family}.{mode}" for family, mode in _kernels}
    for var in sorted(v for v in os.environ if v.startswith(ENV_PREFIX)):
        if var not in known:
            raise KernelSelectionError(
                f"${var} names no kernel family and mode; valid variables: "
                + ", ".join(f"{v} ({key})" for v, key in sorted(known.items()))
            )


def override_env_var(family: str, mode: str) -> str:
    return ENV_PREFIX + re.sub(r"[^A-Z0-9]", "_", f"{family}_{mode}".upper())


def _override_for(family: str, mode: str) -> tuple[str, str] | None:
    """(kernel name, where the override came from), or None."""
    with _lock:
        forced = _overrides.get((family, mode))
    if forced is not None:
        return forced, "set_kernel_override"
    var = override_env_var(family, mode)
    value = os.environ.get(var, "").strip()
    if value:
        return _normalise(value), f"${var}"
    return None


def _load_builtins() -> None:
    global _builtins_loaded
    with _lock:
        if _builtins_loaded:
            return
        _builtins_loaded = True
    for module in _BUILTIN_MODULES:
        import_module(module)
    for module in _TRITON_MODULES:
        try:
            import_module(module)
        except ImportError as exc:
            if exc.name is None or not exc.name.startswith("triton"):
                raise
            logger.debug("triton is not importable; %s not registered", module)


def _load_plugins() -> None:
    """Import every `tokenspeed.kernels` entry point once; a callable entry point is called to register."""
    global _plugins_loaded
    with _lock:
        if _plugins_loaded:
            return
        _plugins_loaded = True
    for ep in metadata.entry_points(group=PLUGIN_ENTRY_POINT_GROUP):
        try:
            loaded = ep.load()
            if callable(loaded):
                loaded()
        except Exception:  # a broken plugin must not take the engine down; its kernels are just absent
            logger.warning("kernel plugin %s failed to load", ep.name, exc_info=True)


def _ensure_loaded() -> None:
    _load_builtins()
    _load_plugins()


def list_kernels(family: str | None = None) -> list[KernelSpec]:
    """Every registered kernel (optionally of one family), in registration order."""
    _ensure_loaded()
    with _lock:
        return [
            spec
            for (fam, _), specs in sorted(_kernels.items())
            if family is None or fam == _normalise(family)
            for spec in specs
        ]


def _candidates(family: str, mode: str) -> list[KernelSpec]:
    _ensure_loaded()
    with _lock:
        specs = list(_kernels.get((family, mode), ()))
        known_families = sorted({fam for fam, _ in _kernels})
        known_modes = sorted(m for fam, m in _kernels if fam == family)
    if specs:
        return specs
    if family not in known_families:
        raise KernelSelectionError(
            f"unknown kernel family {family!r}; known families: {', '.join(known_families)}"
        )
    raise KernelSelectionError(
        f"unknown mode {mode!r} of kernel family {family!r}; known modes: {', '.join(known_modes)}"
    )


def describe_selection(
    family: str,
    mode: str,
    *,
    platform: str,
    dtype: torch.dtype | None = None,
    traits: Mapping[str, Any] | None = None,
    workload: Mapping[str, WorkloadValue] | None = None,
) -> SelectionReport:
    """Explain which kernel `select_kernel` picks for these arguments (chosen is None when none fits)."""
    family, mode, platform = _normalise(family), _normalise(mode), platform.lower()
    traits, workload = dict(traits or {}), dict(workload or {})
    specs = _candidates(family, mode)
    verdicts = [
        CandidateVerdict(s.name, s.band, s.rejection(platform, dtype, traits, workload)) for s in specs
    ]
    by_name = {s.name: s for s in specs}

    def report(chosen: str | None, reason: str, fallback: bool = False) -> SelectionReport:
        return SelectionReport(family, mode, platform, dtype, chosen, reason, tuple(verdicts), fallback)

    override = _override_for(family, mode)
    if override is not None:
        name, source = override
        if name not in by_name:
            return report(None, f"override {source}={name!r} names no kernel; known: {', '.join(by_name)}")
        why_not = by_name[name].rejection(platform, dtype, traits, workload)
        if why_not is not None:
            return report(None, f"override {source}={name!r} cannot serve this request: {why_not}")
        return report(name, f"forced by {source}")

    eligible = [s for s, v in zip(specs, verdicts) if v.rejected_because is None]
    if not eligible:
        return report(None, "no registered kernel fits")
    if platform != "cpu" and any(s.band > Band.REFERENCE for s in eligible):
        eligible = [s for s in eligible if s.band > Band.REFERENCE]
    best = max(eligible, key=lambda s: s.band)  # max keeps the first of equal bands
    fallback = platform != "cpu" and best.band == Band.REFERENCE
    note = " (only a REFERENCE kernel fits: expect it to be slow)" if fallback else ""
    return report(best.name, f"highest band among eligible: {best.band.name}{note}", fallback)


def select_kernel(
    family: str,
    mode: str,
    *,
    platform: str,
    dtype: torch.dtype | None = None,
    traits: Mapping[str, Any] | None = None,
    workload: Mapping[str, WorkloadValue] | None = None,
) -> KernelSpec:
    """The kernel to use for `family.mode`; raises KernelSelectionError when none fits."""
    report = describe_selection(
        family, mode, platform=platform, dtype=dtype, traits=traits, workload=workload
    )
    if report.chosen is None:
        raise KernelSelectionError(f"cannot select a kernel:\n{report}")
    spec = next(s for s in _candidates(report.family, report.mode) if s.name == report.chosen)
    warn_key = (report.family, report.mode, report.platform)
    if report.reference_fallback and warn_key not in _fallbacks_warned:
        _fallbacks_warned.add(warn_key)
        logger.warning("%s.%s on %s uses the REFERENCE kernel %s (slow)", family, mode, platform, spec.name)
    return spec


def platform_of(device: torch.device | str) -> str:
    """Registry platform name of a torch device ("cpu", "cuda", ...)."""
    return torch.device(device).type
