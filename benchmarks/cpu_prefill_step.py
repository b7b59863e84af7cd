"""Where CPU prefill and mixed-step time goes: a 512-token prefill, and closed-loop serving at C=4/16.

    python benchmarks/cpu_prefill_step.py [--context 512] [--output 64] [--concurrency 4 16]
        [--rounds 3] [--tree NAME=PATH ...] [--variant NAME=JSON ...] [--out FILE]

Runs the embedded model (fp32, one torch thread: the engine's choice on 2 vCPUs) through the
public `LLM` API and the engine core, in three parts, per config:

1. `prefill`: `--repeat` times `LLM.generate` of one prompt of `--context` random token ids with
   one output token (TTFT without HTTP): `generate_ms` (best and median), and the prefill step
   split as in `cpu_decode_step.py` into `forward_ms` (decoder stack: the layers or the runner's
   CPU forward), `logits_ms` (LM head: only the sampled row), `sample_ms` and `host_ms` (the
   rest of the engine step: scheduler, page tables, batch building, prefix-cache insert, output).
2. `runner`: the last prefill batch re-run at the model-runner level (its K/V rewritten with the
   same values): `forward_ms` best of `--repeat`, and (`--profile`) the aten ops that took its time.
3. `serve_cC`: a closed loop at concurrency C driving `EngineCore` the way `bench serve` drives a
   server: C clients, each submits a request (`--context` random tokens, `--output` greedy tokens,
   ignore_eos) as soon as its previous one finishes; the first C arrive one engine step apart
   (`--burst`: all at once, as `bench serve` sends them; equal lengths then keep them in lockstep).
   `--requests-per-client` requests each. Every engine step is classified by the plan it launches:
   `decode` (decode rows only), `prefill` (prompt chunks only) or `mixed` (both); per kind the
   count, the share of the loop's wall time and the median step time; and the loop's output
   tok/s, mean TTFT (submit to first token) and mean TPOT.

Side by side: each `--tree NAME=PATH` and `--variant NAME=JSON` (LLM keyword arguments, e.g.
`layers={"disable_cpu_prefill_forward": true}`) runs in its own subprocess, interleaved round by
round, so background load hits all alike; per config the best round (lowest prefill
`generate_ms`, highest serving tok/s) is kept. Results (with the command) go to `--out`
(default `benchmarks/results/cpu/cpu_prefill_step.json`).
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import cpu_side_by_side  # noqa: E402  (the probe and driver shared with cpu_decode_step.py)

REPO = Path(__file__).resolve().parent.parent
DEFAULT_OUT = REPO / "benchmarks" / "results" / "cpu" / "cpu_prefill_step.json"


class StepProbe(cpu_side_by_side.StepProbe):
    """The shared step probe; also classifies each step by the plan it launches (`kind`: decode, prefill or
    mixed; `tokens`) and keeps the last batch with prompt chunks."""

    def __init__(self, llm: Any) -> None:
        self.last_prompt_batch: Any = None
        super().__init__(llm)
        launch = self.runner.launch

        def runner_launch(plan: Any, previous: Any = None) -> Any:
            prompt = sum(len(r.input_token_ids) > 1 for r in plan.rows)
            decode = len(plan.rows) - prompt
            self.current["kind"] = "mixed" if prompt and decode else "prefill" if prompt else "decode"
            self.current["tokens"] = sum(len(r.input_token_ids) for r in plan.rows)
            return launch(plan, previous)

        self.runner.launch = runner_launch

    def note_batch(self, batch: Any) -> None:
        if batch.attn.max_query_len > 1:
            self.last_prompt_batch = batch


def _ms(seconds: float) -> float:
    return round(seconds * 1e3, 3)


def prefill_part(llm: Any, probe: StepProbe, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    from tokenspeed import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
    walls, steps = [], []
    for _ in range(args.repeat):
        prompt = {"prompt_token_ids": [rng.randrange(3, llm_vocab(llm)) for _ in range(args.context)]}
        probe.steps.clear()
        t0 = time.perf_counter()
        llm.generate([prompt], params, use_tqdm=False)
        walls.append(time.perf_counter() - t0)
        steps.extend(s for s in probe.steps if s.get("kind") == "prefill")
    row: dict[str, Any] = {"generate_ms": _ms(min(walls)), "generate_median_ms": _ms(statistics.median(walls))}
    for name in ("step", "forward", "logits", "sample"):
        row[f"{name}_ms"] = _ms(statistics.median(s.get(name, 0.0) for s in steps))
    row["host_ms"] = _ms(statistics.median(StepProbe.host_seconds(s) for s in steps))
    row["step_best_ms"] = _ms(min(s["step"] for s in steps))
    row["forward_best_ms"] = _ms(min(s.get("forward", 0.0) for s in steps))
    return row


def llm_vocab(llm: Any) -> int:
    return int(llm.core.executor.model_config.vocab_size)


def runner_part(probe: StepProbe, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    runner, batch = probe.runner, probe.last_prompt_batch
    fast = getattr(runner, "cpu_decode", None)
    use_fast = fast is not None and hasattr(fast, "serves") and fast.serves(batch)  # (older trees: decode only)

    def forward() -> Any:
        return fast.run(batch, logits_rows=True) if use_fast else runner.model(batch, runner.kv)

    def best(fn: Any) -> tuple[float, float, Any]:
        for _ in range(2):
            result = fn()
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            result = fn()
            times.append(time.perf_counter() - t0)
        return min(times), statistics.median(times), result

    out: dict[str, Any] = {"path": "cpu_forward" if use_fast else "layers", "tokens": batch.num_tokens}
    with torch.inference_mode():
        if use_fast:  # the whole last layer too (every row's hidden state), as the layers compute it
            out["forward_all_rows_ms"] = _ms(best(lambda: fast.run(batch))[0])
        fastest, median, hidden = best(forward)
        out["forward_ms"], out["forward_median_ms"] = _ms(fastest), _ms(median)
        if use_fast:
            hidden = fast.run(batch)
        rows = hidden.index_select(0, batch.logits_indices)
        times = []
        for _ in range(args.repeat):
            t0 = time.perf_counter()
            runner.model.compute_logits(rows)
            times.append(time.perf_counter() - t0)
        out["lm_head_ms"] = _ms(min(times))
        if args.profile:
            from torch.profiler import ProfilerActivity, profile

            with profile(activities=[ProfilerActivity.CPU]) as prof:
                for _ in range(3):
                    forward()
            ops = sorted(prof.key_averages(), key=lambda e: -e.self_cpu_time_total)[:14]
            out["ops_self_ms"] = {e.key: round(e.self_cpu_time_total / 3e3, 3) for e in ops}
    return out


def serve_part(llm: Any, probe: StepProbe, args: argparse.Namespace, concurrency: int,
               rng: random.Random) -> dict[str, Any]:
    from tokenspeed import SamplingParams

    core = llm.core
    params = SamplingParams(temperature=0.0, max_tokens=args.output, ignore_eos=True)
    vocab = llm_vocab(llm)
    total = concurrency * args.requests_per_client
    submitted = finished = 0
    sent: dict[str, float] = {}
    first: dict[str, float] = {}
    done: dict[str, float] = {}

    def submit() -> None:
        nonlocal submitted
        request_id = f"c{concurrency}-{submitted}"
        submitted += 1
        sent[request_id] = time.perf_counter()
        core.add_request(request_id, [rng.randrange(3, vocab) for _ in range(args.context)], params)

    probe.steps.clear()
    t0 = time.perf_counter()
    for _ in range(concurrency if args.burst else 1):
        submit()
    while finished < total:
        if submitted < concurrency:  # the first clients arrive one step apart
            submit()
        for update in core.step():
            now = time.perf_counter()
            if update.new_token_ids and update.request_id not in first:
                first[update.request_id] = now
            if update.finished:
                finished += 1
                done[update.request_id] = now
                if submitted < total:
                    submit()
    wall = time.perf_counter() - t0
    steps = [s for s in probe.steps if "kind" in s]
    row: dict[str, Any] = {
        "output_tok_s": round(total * args.output / wall, 1),
        "mean_ttft_ms": _ms(statistics.mean(first[r] - sent[r] for r in sent)),
        "mean_tpot_ms": _ms(statistics.mean((done[r] - first[r]) / (args.output - 1) for r in sent)),
        "wall_s": round(wall, 3),
    }
    busy = sum(s["step"] for s in steps)
    for kind in ("decode", "prefill", "mixed"):
        these = [s for s in steps if s["kind"] == kind]
        row[kind] = {
            "steps": len(these),
            "time_share": round(sum(s["step"] for s in these) / busy, 3) if busy else 0.0,
            "step_median_ms": _ms(statistics.median(s["step"] for s in these)) if these else None,
            "forward_median_ms": _ms(statistics.median(s.get("forward", 0.0) for s in these)) if these else None,
        }
    return row


def measure(args: argparse.Namespace, llm_kwargs: dict[str, Any], seed: int) -> dict[str, Any]:
    from tokenspeed import SamplingParams

    llm = cpu_side_by_side.build_llm(llm_kwargs, args.context + args.output + 64, max(args.concurrency))
    probe = StepProbe(llm)
    rng = random.Random(seed)
    out: dict[str, Any] = {}
    try:
        warm = [{"prompt_token_ids": [rng.randrange(3, llm_vocab(llm)) for _ in range(args.context)]}
                for _ in range(2)]
        llm.generate(warm, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True), use_tqdm=False)
        out["prefill"] = prefill_part(llm, probe, args, rng)
        out["runner"] = runner_part(probe, args)
        for c in args.concurrency:
            out[f"serve_c{c}"] = serve_part(llm, probe, args, c, rng)
    finally:
        llm.shutdown()
    return out


def best_of(rounds: list[dict[str, Any]]) -> dict[str, Any]:
    best: dict[str, Any] = {}
    best["prefill"] = dict(min(rounds, key=lambda r: r["prefill"]["generate_ms"])["prefill"])
    best["prefill"]["generate_ms_rounds"] = [r["prefill"]["generate_ms"] for r in rounds]
    best["prefill"]["forward_best_ms"] = min(r["prefill"]["forward_best_ms"] for r in rounds)
    best["runner"] = dict(min(rounds, key=lambda r: r["runner"]["forward_ms"])["runner"])
    for key in rounds[0]:
        if key.startswith("serve_"):
            best[key] = dict(max(rounds, key=lambda r: r[key]["output_tok_s"])[key])
            best[key]["output_tok_s_rounds"] = [r[key]["output_tok_s"] for r in rounds]
    return best


def round_summary(res: dict[str, Any]) -> str:
    """One round's line of progress."""
    serve = {k: v["output_tok_s"] for k, v in res.items() if k.startswith("serve_")}
    return (f"prefill generate {res['prefill']['generate_ms']} ms, runner forward "
            f"{res['runner']['forward_ms']} ms, serving tok/s {serve}")


