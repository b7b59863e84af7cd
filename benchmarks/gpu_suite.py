"""The GPU benchmark suite of issue 4, measured side by side in one process on one device.

    python benchmarks/gpu_suite.py --out benchmarks/results/h200_llama31_8b.json

Model: the Llama-3.1-8B preset (real config.json) with dummy bf16 weights.
Ceilings are measured in the same run: copy bandwidth (a 2 GiB device-to-device
copy, bytes read + written over the median time) and the bf16 matmul rate (an
8192^3 product on random data). Roofline of a decode step = (weight bytes read
+ K/V bytes read) / copy bandwidth; MFU = model FLOP/s / matmul rate.

Sections (each writes the JSON again, so a timeout keeps what finished):
ceilings, attention (paged decode kernel alone, batch 32 x 32K), hf (transformers
bs1 TPOT), engine (bs1 TPOT, 8K/64K prefill, decode throughput at 2K context,
a torch.profiler table of decode and prefill steps).
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
import time
from pathlib import Path
from typing import Any

import torch

PRESET = "llama-3.1-8b"
RESULTS: dict[str, Any] = {}
NOTES: list[str] = []


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def save(path: Path, command: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    doc = {
        "command": command,
        "device": torch.cuda.get_device_name(0),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "metrics": RESULTS,
    }
    path.write_text(json.dumps(doc, indent=2) + "\n")
    if NOTES:
        path.with_suffix(".notes.txt").write_text("\n".join(NOTES) + "\n")


def free() -> None:
    gc.collect()
    torch.cuda.empty_cache()


def bench_ms(fn, warmup: int = 3, reps: int = 10) -> float:
    from triton.testing import do_bench

    return float(do_bench(fn, warmup=warmup, rep=reps * 10, return_mode="median"))


# ---------------------------------------------------------------- ceilings


def copy_bandwidth_gb_s() -> float:
    """Copy ceiling: an eager 2 GiB device-to-device copy, bytes read + written over the median time.

    Timed eagerly: a CUDA-graph replay of the same copy (how fp8_kernels.py
    first timed it) gave 2767 GB/s on the H200 where this gave 4273 GB/s
    minutes earlier, so every roofline divides by this measurement.
    """
    n = 1 << 30  # 1 Gi bf16 elements = 2 GiB
    a = torch.randn(n, dtype=torch.bfloat16, device="cuda")
    b = torch.empty_like(a)
    ms = bench_ms(lambda: b.copy_(a))
    return round(2 * a.numel() * 2 / ms / 1e6, 1)


def ceilings() -> None:
    RESULTS["copy_bandwidth_gb_s"] = copy_bandwidth_gb_s()
    m = 8192
    x = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    y = torch.randn(m, m, dtype=torch.bfloat16, device="cuda")
    ms = bench_ms(lambda: x @ y, reps=20)
    RESULTS["bf16_matmul_tflops"] = round(2 * m**3 / ms / 1e9, 1)
    log(f"ceilings: copy {RESULTS['copy_bandwidth_gb_s']} GB/s, matmul {RESULTS['bf16_matmul_tflops']} TFLOP/s")


def bw() -> float:
    return RESULTS["copy_bandwidth_gb_s"] * 1e9


def mm_rate() -> float:
    return RESULTS["bf16_matmul_tflops"] * 1e12


# ---------------------------------------------------------------- attention kernel alone


def attention(batch: int = 32, context: int = 32768) -> None:
    from tokenspeed.kernels import select_kernel

    spec = select_kernel("attention", "decode", platform="cuda", dtype=torch.bfloat16,
                         traits={"sliding_window": False, "head_dim": 128})
    heads, kv_heads, dim, page = 32, 8, 128, 16
    pages_per_row = context // page
    num_pages = batch * pages_per_row
    k_cache = torch.randn(num_pages, page, kv_heads, dim, dtype=torch.bfloat16, device="cuda")
    v_cache = torch.randn_like(k_cache)
    table = torch.randperm(num_pages, device="cuda").view(batch, pages_per_row).to(torch.int32)
    seq_lens = torch.full((batch,), context, dtype=torch.int32, device="cuda")
    q = torch.randn(batch, heads, dim, dtype=torch.bfloat16, device="cuda")
    scale = dim**-0.5
    ms = bench_ms(lambda: spec.impl(q, k_cache, v_cache, table, seq_lens, scale=scale), reps=20)
    kv_bytes = 2 * batch * context * kv_heads * dim * 2
    RESULTS["paged_decode_attention_kernel"] = spec.name
    RESULTS["paged_decode_attention_ms"] = round(ms, 4)
    RESULTS["paged_decode_attention_bw_fraction"] = round(kv_bytes / (ms / 1e3) / bw(), 3)
    log(f"attention {spec.name}: {ms:.3f} ms, bw fraction {RESULTS['paged_decode_attention_bw_fraction']}")


# ---------------------------------------------------------------- transformers baseline


def random_prompt(rng: random.Random, length: int, vocab: int) -> list[int]:
    return [rng.randrange(1000, vocab - 1000) for _ in range(length)]


def hf_baseline(prompt_len: int = 1024) -> None:
    import transformers

    from tokenspeed.models.presets import preset_dict

    cfg = transformers.AutoConfig.for_model(**preset_dict(PRESET))
    with torch.device("cuda"):
        model = transformers.AutoModelForCausalLM.from_config(cfg, dtype=torch.bfloat16).eval()
    ids = torch.tensor([random_prompt(random.Random(1), prompt_len, cfg.vocab_size)], device="cuda")
    mask = torch.ones_like(ids)

    def gen(n: int) -> float:
        torch.cuda.synchronize()
        t = time.perf_counter()
        with torch.no_grad():
            model.generate(ids, attention_mask=mask, max_new_tokens=n, min_new_tokens=n, do_sample=False,
                           pad_token_id=0)
        torch.cuda.synchronize()
        return time.perf_counter() - t

    gen(4)  # warm-up
    short, long = gen(16), gen(64)
    RESULTS["hf_transformers_bs1_tpot_ms"] = round((long - short) / 48 * 1e3, 3)
    RESULTS["hf_transformers_version"] = transformers.__version__
    log(f"hf bs1 tpot {RESULTS['hf_transformers_bs1_tpot_ms']} ms")


# ---------------------------------------------------------------- the engine


class Driver:
    """Drives an EngineCore directly and timestamps every token update."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.n = 0

    def run(self, prompts: list[list[int]], max_tokens: int) -> dict[str, list[float]]:
        from tokenspeed.scheduler.sampling_params import SamplingParams

        params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
        times: dict[str, list[float]] = {}
        for p in prompts:
            rid = f"r{self.n}"
            self.n += 1
            self.core.add_request(rid, p, params)
            times[rid] = []
        while self.core.has_unfinished():
            updates = self.core.step()
            now = time.perf_counter()
            for u in updates:
                if u.new_token_ids and u.request_id in times:
                    times[u.request_id].append(now)
        return times


