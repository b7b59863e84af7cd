"""The CPU decode forward with its decode rows' attention on the native paged kernel vs gather + SDPA.

    python benchmarks/cpu_paged_attention.py [--batches 1 4 16] [--context 540] [--rounds 15] [--threads 1]
        [--out FILE]

Why beside `cpu_decode_step.py` (which compares whole engines, tree against tree): this isolates the
one switch, in one process on one K/V pool. The embedded model (fp32, `--threads` torch threads: the kernel itself runs on one), a pool four
times the batch's pages (scattered, random K/V: at 16 rows the batch's K/V, ~18 MB over the 4 layers,
do not stay in cache between forwards, as in an engine), B decode rows of `--context` - i positions.
Per B: the best of `--rounds` x 10 calls of `CPUDecodeForward.run` with `paged_attention` off
(`gather`) and on (`paged`), interleaved; then the attention calls alone inside 20 forwards of each;
and the largest difference of their hidden states. Results (with the command) go to `--out`
(default `benchmarks/results/cpu/cpu_paged_attention.json`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import torch

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "cpu" / "cpu_paged_attention.json"
PAGE_SIZE = 16


def main() -> None:
    from tokenspeed.batch.kv_storage import PagedKVStorage
    from tokenspeed.executor.batch_builder import RowSpec, build_forward_batch
    from tokenspeed.executor.cpu_decode import CPUDecodeForward
    from tokenspeed.models import ModelConfig, build_model, load_weights
    from tokenspeed.models.embedded.materialize import embedded_model_path

    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 4, 16])
    parser.add_argument("--context", type=int, default=540)
    parser.add_argument("--rounds", type=int, default=15)
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads (the kernel runs on one)")
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    folder = embedded_model_path()
    config = ModelConfig.from_pretrained(folder)
    model = build_model(config, dtype=torch.float32, device=torch.device("cpu"))
    load_weights(model, folder, load_format="auto")
    model.eval()
    pages_per_row = -(-args.context // PAGE_SIZE)
    num_pages = max(args.batches) * pages_per_row * 4 + 8
    kv = PagedKVStorage(num_layers=config.num_layers, num_pages=num_pages, page_size=PAGE_SIZE,
                        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=torch.float32, device="cpu")
    for cache in (*kv.k, *kv.v):
        cache.normal_()
    forwards = {name: CPUDecodeForward.build(model, kv, paged_attention=on) for name, on in (("gather", False),
                                                                                         ("paged", True))}
    paged = forwards["paged"]
    if paged is None or not paged.paged_attention:
        sys.exit("the native paged kernel did not build (no C compiler?)")
    pool = list(range(num_pages))
    random.Random(0).shuffle(pool)
    results: dict[str, Any] = {}
    for b in args.batches:
        rows, used = [], 0
        for i in range(b):
            n = args.context - i
            pages = pool[used : used + -(-n // PAGE_SIZE)]
            used += len(pages)
            rows.append(RowSpec([5], n - 1, pages))
        batch = build_forward_batch(rows, PAGE_SIZE, logits_indices=range(b))
        best = dict.fromkeys(forwards, float("inf"))
        attention: dict[str, float] = {}
        with torch.inference_mode():
            for forward in forwards.values():
                forward.run(batch)  # type: ignore[union-attr]
            for _ in range(args.rounds):
                for name, forward in forwards.items():
                    t0 = time.perf_counter()
                    for _ in range(10):
                        forward.run(batch)  # type: ignore[union-attr]
                    best[name] = min(best[name], (time.perf_counter() - t0) / 10)
            diff = (forwards["paged"].run(batch) - forwards["gather"].run(batch)).abs().max().item()  # type: ignore[union-attr]
            for name, forward in forwards.items():
                attention[name] = _attention_seconds(forward, batch, 20)
        results[f"b{b}"] = {
            "forward_ms": {name: round(t * 1e3, 3) for name, t in best.items()},
            "attention_ms_per_forward": {name: round(t * 1e3, 3) for name, t in attention.items()},
            "speedup": round(best["gather"] / best["paged"], 2),
            "max_abs_diff": diff,
        }
        print(f"B={b:2d}: forward gather {best['gather'] * 1e3:.3f} ms, paged {best['paged'] * 1e3:.3f} ms "
              f"({best['gather'] / best['paged']:.2f}x); attention per forward {attention['gather'] * 1e3:.3f} "
              f"-> {attention['paged'] * 1e3:.3f} ms; max |diff| {diff:.1e}")
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({
        "command": "python " + " ".join([str(Path(sys.argv[0]).relative_to(REPO)) if Path(sys.argv[0]).is_absolute()
                                        else sys.argv[0], *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "context": args.context,
        "threads": args.threads,
        "results": results,
    }, indent=1) + "\n")
    print(f"written to {args.out}")


def _attention_seconds(forward: Any, batch: Any, calls: int) -> float:
    """Seconds per forward spent in the decode rows' attention (`_attend_decode`), over `calls` forwards."""
    inner = forward._attend_decode
    spent = 0.0

    def timed(*args: Any) -> Any:
        nonlocal spent
        t0 = time.perf_counter()
        out = inner(*args)
        spent += time.perf_counter() - t0
        return out

    forward._attend_decode = timed
    try:
        for _ in range(calls):
            forward.run(batch)
    finally:
        del forward._attend_decode
    return spent / calls


if __name__ == "__main__":
    main()
