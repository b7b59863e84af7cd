"""Compile every Triton kernel for an NVIDIA target on a machine without a GPU.

The CPU interpreter runs kernels as Python, so it cannot catch what only the
compiler rejects (a non-constexpr global, a loop-carried value changing type)
nor show register spills, nor a tile that Triton transposes through shared
memory a byte at a time (`shared_byte_loads`: 8-bit data has no transposing
`ldmatrix`; the fp8 kernels widen such tiles first, `quant/fp8_cast.widen_fp8`).
This module lowers each kernel at its serving configuration (bf16, head_dim
128, GQA 32/8) through Triton's compiler and the `ptxas` bundled with triton,
for sm_90 by default, and reports registers and spills.
`python -m tokenspeed.kernels.compile_check [--arch 90]`; exit status 1
if any kernel fails to compile. Must run without TRITON_INTERPRET=1.
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

_FLOAT_ARGS = {"scale_log2e", "eps", "greedy_epsilon"}
# Per-head fp32 scales of an fp8 e4m3 KV cache; the caches' pointer types when they are fp8.
_KV_SCALES = {"k_scale_ptr": "fp32", "v_scale_ptr": "fp32"}
_FP8_KV = _KV_SCALES | {"k_cache_ptr": "fp8e4nv", "v_cache_ptr": "fp8e4nv"}
_ALIGNED = re.compile(r"(_ptr$|^stride_(?!pt$|cos$|row$|x_inner$|r_inner$))")


@dataclass(slots=True)
class KernelConfig:
    """One kernel at one set of constexprs; pointer dtypes default to `pointee`.

    `pointers` maps an argument to its pointee type, or to a tuple of them for
    a tuple argument (every element aligned to 16 bytes).

    `spill_allowance`: register spill bytes this configuration is known to
    have and was measured to be fastest with anyway (0 for nearly all).
    `multiple_of_16`: integer arguments the launcher sees as multiples of 16
    (Triton specialises on it at run time; a masked fp8 K loop pipelines only then).
    `max_registers`: the launch's register cap (`maxnreg`), None for none.
    """

    name: str
    kernel: Any
    constexprs: dict[str, Any]
    pointee: str = "bf16"
    pointers: Mapping[str, str | tuple[str, ...]] = field(default_factory=dict)
    num_warps: int = 4
    num_stages: int = 2
    spill_allowance: int = 0
    multiple_of_16: tuple[str, ...] = ()
    max_registers: int | None = None


def _signature(config: KernelConfig) -> tuple[dict[str, Any], dict[tuple[int, ...], Any]]:
    """Triton types of every argument, plus the 16-divisibility hints the launcher would infer."""
    signature: dict[str, Any] = {}
    attrs: dict[tuple[int, ...], Any] = {}
    for index, arg in enumerate(config.kernel.arg_names):
        pointee = config.pointers.get(arg, config.pointee)
        if isinstance(pointee, tuple):  # a tuple of pointers (one per peer, say), each aligned
            signature[arg] = tuple(f"*{t}" for t in pointee)
            attrs |= {(index, i): [["tt.divisibility", 16]] for i in range(len(pointee))}
            continue
        if arg in config.constexprs:
            signature[arg] = "constexpr"
        elif arg.endswith("_ptr"):
            signature[arg] = f"*{pointee}"
        elif pointee.startswith("tensordesc<"):  # a host TMA descriptor: `tensordesc<dtype[box]>`
            signature[arg] = pointee
        else:
            signature[arg] = "fp32" if arg in _FLOAT_ARGS else "i32"
        if signature[arg] != "constexpr" and (_ALIGNED.search(arg) or arg in config.multiple_of_16):
            attrs[(index,)] = [["tt.divisibility", 16]]
    return signature, attrs


def serving_configs() -> Iterator[KernelConfig]:
    from tokenspeed.kernels.activation import silu_triton
    from tokenspeed.kernels.attention import decode_plan, decode_triton, extend_triton
    from tokenspeed.kernels.kvstore import rope_write_triton, write_triton
    from tokenspeed.kernels.norm import rms_triton
    from tokenspeed.kernels.rope import rope_triton
    from tokenspeed.kernels.sampling import argmax_triton, sample_triton
    from tokenspeed.kernels.staging import step_inputs_triton

    tables = {"page_table_ptr": "i32", "seq_lens_ptr": "i32", "query_start_ptr": "i32"}
    partials = {"part_out_ptr": "fp32", "part_lse_ptr": "fp32"}
    for splits, window, fp8 in ((1, False, False), (1, True, False), (8, False, False), (8, True, False))+(
        (1, False, True), (8, False, True)
    ):
        yield KernelConfig(
            f"attention.decode splits={splits} window={window} fp8={fp8}",
            decode_triton._decode_split_kernel,
            dict(NUM_HEADS=32, GROUP=4, HEAD_DIM=128, PAGE_SIZE=16, NUM_SPLITS=splits, G_BLOCKS=1)
            | dict(BLOCK_G=16, BLOCK_D=128, BLOCK_N=decode_plan.positions_per_step(128, 1 if fp8 else 2))
            | dict(HAS_WINDOW=window, IEEE=False, USE_PDL=True, HAS_SCALE=fp8, SCALE_STRIDE=1, F16_DOTS=fp8)
            | dict(PAGE_LIST=False),
            pointers=tables | partials | (_FP8_KV if fp8 else _KV_SCALES),
        )
    for launch in decode_plan.fp8_launch_candidates((128,))[1:]:  # the other launches its tuner may pick
        yield KernelConfig(
            f"attention.decode splits=8 fp8=True {launch}",
            decode_triton._decode_split_kernel,
            dict(NUM_HEADS=32, GROUP=4, HEAD_DIM=128, PAGE_SIZE=16, NUM_SPLITS=8, G_BLOCKS=1, BLOCK_G=16)
            | dict(BLOCK_D=128, BLOCK_N=launch.block_n, HAS_WINDOW=False, IEEE=False, USE_PDL=True)
            | dict(HAS_SCALE=True, SCALE_STRIDE=1, F16_DOTS=True, PAGE_LIST=launch.page_list),
            pointers=tables | partials | _FP8_KV,
            num_stages=launch.num_stages,
            max_registers=launch.max_registers,
            # capped at 96 registers they spill 32-48 B, and were still the fastest launches on an H100
            spill_allowance=48 if launch.max_registers else 0,
        )
    yield KernelConfig(
        "attention.decode reduce",
        decode_triton._decode_reduce_kernel,
        dict(NUM_HEADS=32, HEAD_DIM=128, NUM_SPLITS=8, BLOCK_S=8, BLOCK_D=128, USE_PDL=True),
        pointers=partials,
    )
    for block_m, block_n, warps in ((128, 64, 8), (16, 64, 4)):
        for window, fp8 in ((False, False), (True, False), (False, True)):
            yield KernelConfig(
                f"attention.extend {block_m}x{block_n} window={window} fp8={fp8}",
                extend_triton._extend_kernel,
                dict(GROUP=4, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_D=128)
                | dict(HAS_WINDOW=window, IEEE=False, HAS_SCALE=fp8, SCALE_STRIDE=1, F16_DOTS=fp8),
                pointers=tables | (_FP8_KV if fp8 else _KV_SCALES),
                num_warps=warps,
            )
    for fp8 in (False, True):
        yield KernelConfig(
            f"kvstore.write fp8={fp8}",
            write_triton._write_kv_kernel,
            dict(NUM_KV_HEADS=8, HEAD_DIM=128, PAGE_SIZE=16, BLOCK_H=8, BLOCK_D=128, USE_PDL=True)
            | dict(FP8_CACHE=fp8, HAS_SCALE=fp8, SCALE_STRIDE=1),
            pointers={"slot_ptr": "i64"} | (_FP8_KV if fp8 else _KV_SCALES),
        )
    yield KernelConfig(
        "norm.rms residual",
        rms_triton._rms_norm_kernel,
        dict(INNER=1, N=4096, BLOCK=4096, HAS_RESIDUAL=True, USE_PDL=True),
        num_warps=16,
    )
    yield KernelConfig(
        "rope.apply",
        rope_triton._rope_kernel,
        dict(NUM_Q_HEADS=32, NUM_K_HEADS=8, HALF=64, BLOCK_QH=32, BLOCK_KH=8, BLOCK_HALF=64, USE_PDL=True),
        pointers={"positions_ptr": "i64", "cos_ptr": "fp32", "sin_ptr": "fp32"},
    )
    for fp8, norm in ((False, False), (False, True), (True, True)):
        yield KernelConfig(
            f"kvstore.rope_write fp8={fp8} qk_norm={norm}",
            rope_write_triton._rope_write_kernel,
            dict(NUM_Q_HEADS=32, NUM_KV_HEADS=8, HEAD_DIM=128, HALF=64, REST=0, PAGE_SIZE=16, BLOCK_QH=32)
            | dict(BLOCK_KH=8, BLOCK_HALF=64, BLOCK_REST=1, BLOCK_D=128, HAS_NORM=norm, FP8_CACHE=fp8)
            | dict(HAS_SCALE=fp8, SCALE_STRIDE=1, USE_PDL=True),
            pointers={"positions_ptr": "i64", "slot_ptr": "i64", "cos_ptr": "fp32", "sin_ptr": "fp32"}
            | (_FP8_KV if fp8 else _KV_SCALES),
        )
    yield KernelConfig(
        "activation.silu_and_mul", silu_triton._silu_and_mul_kernel, dict(D=14336, BLOCK=1024, USE_PDL=True)
    )
    from tokenspeed.kernels.moe.compile_configs import moe_compile_configs

    yield from moe_compile_configs()
    yield from _gemm_configs()
    from tokenspeed.kernels.quant.compile_configs import fp8_compile_configs

    yield from fp8_compile_configs()
    from tokenspeed.kernels.mla.compile_configs import mla_compile_configs

    yield from mla_compile_configs()
    from tokenspeed.kernels.comm.compile_configs import comm_compile_configs

    yield from comm_compile_configs()
    for draw in (True, False):
        yield KernelConfig(
            f"sampling.sample draw={draw}",
            sample_triton._sample_kernel,
            dict(ONE_BITS=0x3F800000, BLOCK=1024, PROBES=16, DRAW=draw),
            pointee="fp32",
            pointers={"out_ptr": "i64", "top_k_ptr": "i32", "keys_ptr": "i64", "threshold_ptr": "i32"},
            num_warps=8,
        )
    for dtype in ("fp32", "bf16"):
        yield KernelConfig(
            f"sampling.argmax {dtype}",
            argmax_triton._argmax_kernel,
            dict(CHUNKS=32, CHUNK_SIZE=argmax_triton.CHUNK, CHUNKS_P2=32),
            pointee="fp32",
            pointers={"logits_ptr": dtype, "first_ptr": "i32", "counters_ptr": "i32", "out_ptr": "i64"},
            num_warps=argmax_triton.NUM_WARPS,
        )
    for sources, table_rows in ((True, True), (False, False)):
        yield KernelConfig(
            f"staging.step_inputs sources={sources} table_rows={table_rows}",
            step_inputs_triton._step_inputs_kernel,
            dict(HAS_SOURCES=sources, HAS_TABLE_ROWS=table_rows, BLOCK=step_inputs_triton.BLOCK),
            pointee="i64",
            pointers={"out_seq_ptr": "i32", "out_qs_ptr": "i32", "out_table_ptr": "i32"}
            | {"table_ptr": "i32" if table_rows else "i64"},
        )


def _gemm_configs() -> Iterator[KernelConfig]:
    """The decode GEMV as the fused 8B decoder layer launches it (`choose_config`'s shapes)."""
    from tokenspeed.kernels.gemm import gemv_triton

    shapes = {  # name: (rows, K, silu, norm prologue, residual epilogue)
        "qkv+norm": (6144, 4096, False, True, False),
        "o+residual": (4096, 4096, False, False, True),
        "gate_up+norm+silu": (14336, 4096, True, True, False),
        "down+residual": (4096, 14336, False, False, True),
        "lm_head": (128256, 4096, False, False, False),
    }
    for m in (1, 8):
        for name, (n, k, silu, norm, residual) in shapes.items():
            cfg = gemv_triton.choose_config(m, n, k, silu_mul=silu)
            yield KernelConfig(
                f"gemm.decode {name} m={m}",
                gemv_triton._gemv_kernel,
                dict(N=n, K=k, BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n, BLOCK_K=cfg.block_k)
                | dict(NORM_BLOCK=min(4096 // cfg.block_m, k), STAGES=cfg.stages, EVEN_N=n % cfg.block_n == 0)
                | dict(EVEN_K=k % cfg.block_k == 0, USE_DOT=cfg.use_dot, SILU_MUL=silu, HAS_BIAS=False)
                | dict(HAS_NORM=norm, HAS_RESIDUAL=residual, IEEE=False, USE_PDL=True),
                pointers={"out_ptr": "fp32"} if name == "lm_head" else {},
                num_warps=cfg.num_warps,
            )


def _ptxas_report(ptx: str, arch: int) -> str:
    ptxas = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "ptxas")
    with tempfile.NamedTemporaryFile("w", suffix=".ptx", delete=False) as f:
        f.write(ptx)
    try:
        suffix = "a" if arch >= 90 else ""
        cmd = [ptxas, "-v", f"--gpu-name=sm_{arch}{suffix}", f.name, "-o", os.devnull]
        result = subprocess.run(cmd, capture_output=True, text=True, check=True)
    finally:
        os.unlink(f.name)
    registers = re.findall(r"Used (\d+) registers", result.stderr)
    spills = re.findall(r"(\d+) bytes spill stores", result.stderr)
    return f"registers={max(map(int, registers), default=0)} spill_stores={sum(map(int, spills))}B"


def compile_kernel(config: KernelConfig, arch: int) -> Any:
    """Triton's compiled kernel for one configuration (`.asm` holds ttgir, ptx, cubin; raises on an error)."""
    signature, attrs = _signature(config)
    source = ASTSource(fn=config.kernel, signature=signature, constexprs=config.constexprs, attrs=attrs)
    options = {"num_warps": config.num_warps, "num_stages": config.num_stages}
    if config.max_registers:
        options["maxnreg"] = config.max_registers
    return triton.compile(source, target=GPUTarget("cuda", arch, 32), options=options)


def compile_config(config: KernelConfig, arch: int) -> str:
    """Compile one configuration; returns a one-line report (raises on a compile error)."""
    compiled = compile_kernel(config, arch)
    byte_loads = len(re.findall(r"ld\.shared\.[bsu]8\b", compiled.asm["ptx"]))
    report = f"shared={compiled.metadata.shared}B shared_byte_loads={byte_loads} "
    report += _ptxas_report(compiled.asm["ptx"], arch)
    return report + (f" allowance={config.spill_allowance}B" if config.spill_allowance else "")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--arch", type=int, default=90, help="compute capability, e.g. 80, 90")
    args = parser.parse_args(argv)
    if os.environ.get("TRITON_INTERPRET") == "1":
        print("unset TRITON_INTERPRET: the interpreter does not compile", file=sys.stderr)
        return 2
    failures = 0
    for config in serving_configs():
        try:
            print(f"ok    {config.name}: {compile_config(config, args.arch)}", flush=True)
        except Exception as exc:  # report every kernel, then fail
            failures += 1
            print(f"FAIL  {config.name}: {type(exc).__name__}: {exc}", flush=True)
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