def print_results(results: dict[str, Any]) -> None:
    """The best rounds' table."""
    print(f"\n{'config':<22} {'generate':>9} {'step':>7} {'fwd':>7} {'lmhead':>7} {'sample':>7} {'host':>7} "
          f"{'runner fwd':>10}")
    for name, res in results.items():
        p, rn = res["prefill"], res["runner"]
        print(f"{name:<22} {p['generate_ms']:9.2f} {p['step_ms']:7.2f} {p['forward_ms']:7.2f} {p['logits_ms']:7.2f} "
              f"{p['sample_ms']:7.2f} {p['host_ms']:7.2f} {rn['forward_ms']:10.2f}")
    print(f"\n{'config':<22} {'C':>3} {'tok/s':>7} {'TTFT':>7} {'TPOT':>6}  steps/time share/median ms: "
          "decode | prefill | mixed")
    for name, res in results.items():
        for key, row in res.items():
            if not key.startswith("serve_"):
                continue
            kinds = " | ".join(f"{row[k]['steps']} / {row[k]['time_share']:.2f} / {row[k]['step_median_ms']}"
                               for k in ("decode", "prefill", "mixed"))
            print(f"{name:<22} {key.removeprefix('serve_c'):>3} {row['output_tok_s']:7.1f} {row['mean_ttft_ms']:7.1f} "
                  f"{row['mean_tpot_ms']:6.2f}  {kinds}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=512)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="*", default=[4, 16])
    parser.add_argument("--requests-per-client", type=int, default=3)
    parser.add_argument("--repeat", type=int, default=10)
    parser.add_argument("--profile", action="store_true", help="the runner part's top aten ops")
    parser.add_argument("--burst", action="store_true", help="serving: the first C requests arrive at once")
    cpu_side_by_side.add_driver_arguments(parser, DEFAULT_OUT)
    args = parser.parse_args()

    forwarded = ["--context", str(args.context), "--output", str(args.output),
                 "--concurrency", *map(str, args.concurrency), "--requests-per-client", str(args.requests_per_client),
                 "--repeat", str(args.repeat), *(["--profile"] if args.profile else []),
                 *(["--burst"] if args.burst else [])]

    cpu_side_by_side.run_side_by_side(__file__, args, forwarded, measure, best_of, round_summary, print_results)


if __name__ == "__main__":
    main()
