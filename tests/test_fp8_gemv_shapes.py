"""The FP8 decode GEMMs' per-GPU launch-shape tables (`kernels/gemm/fp8_gemv_shapes.py`): the one-token GEMV's
shapes by fused form, the skinny GEMM's by weight shape."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import pytest
import torch

from tokenspeed.kernels.gemm import fp8_gemv_triton as gemv
from tokenspeed.kernels.gemm import fp8_skinny_triton as skinny
from tokenspeed.kernels.gemm.fp8_gemv_shapes import (
    SHAPES_ENV,
    SHIPPED_DIR,
    form_key,
    gpu_file_name,
    read_table,
    skinny_key,
    table_for,
    write_table,
)
from tokenspeed.kernels.quant.fp8 import PER_CHANNEL_BLOCK, WEIGHT_BLOCK, quantize_weight_block

CHOOSE_CONFIG = gemv.choose_config  # the cached function itself (one test wraps it in a spy)
SHAPE = gemv.Fp8GemvConfig(block_n=16, groups=8, num_warps=4, stages=3)  # one of launch_shapes(4096)


@pytest.fixture(autouse=True)
def _fresh_tables(monkeypatch: pytest.MonkeyPatch):
    monkeypatch.delenv(SHAPES_ENV, raising=False)
    _forget_tables()
    yield
    _forget_tables()


def _forget_tables() -> None:
    """The env names another table: drop what the cached lookups read."""
    table_for.cache_clear()
    CHOOSE_CONFIG.cache_clear()
    skinny.measured_skinny_shape.cache_clear()


def test_form_keys_name_the_fused_form_the_row_length_and_the_scale_kind() -> None:
    assert form_key(4096, norm=True, residual=False, silu_mul=False, whole_rows=True) == "norm/4096/rows"
    assert form_key(4096, norm=True, residual=False, silu_mul=True, whole_rows=False) == "silu_mul/4096/blocks"
    assert form_key(14336, norm=False, residual=True, silu_mul=False, whole_rows=True) == "residual/14336/rows"
    assert form_key(128, norm=False, residual=False, silu_mul=False, whole_rows=True) == "plain/128/rows"
    assert gpu_file_name("NVIDIA H100 80GB HBM3") == "nvidia_h100_80gb_hbm3.json"
    assert skinny_key(6144, 4096, whole_rows=True) == "skinny/6144x4096/rows"
    assert skinny_key(4096, 14336, whole_rows=False) == "skinny/4096x14336/blocks"


def test_a_table_from_the_env_decides_its_forms_and_only_those(tmp_path: Path, monkeypatch) -> None:
    table = tmp_path / "shapes.json"
    write_table(table, "test gpu", "sweep 1", {"residual/4096/rows": asdict(SHAPE)})
    write_table(table, "test gpu", "sweep 2", {"norm/4096/blocks": asdict(SHAPE)})  # merged, not replaced
    assert set(read_table(table)) == {"residual/4096/rows", "norm/4096/blocks"}
    builtin = gemv.choose_config(4096, block_size=PER_CHANNEL_BLOCK, residual=True)
    assert builtin != SHAPE
    monkeypatch.setenv(SHAPES_ENV, str(table))
    _forget_tables()
    assert gemv.choose_config(4096, block_size=PER_CHANNEL_BLOCK, residual=True) == SHAPE
    assert gemv.choose_config(4096, block_size=(128, 128), norm=True) == SHAPE
    # Another form, row length or scale kind keeps the built-in rule.
    assert gemv.choose_config(4096, block_size=(128, 128), residual=True) == builtin
    assert gemv.choose_config(2048, block_size=PER_CHANNEL_BLOCK, residual=True) != SHAPE
    monkeypatch.setenv(SHAPES_ENV, "none")
    _forget_tables()
    assert gemv.choose_config(4096, block_size=PER_CHANNEL_BLOCK, residual=True) == builtin


def test_a_malformed_table_is_a_clear_error(tmp_path: Path, monkeypatch) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"shapes": {"norm/4096/rows": {"block_n": 8}}}))
    monkeypatch.setenv(SHAPES_ENV, str(bad))
    with pytest.raises(ValueError, match="must have exactly the fields"):
        table_for("any")
    # A skinny entry with the one-token GEMV's fields (f16_math, no split_k) is as wrong.
    bad.write_text(json.dumps({"shapes": {"skinny/64x128/rows": asdict(SHAPE)}}))
    _forget_tables()
    with pytest.raises(ValueError, match="'skinny/64x128/rows' must have exactly the fields .*split_k"):
        table_for("any")
    monkeypatch.setenv(SHAPES_ENV, str(tmp_path / "missing.json"))
    _forget_tables()
    with pytest.raises(ValueError, match="cannot read"):
        table_for("any")


def test_the_kernel_launches_the_tables_shape_for_its_fused_form(tmp_path: Path, monkeypatch) -> None:
    """The wrapper hands the form it runs (norm / residual / silu_mul) and the GPU to the table's lookup."""
    seen: list[dict] = []
    real = gemv.choose_config

    def spy(k, **kwargs):
        seen.append(kwargs)
        return real(k, **kwargs)

    monkeypatch.setattr(gemv, "choose_config", spy)
    monkeypatch.setattr(gemv, "for_tensor", lambda kernel, tensor: _NoLaunch())  # the launch is not the point
    x = torch.randn(1, 128)
    w8, scale = quantize_weight_block(torch.randn(64, 128), PER_CHANNEL_BLOCK)
    gemv.fp8_gemv_triton(x, w8, scale, block_size=PER_CHANNEL_BLOCK, residual=torch.zeros(1, 64))
    gemv.fp8_gemv_triton(x, w8, scale, block_size=PER_CHANNEL_BLOCK, norm_weight=torch.ones(128), eps=1e-5)
    assert [(s["norm"], s["residual"], s["silu_mul"], s["gpu_name"]) for s in seen] == [
        (False, True, False, ""), (True, False, False, "")]


