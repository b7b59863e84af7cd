"""Where MLA decode time goes: the paged latent stream alone, with each dot, with both, no softmax.

    python benchmarks/mla_stream_decomposition.py [batch context]   # a ceilings log line, then JSON

Runs a stripped copy of the decode loop (16 query rows, 512 latent + 64
rope, pages of 64, the same split-KV grid as `mla.decode`) over a
`benchmarks/mla_kernels.py` pool, at several (positions per step, warps,
stages), and prints each variant's bandwidth fraction (cache bytes / time /
measured copy bandwidth) as JSON. Variants: `stream` (load and sum the tiles),
`qk` (+ the two score dots), `pv` (+ the P·V dot with a constant P), `qk_pv`
(both dots, scores fed to P·V unnormalised). The gap between `qk_pv` and
the decode kernel is the softmax's cost; this is how the anchored softmax
was found (`h200/mla_stream_decomposition.json`).
"""

from __future__ import annotations

import itertools
import json
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parent))
import gpu_suite  # noqa: E402
from mla_kernels import PAGE, WIDTH, Pool, bench_graph_us  # noqa: E402

from tokenspeed.kernels.mla.decode_plan import choose_num_splits  # noqa: E402

VARIANTS = {"stream": 0, "qk": 1, "pv": 2, "qk_pv": 3}
LAUNCHES = [
    (16, 4, 2),
    (16, 4, 4),
    (32, 4, 2),
    (32, 4, 3),
    (32, 4, 4),
    (64, 4, 2),
    (64, 4, 3),
    (32, 8, 3),
    (64, 8, 3),
]


@triton.jit
def _stream_kernel(
    q_ptr,
    cache_ptr,
    table_ptr,
    out_ptr,
    seq_len,
    num_splits,
    stride_cp,
    stride_cs,
    stride_pt,
    MODE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    PAGE_SIZE: tl.constexpr,
):
    row = tl.program_id(1)
    split = tl.program_id(2)
    split_len = tl.cdiv(tl.cdiv(seq_len, num_splits), BLOCK_N) * BLOCK_N
    start = split * split_len
    end = tl.minimum(start + split_len, seq_len)
    offs_l = tl.arange(0, 512)
    offs_r = tl.arange(0, 64)
    offs_m = tl.arange(0, BLOCK_M)
    q_lat = tl.load(q_ptr + offs_m[:, None] * 576 + offs_l[None, :])
    q_rope = tl.load(q_ptr + offs_m[:, None] * 576 + 512 + offs_r[None, :])
    acc = tl.zeros([BLOCK_M, 512], dtype=tl.float32)
    acc_s = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_t = tl.zeros([BLOCK_N, 512], dtype=tl.float32)
    table = table_ptr + row.to(tl.int64) * stride_pt
    for block_start in range(start, end, BLOCK_N):
        pos = block_start + tl.arange(0, BLOCK_N)
        n_mask = pos < end
        page = tl.load(table + pos // PAGE_SIZE, mask=n_mask, other=0).to(tl.int64)
        rows = cache_ptr + page * stride_cp + (pos % PAGE_SIZE) * stride_cs
        latent = tl.load(rows[:, None] + offs_l[None, :], mask=n_mask[:, None], other=0.0)
        rope = tl.load(rows[:, None] + 512 + offs_r[None, :], mask=n_mask[:, None], other=0.0)
        if MODE == 0:
            acc_t += latent.to(tl.float32) + tl.sum(rope.to(tl.float32), 1)[:, None]
        if MODE == 1 or MODE == 3:
            acc_s += tl.dot(q_lat, tl.trans(latent)) + tl.dot(q_rope, tl.trans(rope))
        if MODE == 2:
            p = tl.full([BLOCK_M, BLOCK_N], 1.0, dtype=tl.bfloat16) + tl.sum(rope, 1)[None, :]
            acc = tl.dot(p, latent, acc)
        if MODE == 3:
            acc = tl.dot(acc_s.to(tl.bfloat16), latent, acc)
    dst = out_ptr + (row * num_splits + split) * 512 + offs_l
    if MODE == 0:
        tl.store(dst, tl.sum(acc_t, 0))
    else:
        tl.store(dst, tl.sum(acc, 0) + tl.sum(tl.sum(acc_s, 1), 0))


def main() -> int:
    batch, context = (int(sys.argv[1]), int(sys.argv[2])) if len(sys.argv) > 2 else (64, 65536)
    gpu_suite.ceilings()
    bw = gpu_suite.bw()
    pool = Pool(batch * context)
    table = pool.table(batch, context)
    q = torch.randn(16, WIDTH, dtype=torch.bfloat16, device="cuda")
    splits = choose_num_splits(batch, 16, 1, context, device="cuda")
    out = torch.empty(batch * splits * 512, device="cuda")
    nbytes = batch * context * WIDTH * 2
    result: dict[str, float | str] = {}
    for (variant, mode), (block_n, warps, stages) in itertools.product(VARIANTS.items(), LAUNCHES):
        name = f"{variant}_n{block_n}_w{warps}_s{stages}"

        def run(mode: int = mode, block_n: int = block_n, warps: int = warps, stages: int = stages) -> None:
            _stream_kernel[(1, batch, splits)](
                q,
                pool.cache,
                table,
                out,
                context,
                splits,
                pool.cache.stride(0),
                pool.cache.stride(1),
                table.stride(0),
                MODE=mode,
                BLOCK_M=16,
                BLOCK_N=block_n,
                PAGE_SIZE=PAGE,
                num_warps=warps,
                num_stages=stages,
            )

        try:
            result[name] = round(nbytes / (bench_graph_us(run) / 1e6) / bw, 3)
        except Exception as exc:  # out of resources for this chip: record why
            result[name] = type(exc).__name__
    print(json.dumps({"batch": batch, "context": context, "bw_fraction": result}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