def weight_bytes_read(model: torch.nn.Module) -> int:
    """Bytes a decode step reads: every parameter but the embedding table (one row of it is read)."""
    total = 0
    for name, p in model.named_parameters():
        if "embed_tokens" in name:
            continue
        total += p.numel() * p.element_size()
    lm = getattr(model, "lm_head", None)
    if lm is not None and getattr(lm, "tied", False):
        total += lm.weight.numel() * lm.weight.element_size()
    return total


def linear_params(model: torch.nn.Module) -> tuple[int, int]:
    """(parameters used per token in the decoder layers, lm_head parameters)."""
    layers = sum(p.numel() for n, p in model.named_parameters() if ".layers." in n and p.dim() == 2)
    lm = model.lm_head.weight.numel()
    return layers, lm


def engine_section(args: argparse.Namespace) -> None:
    from tokenspeed.config import EngineConfig
    from tokenspeed.engine.core import EngineCore

    config = EngineConfig(
        model=PRESET, dtype="bfloat16", device="cuda", load_format="dummy", max_model_len=66560,
        max_num_seqs=256, max_num_batched_tokens=65536, gpu_memory_utilization=0.9,
        enforce_eager=args.enforce_eager, disable_overlap=args.disable_overlap,
    )
    t = time.perf_counter()
    core = EngineCore(config)
    RESULTS["engine_startup_s"] = round(time.perf_counter() - t, 1)
    RESULTS["cuda_graphs"] = core.executor.cuda_graphs_enabled
    RESULTS["overlap"] = core.overlap
    RESULTS["kv_pool_pages"] = core.scheduler.config.num_pages
    layer0 = core.executor.model.model.layers[0].self_attn
    RESULTS["attention_backend"] = repr(getattr(layer0, "attention_backend", None))
    log(f"engine up in {RESULTS['engine_startup_s']} s, graphs={core.executor.cuda_graphs_enabled}, "
        f"pages={core.scheduler.config.num_pages}, {RESULTS['attention_backend']}")
    mc = core.executor.model_config
    kv_per_token = 2 * mc.num_hidden_layers * mc.num_key_value_heads * mc.head_dim * 2
    wbytes = weight_bytes_read(core.executor.model)
    RESULTS["weight_bytes_read_per_step"] = wbytes
    drv = Driver(core)
    rng = random.Random(0)
    vocab = mc.vocab_size

    # -- decode bs1: 1K prompt, 256 new tokens
    drv.run([random_prompt(rng, 1024, vocab)], 16)  # warm-up
    stamps = next(iter(drv.run([random_prompt(rng, 1024, vocab)], 256).values()))
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    avg_ctx = 1024 + 128
    roof = (wbytes + kv_per_token * avg_ctx) / bw()
    RESULTS["decode_bs1_tpot_ms"] = round(tpot * 1e3, 3)
    RESULTS["decode_bs1_roofline_ms"] = round(roof * 1e3, 3)
    RESULTS["decode_bs1_roofline_ratio"] = round(tpot / roof, 3)
    if "hf_transformers_bs1_tpot_ms" in RESULTS:
        RESULTS["speedup_vs_hf"] = round(RESULTS["hf_transformers_bs1_tpot_ms"] / (tpot * 1e3), 2)
    log(f"bs1 tpot {tpot*1e3:.3f} ms, roofline {roof*1e3:.3f} ms, ratio {tpot/roof:.3f}")
    save(args.out, args.command)

    if args.profile:
        profile_steps(core, drv, rng, vocab, args)
    if args.bs1_only:
        return

    # -- prefill 8K and 64K (one step each; fresh prompts so the prefix cache cannot help)
    layer_params, lm_params = linear_params(core.executor.model)
    attn_flops_per_sq = 2 * mc.num_hidden_layers * mc.num_attention_heads * mc.head_dim

    def prefill(length: int, reps: int) -> float:
        samples = []
        for _ in range(reps):
            prompt = random_prompt(rng, length, vocab)
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            drv.run([prompt], 1)
            samples.append(time.perf_counter() - t0)
        return statistics.median(samples)

    prefill(8192, 1)  # warm-up (compiles the extend kernel for this shape)
    t8 = prefill(8192, 3)
    flops8 = 2 * layer_params * 8192 + attn_flops_per_sq * 8192**2 + 2 * lm_params
    RESULTS["prefill_8k_s"] = round(t8, 4)
    RESULTS["prefill_8k_tok_s"] = round(8192 / t8, 1)
    RESULTS["prefill_8k_mfu"] = round(flops8 / t8 / mm_rate(), 3)
    log(f"prefill 8k {t8*1e3:.1f} ms, {8192/t8:.0f} tok/s, mfu {RESULTS['prefill_8k_mfu']}")
    save(args.out, args.command)

    # -- decode throughput at 2K context: prefill every prompt once, then reuse them via the prefix cache
    prompts = [random_prompt(rng, 2048, vocab) for _ in range(max(args.batches))]
    for b in sorted(args.batches, reverse=True):
        new_tokens = args.decode_tokens
        stamps_by = drv.run(prompts[:b], new_tokens)
        starts = [s[0] for s in stamps_by.values()]
        ends = [s[-1] for s in stamps_by.values()]
        lo, hi = max(starts), min(ends)
        count = sum(sum(1 for x in s if lo < x <= hi) for s in stamps_by.values())
        if hi <= lo or count == 0:
            NOTES.append(f"batch {b}: no steady decode window")
            continue
        tok_s = count / (hi - lo)
        step = b / tok_s
        ctx = 2048 + new_tokens // 2
        roof_b = (wbytes + b * kv_per_token * ctx) / bw()
        RESULTS[f"decode_throughput_tok_s_bs{b}"] = round(tok_s, 1)
        RESULTS[f"decode_step_ms_bs{b}"] = round(step * 1e3, 3)
        RESULTS[f"decode_roofline_ratio_bs{b}"] = round(step / roof_b, 3)
        log(f"bs{b}: {tok_s:.0f} tok/s, step {step*1e3:.2f} ms, roofline ratio {step/roof_b:.3f}")
        save(args.out, args.command)

    if not args.skip_64k:
        t64 = prefill(65536, 1)
        flops64 = 2 * layer_params * 65536 + attn_flops_per_sq * 65536**2 + 2 * lm_params
        RESULTS["prefill_64k_s"] = round(t64, 3)
        RESULTS["prefill_64k_tok_s"] = round(65536 / t64, 1)
        RESULTS["prefill_64k_mfu"] = round(flops64 / t64 / mm_rate(), 3)
        log(f"prefill 64k {t64:.2f} s, mfu {RESULTS['prefill_64k_mfu']}")
        save(args.out, args.command)


