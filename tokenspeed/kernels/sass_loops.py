"""The instruction mix of a kernel's main loop, from its sm_90 machine code, on a machine without a GPU.

A streaming kernel (the decode GEMVs) keeps up with the memory only while
each SM can issue the instructions its bytes need: an H200 delivers about 17
bytes per clock per SM (4.3 TB/s over 132 SMs at 1.98 GHz) and an SM issues
4 warp instructions per clock, so a loop over fp8 weights has about 0.2
warp instructions per byte to spend,
less for the slow single-value conversions (`F2F`). This tool compiles the
`compile_check` configurations whose names contain a pattern, disassembles
them with the `nvdisasm` bundled with Triton, and prints the longest loop
(a branch back to a label above it): its instruction count by opcode.

    python -m tokenspeed.kernels.sass_loops "triton_gemv down"

Per weight byte: loop instructions x warps / bytes a step streams (the
step's size comes from the configuration, so the reader divides).
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import subprocess
import sys
import tempfile

import triton

from tokenspeed.kernels.compile_check import compile_kernel, serving_configs

_INSTRUCTION = re.compile(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?)\s*;")
_LABEL = re.compile(r"\s*\.(L_x_\d+):")
_BRANCH = re.compile(r"BRA\s+`\(\.(L_x_\d+)\)")


def disassemble(cubin: bytes) -> str:
    nvdisasm = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "nvdisasm")
    with tempfile.NamedTemporaryFile("wb", suffix=".cubin", delete=False) as f:
        f.write(cubin)
    try:
        return subprocess.run([nvdisasm, "-c", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def loops(sass: str) -> list[list[str]]:
    """Every backward branch's body (instructions from its label to the branch), in program order."""
    label_at: dict[str, int] = {}
    instructions: list[str] = []
    bodies = []
    for line in sass.splitlines():
        if label := _LABEL.match(line):
            label_at[label.group(1)] = len(instructions)
        elif ins := _INSTRUCTION.match(line):
            instructions.append(ins.group(2))
            branch = _BRANCH.search(ins.group(2))
            if branch and branch.group(1) in label_at:
                bodies.append(instructions[label_at[branch.group(1)]:])
    return bodies


def opcode(instruction: str) -> str:
    """`@!P0 LDGSTS.E.BYPASS [..]` -> `LDGSTS`."""
    return re.sub(r"^@!?U?P\w+\s+", "", instruction).split()[0].split(".")[0]


def main_loop_mix(sass: str) -> collections.Counter[str]:
    """The longest loop's opcodes. A span with an EXIT is no loop: ptxas places the retry branches of
    mbarrier waits (TMA pipelines) after the kernel's exit, jumping back into its middle."""
    bodies = [body for body in loops(sass) if not any(opcode(i) == "EXIT" for i in body)]
    longest = max(bodies, key=len, default=[])
    return collections.Counter(opcode(i) for i in longest)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("pattern", help="part of a compile_check configuration name")
    parser.add_argument("--arch", type=int, default=90)
    parser.add_argument("--top", type=int, default=12, help="opcodes to print per loop")
    args = parser.parse_args(argv)
    found = False
    for config in serving_configs():
        if args.pattern not in config.name:
            continue
        found = True
        mix = main_loop_mix(disassemble(compile_kernel(config, args.arch).asm["cubin"]))
        top = " ".join(f"{op}={n}" for op, n in mix.most_common(args.top))
        print(f"{config.name} (warps={config.num_warps}): loop {sum(mix.values())} instructions: {top}", flush=True)
    if not found:
        print(f"no configuration name contains {args.pattern!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
