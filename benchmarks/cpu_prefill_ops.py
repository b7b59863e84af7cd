"""Where a CPU prefill step's time goes, by op class, against the single-thread fp32 GEMM ceiling.

    python benchmarks/cpu_prefill_ops.py [--prompts 1 4] [--context 512] [--repeat 5] [--out FILE]

One torch thread, the embedded model (fp32) through the public `LLM` API. For each `--prompts N`
it captures the largest runner batch of N prompts of `--context` random tokens admitted together
(a burst's step: under the CPU step budget of 1024 tokens, 4 x 512 run as two steps of two
prompts; under 2048, before, as one), re-runs the runner's
CPU forward on it (`run(logits_rows=True)` plus the LM head on the logits rows, as the runner
does) and profiles it with torch.profiler, classing aten self time as GEMM (and its achieved
GFLOP/s from the model's shapes), attention, elementwise (norms, RoPE, SiLU, residual adds,
copies), K/V write, and the rest (Python and dispatch: wall minus aten self time). The same run
measures the ceiling: a 2048^3 sgemm through `F.linear` (MKL) and through oneDNN on a pre-packed
weight (the path `cpu_linear.py` uses). Results go to `--out` (default
`benchmarks/results/cpu/cpu_prefill_ops.json`).
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_side_by_side  # noqa: E402
from cpu_results import write_result  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "cpu" / "cpu_prefill_ops.json"

CLASSES = {
    "gemm": ("mm", "addmm", "linear", "mkldnn", "_linear_pointwise"),
    "attention": ("scaled_dot_product", "flash_attention", "paged_prefill", "paged_decode"),
    "kv_write": ("index_copy",),
    "elementwise": ("mul", "add", "sub", "silu", "rsqrt", "mean", "flip", "copy_", "cat", "neg", "embedding",
                    "index_select", "masked_fill", "clone", "contiguous", "sum", "div", "pow", "fused_"),
}


def classify(key: str) -> str:
    name = key.removeprefix("aten::").removeprefix("mkldnn::").removeprefix("tokenspeed::")
    for cls, needles in CLASSES.items():
        if any(needle == name or name.startswith(needle) or needle in name for needle in needles):
            return cls
    return "other_ops"


def gemm_ceiling(repeat: int) -> dict[str, float]:
    """GFLOP/s of a 2048^3 fp32 GEMM, one thread: MKL (`F.linear`) and oneDNN on a packed weight."""
    import torch
    import torch.nn.functional as F

    n = 2048
    x, w = torch.randn(n, n), torch.randn(n, n)
    out: dict[str, float] = {}
    packed = torch.ops.mkldnn._reorder_linear_weight(w)
    for name, fn in (("mkl_F_linear", lambda: F.linear(x, w)),
                     ("onednn_packed", lambda: torch.ops.mkldnn._linear_pointwise(x, packed, None, "none", [], ""))):
        fn()
        best = min(_timed(fn) for _ in range(repeat))
        out[f"{name}_gflops"] = round(2 * n**3 / best / 1e9, 1)
    return out


def _timed(fn: Any) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def gemm_flops(llm: Any, tokens: int, logits_rows: int) -> float:
    """Weight FLOPs of one prefill step: every layer for every token, except the pruned last layer's
    attention output + MLP (logits rows only), plus the LM head on the logits rows."""
    model = llm.core.executor.runner.model
    layers = model.model.layers
    flops = 0.0
    for index, layer in enumerate(layers):
        rows = logits_rows if index == len(layers) - 1 else tokens
        attn, mlp = layer.self_attn, layer.mlp
        flops += 2 * tokens * attn.qkv_proj.weight.numel()
        flops += 2 * rows * (attn.o_proj.weight.numel() + mlp.gate_up_proj.weight.numel()
                             + mlp.down_proj.weight.numel())
    return flops + 2 * logits_rows * model.lm_head.weight.numel()


def measure(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from torch.profiler import ProfilerActivity, profile

    from tokenspeed import SamplingParams

    torch.set_num_threads(1)
    llm = cpu_side_by_side.build_llm({}, args.context + 64, max(args.prompts))
    runner = llm.core.executor.runner
    fast = runner.cpu_decode
    captured: list[Any] = []
    run = fast.run

    def capture(batch: Any, **kwargs: Any) -> Any:
        if batch.attn.max_query_len > 1:
            captured.append(batch)
        return run(batch, **kwargs)

    fast.run = capture
    rng = random.Random(0)
    vocab = int(llm.core.executor.model_config.vocab_size)
    results: dict[str, Any] = {"ceiling": gemm_ceiling(args.repeat)}
    for count in args.prompts:
        prompts = [{"prompt_token_ids": [rng.randrange(3, vocab) for _ in range(args.context)]} for _ in range(count)]
        captured.clear()
        llm.generate(prompts, SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True), use_tqdm=False)
        batch = max(captured, key=lambda b: b.num_tokens)

        def step(batch: Any = batch) -> Any:
            return fast.logits(run(batch, logits_rows=True))

        with torch.inference_mode():
            for _ in range(2):
                step()
            wall = min(_timed(step) for _ in range(args.repeat))
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(args.repeat):
                    step()
        by_class: dict[str, float] = {}
        ops: dict[str, float] = {}
        for event in prof.key_averages():
            ms = event.self_cpu_time_total / args.repeat / 1e3
            by_class[classify(event.key)] = by_class.get(classify(event.key), 0.0) + ms
            ops[event.key] = ms
        profiled = sum(by_class.values())
        logits_rows = int(batch.logits_indices.shape[0])
        row: dict[str, Any] = {
            "tokens": batch.num_tokens,
            "wall_ms": round(wall * 1e3, 2),
            "class_ms": {k: round(v, 2) for k, v in sorted(by_class.items(), key=lambda kv: -kv[1])},
            "profiled_ms": round(profiled, 2),
            "gemm_gflops": round(gemm_flops(llm, batch.num_tokens, logits_rows) / (by_class.get("gemm", 0) / 1e3) / 1e9, 1),
            "top_ops_ms": {k: round(v, 3) for k, v in sorted(ops.items(), key=lambda kv: -kv[1])[:16]},
        }
        results[f"prompts_{count}"] = row
        print(json.dumps({f"prompts_{count}": row}, indent=1), flush=True)
    llm.shutdown()
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--prompts", type=int, nargs="*", default=[1, 4])
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--repeat", type=int, default=5)
    parser.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    results = measure(args)
    print(json.dumps(results["ceiling"]))
    write_result(args.out, results)


if __name__ == "__main__":
    main()