def ablations(args: argparse.Namespace) -> None:
    """bs1 TPOT with CUDA graphs off and with overlap off: what each feature is worth."""
    from tokenspeed.config import EngineConfig
    from tokenspeed.engine.core import EngineCore

    rng = random.Random(7)
    for name, eager, no_overlap in (("eager", True, False), ("no_overlap", False, True)):
        core = EngineCore(EngineConfig(
            model=PRESET, dtype="bfloat16", device="cuda", load_format="dummy", max_model_len=4096,
            max_num_seqs=8, num_kv_pages=2048, enforce_eager=eager, disable_overlap=no_overlap,
        ))
        drv = Driver(core)
        vocab = core.executor.model_config.vocab_size
        drv.run([random_prompt(rng, 1024, vocab)], 8)
        stamps = next(iter(drv.run([random_prompt(rng, 1024, vocab)], 128).values()))
        RESULTS[f"ablation_decode_bs1_tpot_ms_{name}"] = round((stamps[-1] - stamps[0]) / (len(stamps) - 1) * 1e3, 3)
        log(f"ablation {name}: {RESULTS[f'ablation_decode_bs1_tpot_ms_{name}']} ms")
        del core, drv
        free()


def profile_steps(
    core: Any, drv: Driver, rng: random.Random, vocab: int, args: argparse.Namespace, prefill_len: int = 8192
) -> None:
    from torch.profiler import ProfilerActivity, profile

    from tokenspeed.scheduler.sampling_params import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True, detokenize=False)
    core.add_request("profile-decode", random_prompt(rng, 1024, vocab), params)
    for _ in range(8):
        core.step()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            core.step()
        torch.cuda.synchronize()
    while core.has_unfinished():
        core.step()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=18, max_name_column_width=60)
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof2:
        drv.run([random_prompt(rng, prefill_len, vocab)], 1)
        torch.cuda.synchronize()
    table2 = prof2.key_averages().table(sort_by="cuda_time_total", row_limit=15, max_name_column_width=60)
    text = f"== 20 decode steps, bs1, ~1K context ==\n{table}\n\n== one {prefill_len}-token prefill ==\n{table2}\n"
    args.out.with_suffix(".profile.txt").write_text(text)
    print(text[:6000])


