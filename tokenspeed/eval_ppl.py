"""`tokenspeed eval-ppl`: held-out bits per byte and top-1 accuracy, computed through the engine.

The held-out set is the one the embedded models are trained beside
(`models/embedded/training/corpus.py`: Python sources of this interpreter and
its installed packages, held-out files chosen by content hash), cut into
`--max-windows` windows of `--window` tokens with the model's own tokenizer.
Each window goes through `LLM.generate` with `prompt_logprobs=0`, so the
numbers come out of the serving path itself (paged KV cache, chunked
prefill, the kernels the engine picks): position 0 of a window is context,
every later token is scored by the engine's log-probability of it given the
window so far, and a position counts as top-1 when its rank is 1.
Bits per byte = -sum(logprob) / ln 2 / UTF-8 bytes of the scored tokens.

`--compare-transformers` scores the same windows with `transformers` on the
same weights and exits 1 when the two differ by more than `--tolerance` bits
per byte (1e-3 is for fp32: run with `--dtype float32` on a GPU).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from tokenspeed.engine_args import add_engine_args, engine_config_from_args


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from tokenspeed.models.embedded.training.corpus import SOURCES

    parser = subparsers.add_parser(
        "eval-ppl",
        help="held-out bits per byte and top-1 through the engine (prompt_logprobs)",
        description=__doc__.split("\n\n")[0],
    )
    add_engine_args(parser)
    group = parser.add_argument_group("evaluation")
    group.add_argument("--window", type=int, default=1024, help="tokens per held-out window (default: %(default)s)")
    group.add_argument("--max-windows", type=int, default=512,
                       help="windows, spread evenly over the held-out set (default: %(default)s)")
    group.add_argument("--sources", default=",".join(SOURCES), help="corpus sources (default: %(default)s)")
    group.add_argument("--site-budget-mb", type=float, default=96.0,
                       help="bytes of installed packages' sources in the corpus (default: %(default)s)")
    group.add_argument("--compare-transformers", action="store_true",
                       help="also score the windows with transformers on the same weights")
    group.add_argument("--tolerance", type=float, default=1e-3,
                       help="largest bits-per-byte difference accepted by --compare-transformers (default: %(default)s)")
    group.add_argument("--output", type=Path, default=None, help="also write the JSON result here")
    parser.set_defaults(handler=run)


def engine_metrics(llm: Any, windows: np.ndarray, token_bytes: np.ndarray) -> dict[str, float]:
    """Score every window through `llm` (prompt_logprobs=0; the window's own ids, no tokenizer)."""
    from tokenspeed import SamplingParams
    from tokenspeed.models.embedded.training.metrics import summarise

    params = SamplingParams(max_tokens=1, temperature=0.0, prompt_logprobs=0, detokenize=False)
    prompts = [{"prompt_token_ids": [int(t) for t in window]} for window in windows]
    totals = {"nats": 0.0, "bytes": 0.0, "hits": 0.0, "count": 0.0}
    for window, output in zip(windows, llm.generate(prompts, params, use_tqdm=False)):
        scored = output.prompt_logprobs
        if scored is None or len(scored) != len(window):
            raise RuntimeError(f"engine returned {0 if scored is None else len(scored)} prompt logprobs "
                               f"for a window of {len(window)}")
        for position in range(1, len(window)):
            token = int(window[position])
            entry = scored[position][token]  # type: ignore[index]
            totals["nats"] -= entry.logprob
            totals["hits"] += entry.rank == 1
            totals["bytes"] += float(token_bytes[token])
            totals["count"] += 1
    return summarise(totals)


def transformers_metrics(
    folder: Path, windows: np.ndarray, token_bytes: np.ndarray, *, dtype: Any, device: Any, batch_size: int = 8
) -> dict[str, float]:
    """The same numbers from `transformers` (eager attention) on the same weights."""
    import torch
    import transformers

    from tokenspeed.models.embedded.training.metrics import score_positions, summarise

    model = transformers.AutoModelForCausalLM.from_pretrained(folder, dtype=dtype, attn_implementation="eager")
    model = model.to(device).eval()
    bytes_of = torch.from_numpy(token_bytes).to(device)
    totals = {"nats": 0.0, "bytes": 0.0, "hits": 0.0, "count": 0.0}
    with torch.no_grad():
        for start in range(0, len(windows), batch_size):
            ids = torch.from_numpy(windows[start : start + batch_size]).to(device)
            logits = model(ids).logits[:, :-1]
            for key, value in score_positions(logits, ids[:, 1:], bytes_of).items():
                totals[key] += value
    return summarise(totals)


def run(args: argparse.Namespace) -> int:
    from tokenspeed import LLM
    from tokenspeed.models.embedded.training.corpus import CorpusOptions, held_out_windows

    start = time.perf_counter()
    config = dataclasses.replace(engine_config_from_args(args), skip_tokenizer_init=True)
    llm = LLM.from_config(config, show_progress=False)
    folder = Path(llm.core.model_folder)
    options = CorpusOptions(sources=tuple(args.sources.split(",")), site_budget_bytes=int(args.site_budget_mb * 1e6))
    windows, token_bytes, about = held_out_windows(folder / "tokenizer.json", options, args.window, args.max_windows)
    result: dict[str, Any] = {
        "command": args.command_line,
        "model": args.model or "embedded",
        "device": str(llm.core.executor.device),
        "dtype": str(llm.core.executor.dtype).removeprefix("torch."),
        "windows": len(windows),
        "window": args.window,
        **about,
        "engine": engine_metrics(llm, windows, token_bytes),
    }
    status = 0
    if args.compare_transformers:
        reference = transformers_metrics(folder, windows, token_bytes, dtype=llm.core.executor.dtype, device=llm.core.executor.device)
        difference = abs(reference["bits_per_byte"] - result["engine"]["bits_per_byte"])
        result["transformers"] = reference
        result["bits_per_byte_abs_diff"] = difference
        if difference > args.tolerance:
            print(f"error: engine and transformers differ by {difference:.2e} bits/byte "
                  f"(tolerance {args.tolerance:.0e})", file=sys.stderr)
            status = 1
    result["seconds"] = round(time.perf_counter() - start, 2)
    text = json.dumps(result)
    print(text)
    if args.output is not None:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(text + "\n")
    return status
