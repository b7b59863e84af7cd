"""Kernel registry: band ordering, filtering, overrides, and clear failures."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest
import torch

from tokenspeed.kernels import (
    Band,
    KernelSelectionError,
    check_override_environment,
    clear_kernel_overrides,
    describe_selection,
    list_kernels,
    register_kernel,
    select_kernel,
    set_kernel_override,
    unregister_kernel,
)
from tokenspeed.kernels.registry import override_env_var

FAMILY = "testfamily"


def _impl(tag: str) -> Callable[[], str]:
    def kernel() -> str:
        return tag

    kernel.__qualname__ = f"kernel_{tag}"
    return kernel


@pytest.fixture
def family(request: pytest.FixtureRequest) -> Iterator[str]:
    """A registry family private to one test, removed afterwards."""
    mode = request.node.name.replace("[", "_").replace("]", "")
    yield mode
    clear_kernel_overrides()
    for spec in list_kernels(FAMILY):
        if spec.mode == mode:
            unregister_kernel(FAMILY, mode, spec.name)


def _register(
    mode: str, name: str, band: Band, platforms: tuple[str, ...] = ("cpu", "cuda"), **kw: object
) -> None:
    register_kernel(FAMILY, mode, name=name, band=band, platforms=platforms, impl=_impl(name), **kw)


def test_highest_band_wins(family: str) -> None:
    _register(family, "ref", Band.REFERENCE)
    _register(family, "triton", Band.PORTABLE)
    _register(family, "tuned", Band.SPECIALIZED)
    _register(family, "other", Band.PERFORMANT)
    assert select_kernel(FAMILY, family, platform="cuda").name == "tuned"
    assert select_kernel(FAMILY, family, platform="cuda")() == "tuned"  # a spec is callable


def test_reference_not_auto_picked_on_gpu_unless_alone(family: str) -> None:
    _register(family, "ref", Band.REFERENCE)
    assert select_kernel(FAMILY, family, platform="cuda").name == "ref"
    _register(family, "triton", Band.PORTABLE, platforms=("cuda",))
    assert select_kernel(FAMILY, family, platform="cuda").name == "triton"
    assert select_kernel(FAMILY, family, platform="cpu").name == "ref"


def test_filters_platform_dtype_traits_workload(family: str) -> None:
    _register(family, "ref", Band.REFERENCE)
    _register(family, "bf16_only", Band.PERFORMANT, platforms=("cuda",), dtypes=(torch.bfloat16,))
    _register(family, "no_window", Band.SPECIALIZED, platforms=("cuda",), traits={"sliding_window": False})
    _register(family, "heads", Band.PLUGIN, platforms=("cuda",), traits={"head_dim": (64, 128)})
    _register(family, "decode", Band.PLUGIN, platforms=("cuda",), workload={"q_len": (1, 1)})

    def pick(**kw: object) -> str:
        return select_kernel(FAMILY, family, platform="cuda", **kw).name  # type: ignore[arg-type]

    assert pick(dtype=torch.float16, traits={"sliding_window": True, "head_dim": 96}) == "ref"
    assert pick(dtype=torch.bfloat16, traits={"sliding_window": True, "head_dim": 96}) == "bf16_only"
    assert pick(dtype=torch.float16, traits={"sliding_window": False, "head_dim": 96}) == "no_window"
    assert pick(traits={"head_dim": 128}) == "heads"  # membership in a declared collection
    assert pick(traits={"head_dim": 96}, workload={"q_len": 1}) == "decode"
    # A restricted workload dimension must be stated and covered.
    assert pick(traits={"head_dim": 96}, workload={"q_len": (1, 8)}) == "no_window"
    assert pick(traits={"head_dim": 96}) == "no_window"
    assert select_kernel(FAMILY, family, platform="cpu", traits={"head_dim": 128}).name == "ref"


def test_equal_bands_keep_registration_order(family: str) -> None:
    _register(family, "first", Band.PORTABLE)
    _register(family, "second", Band.PORTABLE)
    assert select_kernel(FAMILY, family, platform="cuda").name == "first"


def test_env_override_and_api_override(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _register(family, "ref", Band.REFERENCE)
    _register(family, "fast", Band.PORTABLE)
    var = override_env_var(FAMILY, family)
    assert var == f"TOKENSPEED_KERNEL_{FAMILY.upper()}_{family.upper()}"
    monkeypatch.setenv(var, "ref")
    assert select_kernel(FAMILY, family, platform="cuda").name == "ref"
    assert "forced by $" + var in describe_selection(FAMILY, family, platform="cuda").reason
    set_kernel_override(FAMILY, family, "fast")  # the API (CLI --kernel) wins over the environment
    assert select_kernel(FAMILY, family, platform="cuda").name == "fast"
    set_kernel_override(FAMILY, family, None)
    assert select_kernel(FAMILY, family, platform="cuda").name == "ref"


def test_bad_overrides_fail_loudly(family: str, monkeypatch: pytest.MonkeyPatch) -> None:
    _register(family, "ref", Band.REFERENCE)
    _register(family, "gpu", Band.PORTABLE, platforms=("cuda",))
    monkeypatch.setenv(override_env_var(FAMILY, family), "nonexistent")
    with pytest.raises(KernelSelectionError, match="names no kernel"):
        select_kernel(FAMILY, family, platform="cuda")
    monkeypatch.setenv(override_env_var(FAMILY, family), "gpu")
    with pytest.raises(KernelSelectionError, match="cannot serve"):
        select_kernel(FAMILY, family, platform="cpu")


def test_no_match_and_unknown_names_raise_clearly(family: str) -> None:
    _register(family, "gpu", Band.PORTABLE, platforms=("cuda",))
    with pytest.raises(KernelSelectionError, match=r"platform 'cpu' not in \['cuda'\]"):
        select_kernel(FAMILY, family, platform="cpu")
    with pytest.raises(KernelSelectionError, match="unknown kernel family 'nosuchfamily'.*attention"):
        select_kernel("nosuchfamily", "x", platform="cpu")
    with pytest.raises(KernelSelectionError, match="unknown mode 'nosuchmode'.*decode"):
        select_kernel("attention", "nosuchmode", platform="cpu")


def test_an_override_naming_nothing_is_refused_with_the_valid_names(monkeypatch: pytest.MonkeyPatch) -> None:
    # `attention.paged` was once documented as the off switch while selecting nothing: no silent no-op.
    with pytest.raises(KernelSelectionError, match="unknown mode 'paged'.*known modes: decode, extend"):
        set_kernel_override("attention", "paged", "reference")
    with pytest.raises(KernelSelectionError, match="unknown kernel family 'atention'.*attention"):
        set_kernel_override("atention", "decode", "reference")
    with pytest.raises(KernelSelectionError, match="no kernel 'refernce' serves attention.decode; known: .*reference"):
        set_kernel_override("attention", "decode", "refernce")
    set_kernel_override("attention", "decode", "reference")  # the real off switch
    clear_kernel_overrides()

    check_override_environment()
    monkeypatch.setenv("TOKENSPEED_KERNEL_ATTENTION_PAGED", "reference")
    with pytest.raises(KernelSelectionError, match="TOKENSPEED_KERNEL_ATTENTION_PAGED names no.*ATTENTION_DECODE"):
        check_override_environment()


def test_decorator_form_and_duplicates(family: str) -> None:
    @register_kernel(FAMILY, family, name="decorated", band=Band.PORTABLE, platforms=("cpu",))
    def decorated() -> str:
        return "decorated"

    assert select_kernel(FAMILY, family, platform="cpu").impl is decorated
    with pytest.raises(ValueError, match="already registered"):
        _register(family, "decorated", Band.PORTABLE)


def test_describe_selection_explains_every_candidate(family: str) -> None:
    _register(family, "ref", Band.REFERENCE)
    _register(family, "gpu", Band.PORTABLE, platforms=("cuda",))
    report = describe_selection(FAMILY, family, platform="cpu", dtype=torch.float32)
    assert report.chosen == "ref"
    text = str(report)
    assert "* ref" in text and "gpu" in text and "rejected: platform 'cpu'" in text


@pytest.mark.parametrize(
    ("family_name", "mode"),
    [("attention", "extend"), ("norm", "rms"), ("rope", "apply"), ("activation", "silu_and_mul")],
)
@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_builtin_references_are_registered_for_cpu_and_cuda(
    family_name: str, mode: str, platform: str
) -> None:
    spec = select_kernel(family_name, mode, platform=platform, dtype=torch.bfloat16)
    # On the CPU: the reference, or a torch kernel written for the CPU alone (e.g. extend's torch_sdpa).
    assert spec.band == Band.REFERENCE or platform == "cuda" or spec.platforms == frozenset({"cpu"})
    assert any(s.name == "reference" for s in list_kernels(family_name) if s.mode == mode)