def main() -> int:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200_llama31_8b.json"))
    parser.add_argument("--sections", default="ceilings,attention,hf,engine")
    parser.add_argument("--batches", type=lambda s: [int(x) for x in s.split(",")], default=[1, 8, 32, 128, 256])
    parser.add_argument("--decode-tokens", type=int, default=96)
    parser.add_argument("--skip-64k", action="store_true")
    parser.add_argument("--profile", action="store_true")
    parser.add_argument("--ablations", action="store_true", help="bs1 TPOT with graphs off / overlap off")
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--disable-overlap", action="store_true")
    parser.add_argument("--bs1-only", action="store_true", help="engine section: stop after bs1 decode (+ profile)")
    args = parser.parse_args()
    args.command = " ".join(["python", "benchmarks/gpu_suite.py", *sys.argv[1:]])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    sections = args.sections.split(",")
    if "ceilings" not in sections:
        sections.insert(0, "ceilings")
    for name, fn in (("ceilings", ceilings), ("attention", attention), ("hf", hf_baseline)):
        if name in sections:
            t = time.perf_counter()
            try:
                fn()
            except Exception as exc:  # keep going: one broken section must not lose the others
                NOTES.append(f"{name} failed: {type(exc).__name__}: {exc}")
                log(NOTES[-1])
            free()
            log(f"{name} took {time.perf_counter() - t:.1f} s")
            save(args.out, args.command)
    if "engine" in sections:
        t = time.perf_counter()
        try:
            engine_section(args)
        except Exception as exc:
            import traceback

            traceback.print_exc()
            NOTES.append(f"engine failed: {type(exc).__name__}: {exc}")
        free()
        log(f"engine took {time.perf_counter() - t:.1f} s")
        save(args.out, args.command)
    if args.ablations:
        t = time.perf_counter()
        try:
            ablations(args)
        except Exception as exc:
            NOTES.append(f"ablations failed: {type(exc).__name__}: {exc}")
        log(f"ablations took {time.perf_counter() - t:.1f} s")
        save(args.out, args.command)
    print(json.dumps(RESULTS, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
