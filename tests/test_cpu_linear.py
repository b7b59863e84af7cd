"""`executor/cpu_linear.py`: pre-packed fp32 linears (oneDNN) against `F.linear`, the size rule, the off
switches and the fallback."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from tokenspeed.executor import cpu_linear
from tokenspeed.kernels import cpu_small_gemm


def _needs_onednn() -> None:
    if cpu_linear.pack(torch.ones(8, 8)).packed is None:
        pytest.skip("this torch has no oneDNN packed linear")


@pytest.mark.parametrize("shape", [(384, 256), (1152, 256), (256, 576), (4096, 256)])
@pytest.mark.parametrize("rows", [0, 1, 2, 4, 16, 64, 130])
def test_packed_close_to_linear(monkeypatch: pytest.MonkeyPatch, shape: tuple[int, int], rows: int) -> None:
    """Packed from one row: within 1e-5 relative of `F.linear` (another summation order), any row count."""
    _needs_onednn()
    monkeypatch.setattr(cpu_linear, "ROWS_MIN_BY_SIZE", ((0, 1),))
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(shape, generator=gen) * shape[1] ** -0.5
    linear = cpu_linear.pack(weight, small=False)
    assert linear.packed is not None and linear.rows_min == 1
    x = torch.randn(rows, shape[1], generator=gen)
    with torch.inference_mode():
        got, want = linear(x), F.linear(x, weight)
    assert got.shape == want.shape and got.dtype == torch.float32
    if rows:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))


def test_non_contiguous_rows() -> None:
    _needs_onednn()
    weight = torch.randn(4096, 256)
    linear = cpu_linear.pack(weight)
    x = torch.randn(8, 512)[:, ::2]  # [8, 256], stride 2
    assert not x.is_contiguous()
    torch.testing.assert_close(linear(x), F.linear(x, weight), rtol=1e-5, atol=1e-4)


def test_rows_min_by_weight_size() -> None:
    """Measured crossovers (module docstring): weights from 2^18 elements from two rows, the embedded
    model's qkv / o_proj / down from `SMALL_WEIGHT_ROWS`; never one row."""
    assert cpu_linear.rows_min(torch.empty(4096, 256)) == 2
    assert cpu_linear.rows_min(torch.empty(1152, 256)) == 2
    for shape in ((384, 256), (256, 256), (256, 576)):
        assert cpu_linear.rows_min(torch.empty(shape)) == cpu_linear.SMALL_WEIGHT_ROWS


def test_below_rows_min_is_f_linear_bit_for_bit() -> None:
    weight = torch.randn(384, 256)
    linear = cpu_linear.pack(weight, small=False)
    x = torch.randn(4, 256)
    assert torch.equal(linear(x), F.linear(x, weight))


def test_off_switches(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.randn(4096, 256)
    x = torch.randn(3, 256)
    off = cpu_linear.pack(weight, enabled=False)
    assert off.packed is None and off.small is None and off.packed_bytes == 0
    assert torch.equal(off(x), F.linear(x, weight))
    monkeypatch.delenv(cpu_linear.ENV_SWITCH, raising=False)
    assert cpu_linear.prepack_enabled()
    monkeypatch.setenv(cpu_linear.ENV_SWITCH, "0")
    assert not cpu_linear.prepack_enabled()
    monkeypatch.setenv(cpu_linear.ENV_SWITCH, "1")
    assert cpu_linear.prepack_enabled()


def test_falls_back_without_the_ops(monkeypatch: pytest.MonkeyPatch) -> None:
    """No oneDNN (or a reorder that fails): the weight stays unpacked, `F.linear` runs."""
    weight = torch.randn(4096, 256)
    x = torch.randn(3, 256)
    monkeypatch.setattr(cpu_linear, "_packed_linear_op", lambda: None)
    assert cpu_linear.pack(weight).packed is None
    monkeypatch.undo()

    def broken(*args: object, **kwargs: object) -> torch.Tensor:
        raise RuntimeError("no reorder here")

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", broken, raising=False)
    linear = cpu_linear.pack(weight, small=False)
    assert linear.packed is None
    assert torch.equal(linear(x), F.linear(x, weight))


def test_non_fp32_weights_stay_unpacked() -> None:
    assert cpu_linear.pack(torch.randn(4096, 256, dtype=torch.bfloat16)).packed is None


native_small = pytest.mark.skipif(cpu_small_gemm.load_library() is None, reason="no C compiler")


@native_small
@pytest.mark.parametrize("shape", [(384, 256), (1152, 256), (256, 576), (4096, 256), (16, 8)])
@pytest.mark.parametrize("rows", [0, 1, 2, 3, 4, 5, 8, 9, 15, 16, 17, 40])
def test_small_gemm_close_to_linear(shape: tuple[int, int], rows: int) -> None:
    """The native small GEMM (any row count: tiles of 16, 8, 4, 2, 1) within 1e-5 relative of `F.linear`;
    `CPULinear` runs it up to `MAX_ROWS` rows, oneDNN or `F.linear` above."""
    gen = torch.Generator().manual_seed(rows)
    weight = torch.randn(shape, generator=gen) * shape[1] ** -0.5
    few = cpu_small_gemm.small_gemm(weight)
    assert few is not None
    x = torch.randn(rows, shape[1], generator=gen)
    got, want = few(x), F.linear(x, weight)
    assert got.shape == want.shape
    if rows:
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5 * float(want.abs().max()))
    linear = cpu_linear.pack(weight)
    assert linear.small is not None
    calls: list[int] = []
    small = linear.small
    linear.small = lambda t: calls.append(t.shape[0]) or small(t)  # type: ignore[assignment]
    linear(x)
    assert calls == ([rows] if rows <= cpu_small_gemm.MAX_ROWS else [])


@native_small
def test_small_gemm_strided_rows_shapes_and_switch(monkeypatch: pytest.MonkeyPatch) -> None:
    weight = torch.randn(64, 32)
    few = cpu_small_gemm.small_gemm(weight)
    assert few is not None
    x = torch.randn(5, 64)[:, ::2]  # rows of 32 at stride 64... and a column stride of 2
    torch.testing.assert_close(few(x), F.linear(x, weight), rtol=1e-5, atol=1e-5)
    rows = torch.randn(5, 48)[:, :32]  # contiguous last dim, row stride 48
    torch.testing.assert_close(few(rows), F.linear(rows, weight), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError):
        few(torch.randn(3, 31))
    with pytest.raises(ValueError):
        few(torch.randn(3, 32, dtype=torch.float64))
    assert cpu_small_gemm.small_gemm(torch.randn(40, 32)) is None  # outputs not a multiple of 16
    monkeypatch.setenv(cpu_small_gemm.ENV_SWITCH, "0")
    assert cpu_small_gemm.small_gemm(weight) is None and cpu_linear.pack(weight).small is None
