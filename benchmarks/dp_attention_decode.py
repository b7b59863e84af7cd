"""Batched decode time per output token (TPOT): DP attention against attention TP, for an MLA model.

    python benchmarks/dp_attention_decode.py --model deepseek-v2-lite --ranks 2 --batch 32 \\
        --out $OUT/dp_attention_decode.json

Three engines, one after the other, on the same `--batch` random prompts of
`--input-len` tokens (dummy weights for a preset): one rank; `--ranks` ranks
with MLA's heads split over them (attention TP, every rank storing every
latent); `--ranks` ranks with DP attention (`enable_dp_attention`: each rank
runs attention over its own requests, the MoE/MLP over all of them). TPOT is a
difference, so prefill and per-request overhead cancel: (time to generate N
tokens - time to generate 1) / (N - 1), the median of `--repeats` pairs.
DP attention runs eagerly (no CUDA graphs yet), so the TP engines run with
`--enforce-eager` too unless `--graphs` is given, to compare like with like.

Writes `{"command", "device", "date", "metrics"}` with `<key>_<mode>_bs<B>_tpot_ms` per mode
(`tp1`, `tp<N>`, `dp<N>`) and `<key>_dp<N>_vs_tp<N>` (TP's TPOT over DP's: above 1, DP is faster).
On the CPU (`--device cpu`, a tiny checkpoint folder as `--model`) it is a smoke run, not a measurement.
"""

from __future__ import annotations

import argparse
import gc
import json
import random
import statistics
import time
from pathlib import Path
from typing import Any

import torch
from tensor_parallel_tpot import result_document


def _time_generate(llm: Any, prompts: list[list[int]], max_tokens: int) -> float:
    from tokenspeed import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    return time.perf_counter() - start


def measure(model: str, ranks: int, dp_attention: bool, args: argparse.Namespace, extra: dict[str, Any]) -> float:
    """Median TPOT in ms of one engine configuration."""
    from tokenspeed import LLM

    llm = LLM(
        model,
        load_format="dummy",
        tensor_parallel_size=ranks,
        enable_expert_parallel=ranks > 1 and args.expert_parallel,
        enable_dp_attention=dp_attention,
        show_progress=False,
        **extra,
    )
    try:
        vocab = llm.core.limits.vocab_size
        rng = random.Random(0)
        prompts = [rng.choices(range(10, vocab), k=args.input_len) for _ in range(args.batch)]
        _time_generate(llm, prompts, 4)  # warm-up: kernels compiled, graphs replayed once
        tpots = []
        for _ in range(args.repeats):
            one = _time_generate(llm, prompts, 1)
            many = _time_generate(llm, prompts, args.output_len)
            tpots.append((many - one) / (args.output_len - 1))
        return statistics.median(tpots) * 1000.0
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default="deepseek-v2-lite", help="an MLA preset or checkpoint folder")
    parser.add_argument("--key", default="dsv2lite", help="metric name prefix (default: %(default)s)")
    parser.add_argument("--ranks", type=int, default=2, help="devices for the TP and DP engines")
    parser.add_argument("--batch", type=int, default=32, help="concurrent requests decoding")
    parser.add_argument("--input-len", type=int, default=512)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--no-expert-parallel", dest="expert_parallel", action="store_false",
                        help="split experts by intermediate size instead of by expert")
    parser.add_argument("--graphs", action="store_true", help="CUDA graphs for the TP engines (DP runs eagerly)")
    parser.add_argument("--modes", nargs="+", choices=("tp1", "tp", "dp"), default=["tp1", "tp", "dp"])
    parser.add_argument("--device", default="auto")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--out", type=Path, required=True)
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    extra: dict[str, Any] = {
        "max_model_len": args.max_model_len,
        "max_num_seqs": max(args.batch, 1),
        "skip_tokenizer_init": True,
        "enforce_eager": not args.graphs,
        "device": args.device,
        "dtype": args.dtype,
    }
    metrics: dict[str, float] = {}
    result = result_document(metrics)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    n = args.ranks
    configs = {"tp1": (1, False), "tp": (n, False), "dp": (n, True)}
    for mode in args.modes:
        ranks, dp = configs[mode]
        name = "tp1" if mode == "tp1" else f"{mode}{n}"
        tpot = measure(args.model, ranks, dp, args, extra)
        metrics[f"{args.key}_{name}_bs{args.batch}_tpot_ms"] = round(tpot, 4)
        tp_key, dp_key = f"{args.key}_tp{n}_bs{args.batch}_tpot_ms", f"{args.key}_dp{n}_bs{args.batch}_tpot_ms"
        if tp_key in metrics and dp_key in metrics:
            metrics[f"{args.key}_dp{n}_vs_tp{n}"] = round(metrics[tp_key] / metrics[dp_key], 4)
        args.out.write_text(json.dumps(result, indent=2) + "\n")  # a timeout keeps what finished
        print(json.dumps({"mode": name, "tpot_ms": round(tpot, 4)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