class _NoLaunch:
    def __getitem__(self, grid):
        return lambda *args, **kwargs: None


def test_a_table_may_only_name_shapes_the_kernel_offers(tmp_path: Path, monkeypatch) -> None:
    """The tests run every shape of `launch_shapes`; a table naming another (a hand-edited or stale one) is refused
    when the form is first launched, not compiled untested."""
    table = tmp_path / "shapes.json"
    odd = gemv.Fp8GemvConfig(block_n=64, groups=1, num_warps=2, stages=1)
    write_table(table, "test gpu", "by hand", {"norm/4096/rows": asdict(odd)})
    monkeypatch.setenv(SHAPES_ENV, str(table))
    with pytest.raises(ValueError, match="norm/4096/rows names .* not one of the kernel's launch_shapes"):
        gemv.choose_config(4096, block_size=PER_CHANNEL_BLOCK, norm=True)


SKINNY = skinny.SkinnyConfig(64, 2, 3, split_k=2)  # one of skinny_shapes(), not the tuner's default


def test_a_table_decides_the_skinny_launch_of_its_weight_shapes_and_the_tuner_the_others(
    tmp_path: Path, monkeypatch
) -> None:
    """Where the table has a weight shape (rows x K, scale kind) its shape launches and nothing is timed; another
    shape or scale kind goes to the launch tuner, as without a table."""
    table = tmp_path / "shapes.json"
    write_table(table, "test gpu", "skinny sweep", {skinny_key(64, 128, whole_rows=True): asdict(SKINNY),
                                                     skinny_key(64, 256, whole_rows=True): asdict(SKINNY)})
    write_table(table, "test gpu", "one-token sweep", {"norm/128/rows": asdict(SHAPE)})  # both kinds in one table
    monkeypatch.setenv(SHAPES_ENV, str(table))
    launched: list[tuple[int, int]] = []  # (block_n, split_k) of each launch
    monkeypatch.setattr(skinny, "for_tensor", lambda kernel, tensor: _Recorder(launched))
    tuned: list[tuple] = []
    monkeypatch.setattr(skinny, "_SKINNY_TUNER", _TunerSpy(tuned))
    x = torch.randn(3, 128)
    per_channel = quantize_weight_block(torch.randn(64, 128), PER_CHANNEL_BLOCK)
    gemv.fp8_gemv_triton(x, *per_channel, block_size=PER_CHANNEL_BLOCK)
    assert launched == [(SKINNY.block_n, 1)] and tuned == []  # K = 128 is one step: split 2 runs whole
    assert skinny.measured_skinny_shape(64, 128, PER_CHANNEL_BLOCK, "") == SKINNY
    blocks = quantize_weight_block(torch.randn(64, 256), (128, 128))  # two K blocks: the table has only "rows"
    gemv.fp8_gemv_triton(torch.randn(3, 256), *blocks, block_size=(128, 128))
    gemv.fp8_gemv_triton(x, *quantize_weight_block(torch.randn(32, 128), PER_CHANNEL_BLOCK), block_size=PER_CHANNEL_BLOCK)
    assert [key[:2] for key in tuned] == [(64, 256), (32, 128)]  # the tuner for both
    monkeypatch.setenv(SHAPES_ENV, "none")
    _forget_tables()
    assert skinny.measured_skinny_shape(64, 128, PER_CHANNEL_BLOCK, "") is None


