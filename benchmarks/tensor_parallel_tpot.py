"""Batch-1 decode time per output token (TPOT) at several tensor-parallel sizes, in one process, side by side.

    python benchmarks/tensor_parallel_tpot.py --model llama-3.1-8b --tp 1 2 --out $OUT/tp_tpot.json

Each size gets its own engine (dummy bf16 weights for a preset; CUDA graphs and
overlap as configured by default), one after the other. TPOT is measured as a
difference, so prefill and the engine's per-request overhead cancel:
(time to generate N tokens - time to generate 1) / (N - 1), the median of
`--repeats` pairs on the same random prompt of `--input-len` tokens.
Writes `{"command", "device", "date", "metrics"}` with `<key>_tp<N>_bs1_tpot_ms`
per size and `<key>_tp<N>_speedup` against the first size.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch


def _time_generate(llm, prompt: list[int], max_tokens: int) -> float:  # type: ignore[no-untyped-def]
    from tokenspeed import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    llm.generate([{"prompt_token_ids": prompt}], params, use_tqdm=False)
    return time.perf_counter() - start


def measure(model: str, tp: int, input_len: int, output_len: int, repeats: int, extra: dict) -> float:
    from tokenspeed import LLM

    llm = LLM(model, load_format="dummy", tensor_parallel_size=tp, show_progress=False, **extra)
    try:
        vocab = llm.core.limits.vocab_size
        prompt = random.Random(0).choices(range(10, vocab), k=input_len)
        _time_generate(llm, prompt, 8)  # warm-up: kernels compiled, graphs replayed once
        tpots = []
        for _ in range(repeats):
            one = _time_generate(llm, prompt, 1)
            many = _time_generate(llm, prompt, output_len)
            tpots.append((many - one) / (output_len - 1))
        return statistics.median(tpots) * 1000.0
    finally:
        llm.shutdown()
        del llm
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


def result_document(metrics: dict[str, float]) -> dict[str, Any]:
    """The results JSON of a multi-rank benchmark: its command, devices and date around `metrics`."""
    return {
        "command": " ".join(["python", *sys.argv]),
        "device": torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu",
        "devices": torch.cuda.device_count() if torch.cuda.is_available() else 0,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "metrics": metrics,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--model", default="llama-3.1-8b")
    parser.add_argument("--key", default="llama8b", help="metric name prefix (default: %(default)s)")
    parser.add_argument("--tp", type=int, nargs="+", default=[1, 2])
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=128)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-model-len", type=int, default=4096)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    extra = {"max_model_len": args.max_model_len, "max_num_seqs": 8, "skip_tokenizer_init": True}
    metrics: dict[str, float] = {}
    result = result_document(metrics)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    for tp in args.tp:
        tpot = measure(args.model, tp, args.input_len, args.output_len, args.repeats, extra)
        metrics[f"{args.key}_tp{tp}_bs1_tpot_ms"] = round(tpot, 4)
        base = metrics[f"{args.key}_tp{args.tp[0]}_bs1_tpot_ms"]
        metrics[f"{args.key}_tp{tp}_speedup"] = round(base / tpot, 4)
        args.out.write_text(json.dumps(result, indent=2) + "\n")  # a timeout keeps what finished
        print(json.dumps({"tp": tp, "tpot_ms": round(tpot, 4)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
