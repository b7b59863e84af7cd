"""FP8 end to end on the H200, through the public `LLM` API (issue 16): weights, MoE, KV cache.

    python benchmarks/fp8_e2e.py --out benchmarks/results/h200/fp8/fp8_e2e.json
    python benchmarks/fp8_e2e.py --sections llama --out $OUT/llama.json
    python benchmarks/fp8_e2e.py --smoke --out /tmp/fp8_e2e.json      # CPU, tiny shapes: the script runs

Every figure is wall clock around `LLM.generate` (CUDA graphs and overlap
scheduling on, prefix caching off so no prompt is served from the cache):
the decode time per step is (time for 1 + N new tokens - time for 1) / N,
prompts distinct between the two calls, after a warm-up that compiles the
kernels; the median of `--repeats` such measurements (3) is reported.
Dummy weights at the presets' true shapes.

Sections (`--sections`, comma separated; the JSON is rewritten after each):

- `llama`: Llama-3.1-8B bs1 TPOT with `quantization="fp8"` (online, one
  scale per output channel) against its FP8 roofline, and with bf16 weights
  beside it. Roofline = (bytes of the weights a decode step reads + K/V bytes
  at the mean context) / copy bandwidth, the copy measured in this run.
  Targets: fp8 TPOT <= 1.15 x roofline, bf16 TPOT / fp8 TPOT >= 1.7.
- `qwen3_dense`: Qwen3-8B bs1 the same way, with the block-FP8 checkpoint format
  (the qwen3-8b-fp8 preset: 128 x 128 weight scales, as Qwen3-*-FP8 and
  DeepSeek publish them), with online per-channel FP8 of the bf16 preset, and
  bf16: the block-scale launches of the FP8 GEMV end to end.
- `llama_batch`: Llama-3.1-8B at 4 and 16 rows (`--batches`; context 1024), where the FP8
  projections take the skinny tensor-core GEMM (2-16 tokens): FP8 with it, FP8
  without it (`TOKENSPEED_FP8_SKINNY=0`, the FP8 GEMMs) and bf16; TPOT and
  tokens/s. The skinny GEMM's effect on a decode step, at short context.
- `qwen3_moe`: the qwen3-30b-a3b-fp8 preset (block-FP8 checkpoint format),
  decode at bs1 and bs64 (TPOT, tokens/s, and the bs1 roofline of the active
  parameters: attention, router and top-8 of 128 experts per layer).
- `kv_long`: Llama-3.1-8B FP8 weights with the bf16 and the fp8 KV cache at
  long context (4 requests of 32K tokens): decode TPOT against its roofline
  (weights + every row's K/V), and the pool's pages and 100K-token contexts
  that fit at the same memory utilisation. Its TPOT is timed over engine
  steps once every row decodes (`steady_decode`): by the difference of two
  `generate` calls, the 128K prompt tokens' prefill (seconds, varying by
  tens of ms) and the decode steps mixed into its chunks swamp 64 steps.

`--profile` writes a kernel table of steady decode steps (`steady_decode`) beside the JSON for each
variant and batch: `<out>.{fp8,bf16}.profile.txt`, `<out>.qwen3_dense_{block_fp8,online_fp8,bf16}.profile.txt`,
`<out>.qwen3_moe_bs{1,64}.profile.txt`,
`<out>.kv_long_{bf16,fp8}.profile.txt`.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any
from unittest import mock

import torch
from torch import nn

RESULTS: dict[str, Any] = {}
SECTIONS = ("llama", "qwen3_dense", "llama_batch", "qwen3_moe", "kv_long")


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def save(path: Path, command: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "cpu"
    doc = {"command": command, "device": device,
           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "metrics": RESULTS}
    path.write_text(json.dumps(doc, indent=2) + "\n")


# ---------------------------------------------------------------- ceilings and byte counts


def copy_bandwidth_gb_s(smoke: bool) -> float:
    """Bytes read + written by a device-to-device copy over its median time (2 GiB on the GPU)."""
    device = "cpu" if smoke else "cuda"
    n = (1 << 22) if smoke else (1 << 30)
    a = torch.randn(n, dtype=torch.bfloat16, device=device)
    b = torch.empty_like(a)
    times = []
    for _ in range(3 if smoke else 20):
        if not smoke:
            torch.cuda.synchronize()
        t = time.perf_counter()
        b.copy_(a)
        if not smoke:
            torch.cuda.synchronize()
        times.append(time.perf_counter() - t)
    times.sort()
    return round(2 * a.numel() * a.element_size() / times[len(times) // 2] / 1e9, 1)


def _bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def decode_weight_bytes(model: nn.Module) -> int:
    """Bytes one decode token reads: all parameters but the embedding (one row) and unused experts."""
    from tokenspeed.layers.moe import SparseMoE

    inner = model.model  # type: ignore[attr-defined]
    embed = inner.embed_tokens.weight
    total = embed.shape[1] * embed.element_size() + _bytes(inner.norm) + _bytes(model.lm_head)  # type: ignore[attr-defined]
    for layer in list(inner.layers)[: inner.num_layers]:
        mlp = layer.mlp
        total += _bytes(layer) - _bytes(mlp)
        if not isinstance(mlp, SparseMoE):
            total += _bytes(mlp)
            continue
        experts = mlp.experts
        active = _bytes(experts) * mlp.moe.top_k // experts.num_experts  # fp8 weights and their scales
        total += _bytes(mlp.gate) + active + (0 if mlp.shared_experts is None else _bytes(mlp.shared_experts))
    return total


def kv_bytes_per_token(llm: Any) -> int:
    executor = llm.core.executor
    heads, k_dim, v_dim = executor.model_config.kv_cache_layout
    element = torch.empty((), dtype=executor.kv_dtype).element_size()
    return executor.model_config.num_hidden_layers * heads * (k_dim + v_dim) * element


# ---------------------------------------------------------------- timing through the LLM API


def _prompts(rng: random.Random, count: int, length: int, vocab: int) -> list[dict[str, list[int]]]:
    return [{"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(length)]} for _ in range(count)]


def decode_step_s(llm: Any, batch: int, prompt_len: int, new_tokens: int, rng: random.Random, repeats: int) -> float:
    """Wall-clock seconds of one decode step of `batch` rows (see the module docstring).

    The median of `repeats` measurements on fresh prompts: one alone moved by up to 2% between runs
    whose kernels took the same time in the profile, which left 1% changes undecidable.
    """
    from tokenspeed import SamplingParams

    vocab = llm.core.executor.model_config.vocab_size

    def timed(tokens: int, rows: int = batch) -> float:
        params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True, detokenize=False)
        prompts = _prompts(rng, rows, prompt_len, vocab)
        t = time.perf_counter()
        llm.generate(prompts, params, use_tqdm=False)
        return time.perf_counter() - t

    # Warm-up at the same context and (up to 64K prompt tokens) the same batch, so that prefill chunks
    # and decode steps of the measured shapes have compiled their kernels and settled their tuners.
    timed(4, rows=max(1, min(batch, (1 << 16) // prompt_len)))
    return statistics.median((timed(1 + new_tokens) - timed(1)) / new_tokens for _ in range(repeats))


def engine(model: str, smoke: bool, **options: Any) -> Any:
    from tokenspeed import LLM

    base: dict[str, Any] = dict(load_format="dummy", skip_tokenizer_init=True, enable_prefix_caching=False,
                                show_progress=False, seed=0)
    if smoke:
        base.update(device="cpu", dtype="float32", max_model_len=256, max_num_seqs=8, kv_cache_memory_bytes=1 << 20)
    else:
        base.update(device="cuda", dtype="bfloat16", gpu_memory_utilization=0.9)
    t = time.perf_counter()
    llm = LLM(model, **{**base, **options})
    log(f"{model} {options} up in {time.perf_counter() - t:.1f} s")
    return llm


def short_context_engine(args: argparse.Namespace, model: str, rows: int, **options: Any) -> Any:
    """An engine for the short-context sections (`llama`, `qwen3_dense`, `llama_batch`): up to `rows` rows,
    a 4K window."""
    return engine(model, args.smoke, max_num_seqs=rows, max_model_len=None if args.smoke else 4096, **options)


def release(llm: Any) -> None:
    llm.shutdown()
    del llm
    gc.collect()
    if torch.cuda.is_available():
        torch.cuda.empty_cache()


# ---------------------------------------------------------------- sections


def bs1_against_roofline(args: argparse.Namespace, section: str, variants: list[tuple[str, str, dict[str, Any]]],
                         ) -> dict[str, Any]:
    """bs1 TPOT of each (name, model, options) variant against its roofline (the section's module docstring),
    a profile of each with `--profile`; the section's results."""
    prompt_len, new_tokens = (8, 4) if args.smoke else (1024, 256)
    mean_context = prompt_len + new_tokens // 2
    out: dict[str, Any] = RESULTS.setdefault(section, {"prompt_len": prompt_len, "new_tokens": new_tokens})
    for name, model, options in variants:
        llm = short_context_engine(args, model, 8, **options)
        step = decode_step_s(llm, 1, prompt_len, new_tokens, random.Random(1), args.repeats)
        weights = decode_weight_bytes(llm.core.executor.model)
        roofline = (weights + kv_bytes_per_token(llm) * mean_context) / (RESULTS["copy_bandwidth_gb_s"] * 1e9)
        out[name] = {"bs1_tpot_ms": round(step * 1e3, 3), "roofline_ms": round(roofline * 1e3, 3),
                     "roofline_ratio": round(step / roofline, 3), "weight_bytes_per_token": weights}
        log(f"{section} {name}: bs1 TPOT {step * 1e3:.3f} ms, roofline {roofline * 1e3:.3f} ms ({step / roofline:.3f}x)")
        if args.profile:
            prefix = "" if section == "llama" else f"{section}_"  # the llama profiles keep their names
            steady_decode(llm, 1, prompt_len, 32, args.out.with_name(f"{args.out.stem}.{prefix}{name}.profile.txt"))
        release(llm)
    return out


def llama(args: argparse.Namespace, models: dict[str, str]) -> None:
    out = bs1_against_roofline(args, "llama", [("fp8", models["llama"], {"quantization": "fp8"}),
                                               ("bf16", models["llama"], {})])
    out["bf16_over_fp8"] = round(out["bf16"]["bs1_tpot_ms"] / out["fp8"]["bs1_tpot_ms"], 3)
    out["targets"] = {"fp8_roofline_ratio_max": 1.15, "bf16_over_fp8_min": 1.7,
                      "met": out["fp8"]["roofline_ratio"] <= 1.15 and out["bf16_over_fp8"] >= 1.7}


def qwen3_dense(args: argparse.Namespace, models: dict[str, str]) -> None:
    out = bs1_against_roofline(args, "qwen3_dense", [
        ("block_fp8", models["qwen3_dense_fp8"], {}),  # the checkpoint's 128 x 128 block scales
        ("online_fp8", models["qwen3_dense"], {"quantization": "fp8"}),  # one scale per output channel
        ("bf16", models["qwen3_dense"], {}),
    ])
    out["bf16_over_block_fp8"] = round(out["bf16"]["bs1_tpot_ms"] / out["block_fp8"]["bs1_tpot_ms"], 3)


def llama_batch(args: argparse.Namespace, models: dict[str, str]) -> None:
    prompt_len, new_tokens = (8, 4) if args.smoke else (1024, 128)
    batches = (2, 4) if args.smoke else tuple(int(b) for b in args.batches.split(","))
    out: dict[str, Any] = RESULTS.setdefault("llama_batch", {"prompt_len": prompt_len, "new_tokens": new_tokens})
    fp8 = {"quantization": "fp8"}
    variants = (("fp8", fp8, "1"), ("fp8_no_skinny", fp8, "0"), ("bf16", {}, "1"))
    for name, options, skinny in variants:
        with mock.patch.dict(os.environ, {"TOKENSPEED_FP8_SKINNY": skinny}):  # read as the engine loads its layers
            llm = short_context_engine(args, models["llama"], max(batches), **options)
        for batch in batches:
            step = decode_step_s(llm, batch, prompt_len, new_tokens, random.Random(batch), args.repeats)
            out.setdefault(name, {})[f"bs{batch}"] = {"tpot_ms": round(step * 1e3, 3),
                                                      "tokens_per_s": round(batch / step, 1)}
            log(f"llama_batch {name} bs{batch}: TPOT {step * 1e3:.3f} ms, {batch / step:.0f} tok/s")
        release(llm)
    out["skinny_speedup"] = {f"bs{b}": round(out["fp8_no_skinny"][f"bs{b}"]["tpot_ms"] / out["fp8"][f"bs{b}"]["tpot_ms"], 3)
                             for b in batches}
    from tokenspeed.kernels.gemm.fp8_skinny_triton import tuned_skinny_shapes

    out["fp8_skinny_launches"] = tuned_picks(tuned_skinny_shapes(), "launch")  # the tuner's; none where a table has them


def steady_decode(llm: Any, batch: int, prompt_len: int, steps: int, profile_path: Path | None = None) -> float:
    """Seconds per decode step of `batch` rows once every row decodes (engine steps, wall clock).

    The rows are submitted together and stepped until each has its first token,
    so no timed step carries a prefill chunk; then `steps` steps are timed as
    four runs and the median run's time per step is returned (one host stall
    once added 7% to a single whole-loop figure whose kernels were unchanged:
    H100, 2026-12-07). With `profile_path`, as many more run under
    torch.profiler and their kernel table is written there (kernels inside
    CUDA graphs are traced too; busy time below the wall clock is launch gaps
    and host time; CPU ops under --smoke).
    """
    from torch.profiler import ProfilerActivity, profile

    from tokenspeed import SamplingParams

    core = llm.core
    vocab = core.executor.model_config.vocab_size
    extra = 8 + (steps if profile_path is not None else 0)
    params = SamplingParams(temperature=0.0, max_tokens=steps + extra, ignore_eos=True, detokenize=False)
    prompts = _prompts(random.Random(4), batch, prompt_len, vocab)
    waiting = {f"steady-{i}" for i in range(batch)}
    for i, prompt in enumerate(prompts):
        core.add_request(f"steady-{i}", prompt["prompt_token_ids"], params)
    while waiting:
        waiting -= {update.request_id for update in core.step() if update.new_token_ids}
    sync = torch.cuda.synchronize if torch.cuda.is_available() else (lambda: None)
    for _ in range(4):
        core.step()
    sync()
    step_s = statistics.median(_per_step_in_runs(core, steps, sync))
    if profile_path is not None:
        activity = ProfilerActivity.CUDA if torch.cuda.is_available() else ProfilerActivity.CPU
        with profile(activities=[activity]) as prof:
            for _ in range(steps):
                core.step()
            sync()
        write_kernel_table(prof, steps, f"{steps} decode steps, bs{batch}, context ~{prompt_len}: "
                           f"wall {step_s * 1e6:.1f} us/step (unprofiled)", profile_path)
    while core.has_unfinished():
        core.step()
    return step_s


def _per_step_in_runs(core: Any, steps: int, sync: Callable[[], None]) -> list[float]:
    """Seconds per engine step in each of four back-to-back runs that together take `steps` steps.

    No drain between runs: each engine step waits for the one before it (overlap scheduling), so a
    run's wall clock is its steps' device time; the last run also pays the final drain, as the whole
    loop did when it was one run.
    """
    parts = [part for i in range(4) if (part := steps // 4 + (i < steps % 4))]
    sync()
    stamps = [time.perf_counter()]
    for part in parts:
        for _ in range(part):
            core.step()
        stamps.append(time.perf_counter())
    sync()
    stamps[-1] = time.perf_counter()
    return [(end - start) / part for start, end, part in zip(stamps, stamps[1:], parts)]


def tuned_picks(chosen: dict[Any, Any], label: str, name: Any = repr) -> dict[str, Any]:
    """A launch tuner's picks (`LaunchTuner.chosen()`) for the JSON: per key, the pick and every candidate's time."""
    return {name(key): {label: repr(choice.config), "timed_us": choice.timings_us} for key, choice in chosen.items()}


def write_kernel_table(prof: Any, steps: int, title: str, path: Path) -> None:
    on_gpu = torch.cuda.is_available()
    rows = [(e.key, e.count / steps, (e.device_time_total if on_gpu else e.self_cpu_time_total) / steps)
            for e in prof.key_averages()]
    rows = [row for row in rows if row[2] > 0]
    rows.sort(key=lambda r: -r[2])
    busy = sum(r[2] for r in rows)
    lines = [f"{title}, kernels busy {busy:.1f} us/step", "", "| kernel | per step | us/step |", "|---|---:|---:|"]
    lines += [f"| {key[:90]} | {count:g} | {us:.1f} |" for key, count, us in rows[:40]]
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("\n".join(lines) + "\n")
    log("\n".join(lines[:24]))


def qwen3_moe(args: argparse.Namespace, models: dict[str, str]) -> None:
    prompt_len, new_tokens = (8, 4) if args.smoke else (512, 128)
    big = 2 if args.smoke else 64
    out: dict[str, Any] = RESULTS.setdefault("qwen3_moe", {"prompt_len": prompt_len, "new_tokens": new_tokens})
    llm = engine(models["qwen3_moe"], args.smoke, max_num_seqs=big, max_model_len=None if args.smoke else 4096)
    rng = random.Random(2)
    for batch in (1, big):
        step = decode_step_s(llm, batch, prompt_len, new_tokens, rng, args.repeats)
        out[f"bs{batch}"] = {"tpot_ms": round(step * 1e3, 3), "tokens_per_s": round(batch / step, 1)}
        log(f"qwen3_moe fp8 bs{batch}: TPOT {step * 1e3:.3f} ms, {batch / step:.0f} tok/s")
        if args.profile:
            table = args.out.with_name(f"{args.out.stem}.qwen3_moe_bs{batch}.profile.txt")
            steady_decode(llm, batch, prompt_len, 32, table)
    # The experts' decode tiles are timed on first use, per process (`experts_fp8_triton`): keep the picks.
    from tokenspeed.kernels.moe.experts_fp8_triton import tuned_decode_tiles

    out["decode_tiles"] = tuned_picks(tuned_decode_tiles(), "tiles", lambda key: f"tokens={key[0]}")
    weights = decode_weight_bytes(llm.core.executor.model)
    roofline = (weights + kv_bytes_per_token(llm) * (prompt_len + new_tokens // 2)) / (
        RESULTS["copy_bandwidth_gb_s"] * 1e9)
    out["bs1"].update(roofline_ms=round(roofline * 1e3, 3), roofline_ratio=round(out["bs1"]["tpot_ms"] / 1e3 / roofline, 3),
                      active_weight_bytes_per_token=weights)
    release(llm)


def kv_long(args: argparse.Namespace, models: dict[str, str]) -> None:
    batch, context, steps = (2, 32, 4) if args.smoke else (4, 32768, 64)
    out: dict[str, Any] = RESULTS.setdefault("kv_long", {"batch": batch, "context": context, "steps": steps})
    for kv in ("auto", "fp8"):
        # max_num_seqs 256 so that the pool is sized by memory alone (not capped at what `batch` requests
        # could use): its pages are the capacity figure; graphs only up to `batch` rows.
        options: dict[str, Any] = dict(quantization="fp8", kv_cache_dtype=kv, max_num_seqs=256,
                                       cuda_graph_max_bs=batch, max_model_len=context + 2 * steps + 32)
        if not args.smoke:
            options["max_num_batched_tokens"] = 16384
        llm = engine(models["llama"], args.smoke, **options)
        name = "bf16" if kv == "auto" else "fp8"
        steady_decode(llm, batch, context, 4)  # compiles and tunes at this shape
        profile = args.out.with_name(f"{args.out.stem}.kv_long_{name}.profile.txt") if args.profile else None
        step = steady_decode(llm, batch, context, steps, profile)
        limits = llm.core.executor.limits
        per_token = kv_bytes_per_token(llm)
        read = decode_weight_bytes(llm.core.executor.model) + per_token * batch * (context + steps)
        roofline = read / (RESULTS["copy_bandwidth_gb_s"] * 1e9)
        out[name] = {"tpot_ms": round(step * 1e3, 3), "roofline_ms": round(roofline * 1e3, 3),
                     "roofline_ratio": round(step / roofline, 3), "kv_pages": limits.num_pages,
                     "kv_bytes_per_token": per_token,
                     "contexts_of_100k_that_fit": limits.num_pages * limits.page_size // 100_000}
        log(f"kv_long {name} KV: TPOT {step * 1e3:.3f} ms at {batch} x {context} ({step / roofline:.3f}x roofline), "
            f"{limits.num_pages} pages")
        release(llm)
    # The fp8 cache's launch and the skinny GEMM's shapes are timed on first use: keep the picks.
    from tokenspeed.kernels.attention.decode_triton import tuned_fp8_launches
    from tokenspeed.kernels.gemm.fp8_skinny_triton import tuned_skinny_shapes

    out["fp8_attention_launches"] = tuned_picks(tuned_fp8_launches(), "launch")
    out["fp8_skinny_launches"] = tuned_picks(tuned_skinny_shapes(), "launch")
    out["bf16_over_fp8_tpot"] = round(out["bf16"]["tpot_ms"] / out["fp8"]["tpot_ms"], 3)
    out["fp8_over_bf16_pages"] = round(out["fp8"]["kv_pages"] / out["bf16"]["kv_pages"], 3)


# ---------------------------------------------------------------- smoke models


def smoke_models(root: Path) -> dict[str, str]:
    """The presets' configs shrunk in width and depth, for `--smoke` on the CPU."""
    from tokenspeed.models.presets import preset_dict

    narrow = dict(hidden_size=128, intermediate_size=256, num_hidden_layers=2, num_attention_heads=4,
                  num_key_value_heads=2, head_dim=32, vocab_size=512, max_position_embeddings=512)
    shapes = {
        "llama": ("llama-3.1-8b", narrow),
        "qwen3_dense": ("qwen3-8b", narrow),
        "qwen3_dense_fp8": ("qwen3-8b-fp8", narrow),
        "qwen3_moe": ("qwen3-30b-a3b-fp8", {**narrow, "moe_intermediate_size": 128, "num_experts": 8,
                                            "num_experts_per_tok": 2}),
    }
    folders = {}
    for key, (preset, changes) in shapes.items():
        raw = {k: v for k, v in preset_dict(preset).items() if k != "tokenspeed_description"}
        folder = root / key
        folder.mkdir(parents=True, exist_ok=True)
        (folder / "config.json").write_text(json.dumps({**raw, **changes}))
        folders[key] = str(folder)
    return folders


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200/fp8/fp8_e2e.json"))
    parser.add_argument("--sections", default=",".join(SECTIONS), help=f"comma separated, of {', '.join(SECTIONS)}")
    parser.add_argument("--smoke", action="store_true", help="CPU, tiny shapes: checks the script, measures nothing")
    parser.add_argument("--batches", default="4,16", help="llama_batch's row counts, comma separated (2-16)")
    parser.add_argument("--profile", action="store_true", help="a kernel table of the decode steps of each variant and batch")
    parser.add_argument("--repeats", type=int, default=3, choices=range(1, 100), metavar="N",
                        help="decode-step measurements per figure; their median is reported")
    args = parser.parse_args()
    command = " ".join(["python", "benchmarks/fp8_e2e.py", *sys.argv[1:]])
    sections = [s.strip() for s in args.sections.split(",") if s.strip()]
    unknown = sorted(set(sections) - set(SECTIONS))
    if unknown:
        parser.error(f"unknown sections {unknown}; choose from {', '.join(SECTIONS)}")
    if not args.smoke and not torch.cuda.is_available():
        parser.error("no GPU: use --smoke")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    models = (smoke_models(Path(tempfile.mkdtemp(prefix="fp8_e2e_"))) if args.smoke
              else {"llama": "llama-3.1-8b", "qwen3_moe": "qwen3-30b-a3b-fp8", "qwen3_dense": "qwen3-8b",
                    "qwen3_dense_fp8": "qwen3-8b-fp8"})
    RESULTS["copy_bandwidth_gb_s"] = copy_bandwidth_gb_s(args.smoke)
    RESULTS["tpot_repeats"] = args.repeats
    from tokenspeed.kernels.gemm.fp8_gemv_shapes import table_path

    shapes = table_path(torch.cuda.get_device_name(0) if torch.cuda.is_available() else "")
    RESULTS["fp8_gemv_shapes"] = str(shapes) if shapes else "built-in rules and launch tuner"  # the FP8 GEMVs' launches
    log(f"copy bandwidth {RESULTS['copy_bandwidth_gb_s']} GB/s")
    runners: dict[str, Callable[[argparse.Namespace, dict[str, str]], None]] = {
        "llama": llama, "qwen3_dense": qwen3_dense, "llama_batch": llama_batch, "qwen3_moe": qwen3_moe,
        "kv_long": kv_long}
    failed = []
    for section in sections:
        t = time.perf_counter()
        try:
            runners[section](args, models)
        except Exception as exc:  # the JSON keeps what finished and says what failed
            import traceback

            traceback.print_exc()
            RESULTS.setdefault("failed", {})[section] = f"{type(exc).__name__}: {exc}"
            failed.append(section)
        RESULTS.setdefault("section_seconds", {})[section] = round(time.perf_counter() - t, 1)
        save(args.out, command)
    save(args.out, command)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