class _TunerSpy:
    """The launch tuner's `choose`: records the key, answers the default (the CPU never times)."""

    def __init__(self, keys: list[tuple]) -> None:
        self.keys = keys

    def choose(self, key, device, run):
        self.keys.append(key)
        return skinny.skinny_candidates(key)[0]


class _Recorder:
    def __init__(self, launched: list[tuple[int, int]]) -> None:
        self.launched = launched

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            self.launched.append((kwargs["BLOCK_N"], kwargs["SPLIT_K"]))

        return launch


def test_a_table_may_only_name_skinny_shapes_the_kernel_offers(tmp_path: Path, monkeypatch) -> None:
    table = tmp_path / "shapes.json"
    odd = skinny.SkinnyConfig(16, 1, 2, split_k=3)
    write_table(table, "test gpu", "by hand", {skinny_key(64, 128, whole_rows=True): asdict(odd)})
    monkeypatch.setenv(SHAPES_ENV, str(table))
    with pytest.raises(ValueError, match="skinny/64x128/rows names .* not one of the skinny GEMM's skinny_shapes"):
        skinny.measured_skinny_shape(64, 128, PER_CHANNEL_BLOCK, "")


def test_every_shipped_table_names_only_shapes_its_kernel_offers() -> None:
    """A shipped table is read on its GPU model only, where CI never runs: each entry goes through the kernels'
    own lookups here, which must find it under its key and accept its shape."""
    shipped = sorted(SHIPPED_DIR.glob("*.json"))
    assert shipped, "the H100 table ships with the package"
    for path in shipped:
        gpu = json.loads(path.read_text())["gpu"]
        assert path.name == gpu_file_name(gpu)
        for key, fields in read_table(path).items():
            form, size, scales = key.split("/")
            block = {"rows": PER_CHANNEL_BLOCK, "blocks": WEIGHT_BLOCK}[scales]
            if form == "skinny":
                n, k = (int(v) for v in size.split("x"))
                assert skinny.measured_skinny_shape(n, k, block, gpu) == skinny.SkinnyConfig(**fields), (gpu, key)
            else:
                forms = {"norm": form == "norm", "residual": form == "residual", "silu_mul": form == "silu_mul"}
                got = gemv.choose_config(int(size), block_size=block, gpu_name=gpu, **forms)
                assert got == gemv.Fp8GemvConfig(**fields), (gpu, key)
