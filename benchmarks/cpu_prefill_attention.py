"""Causal prefill attention of one prompt row on the CPU, one thread: torch SDPA (the CPU forward's path
before the native kernel), the paged decode kernel with every token as a one-token row, and the native
paged prefill kernel (`kernels/attention/prefill_paged_cpu.py`).

    python benchmarks/cpu_prefill_attention.py [--lengths 128 256 512 1024 2048] [--repeat 10] [--out FILE]

Embedded-model heads (8 over 2, head_dim 32), pages of 16 positions scattered over the pool, a chunk
from position 0. `sdpa_ms`: K/V gathered and repeated for GQA, then SDPA in 64-query causal blocks up to
1024 positions (`extend_torch_sdpa.causal_blocks`), plain `is_causal` past that; `decode_rows_ms`: the
decode kernel over a page table row per token; `prefill_ms`: the prefill kernel. Best of `--repeat`;
`max_abs_diff` of the prefill kernel against SDPA. Results go to `--out` (default
`benchmarks/results/cpu/cpu_prefill_attention.json`).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from cpu_results import write_result  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "cpu" / "cpu_prefill_attention.json"
HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE = 8, 2, 32, 16


def best_ms(fn: Any, repeat: int) -> float:
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return round(min(times) * 1e3, 3)


def measure(length: int, repeat: int) -> dict[str, Any]:
    import torch
    import torch.nn.functional as F

    from tokenspeed.kernels.attention import decode_paged_cpu, prefill_paged_cpu
    from tokenspeed.kernels.attention.extend_torch_sdpa import attend_causal_blocks, causal_blocks

    gen = torch.Generator().manual_seed(length)
    group, scale = HEADS // KV_HEADS, HEAD_DIM**-0.5
    pages = length // PAGE_SIZE
    q = torch.randn(length, HEADS, HEAD_DIM, generator=gen)
    k_cache = torch.randn(pages + 4, PAGE_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    v_cache = torch.randn(pages + 4, PAGE_SIZE, KV_HEADS, HEAD_DIM, generator=gen)
    table = torch.randperm(pages + 4, generator=gen)[:pages].to(torch.int32)
    blocks = causal_blocks(length, length, torch.device("cpu"))

    def sdpa() -> Any:
        k = k_cache.view(pages + 4, -1).index_select(0, table.long()).view(-1, KV_HEADS, HEAD_DIM).transpose(0, 1)
        v = v_cache.view(pages + 4, -1).index_select(0, table.long()).view(-1, KV_HEADS, HEAD_DIM).transpose(0, 1)
        k, v = k.repeat_interleave(group, 0)[None], v.repeat_interleave(group, 0)[None]
        queries = q.transpose(0, 1)[None]
        if blocks is not None:
            return attend_causal_blocks(queries, k, v, blocks, scale)
        return F.scaled_dot_product_attention(queries, k, v, is_causal=True, scale=scale)[0].transpose(0, 1)

    rows = decode_paged_cpu.PagedDecodePlan(
        table[None].expand(length, -1).contiguous(), torch.arange(1, length + 1), length, heads=HEADS,
        kv_heads=KV_HEADS, head_dim=HEAD_DIM, page_size=PAGE_SIZE)
    prefill = prefill_paged_cpu.PagedPrefillRow(table, 0, length, heads=HEADS, kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                                                page_size=PAGE_SIZE)
    out = torch.empty(length, HEADS, HEAD_DIM)
    prefill(q, k_cache, v_cache, scale, out)
    return {
        "sdpa_ms": best_ms(sdpa, repeat),
        "decode_rows_ms": best_ms(lambda: rows(q, k_cache, v_cache, scale), repeat),
        "prefill_ms": best_ms(lambda: prefill(q, k_cache, v_cache, scale, out), repeat),
        "max_abs_diff": float((out - sdpa()).abs().max()),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--lengths", type=int, nargs="+", default=[128, 256, 512, 1024, 2048])
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    import torch

    torch.set_num_threads(1)
    results = {}
    for length in args.lengths:
        results[str(length)] = measure(length, args.repeat)
        print(length, results[str(length)], flush=True)
    write_result(args.out, results)


if __name__ == "__main__":
    main()
