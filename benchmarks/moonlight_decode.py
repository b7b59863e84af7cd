"""Moonlight-16B-A3B (DeepSeek-V3 architecture: MLA + 64-expert MoE) bs1 decode against its roofline.

    python benchmarks/moonlight_decode.py --out benchmarks/results/h200_moonlight_decode.json

The Moonlight preset (real config.json) with dummy bf16 weights, CUDA graphs
and overlap scheduling on (`--enforce-eager`, `--disable-overlap` for the
ablations): a 1K-token prompt, then 256 greedy tokens; TPOT is the mean gap
between consecutive tokens.

Roofline of one decode step = bytes a token must read ÷ copy bandwidth
(measured in the same run, `gpu_suite.ceilings`). A token reads its *active*
parameters only: one embedding row, every layer's attention and norms, the
dense MLP (layer 0), the router, the shared experts and `top_k` of the routed
experts of each MoE layer, the final norm and the LM head (MTP layers do not
run), plus the latent KV cache of every layer at the step's context length
(576 values per token and layer). The ratio TPOT ÷ roofline is 1.0 at the
bandwidth limit.
"""

from __future__ import annotations

import argparse
import os
import random
import sys
import time
from pathlib import Path

import torch
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_suite  # noqa: E402  (benchmarks/ is not a package)
from gpu_suite import NOTES, RESULTS, Driver, bw, ceilings, log, random_prompt, save  # noqa: E402

PRESET = "moonlight-16b-a3b"
PROMPT_LEN = 1024
NEW_TOKENS = 256


def _bytes(module: nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in module.parameters())


def active_bytes_per_token(model: nn.Module) -> int:
    """Parameter bytes one decode token reads (see the module docstring)."""
    from tokenspeed.layers.moe import SparseMoE

    inner = model.model  # type: ignore[attr-defined]
    embed = inner.embed_tokens.weight
    total = embed.shape[1] * embed.element_size() + _bytes(inner.norm) + _bytes(model.lm_head)  # type: ignore[attr-defined]
    for layer in list(inner.layers)[: inner.num_layers]:
        total += (
            _bytes(layer.self_attn) + _bytes(layer.input_layernorm) + _bytes(layer.post_attention_layernorm)
        )
        mlp = layer.mlp
        if not isinstance(mlp, SparseMoE):
            total += _bytes(mlp)
            continue
        total += _bytes(mlp.gate) + (0 if mlp.shared_experts is None else _bytes(mlp.shared_experts))
        experts = mlp.experts
        per_expert = (experts.w13[0].numel() + experts.w2[0].numel()) * experts.w13.element_size()
        total += mlp.moe.top_k * per_expert
    return total


def decode_section(args: argparse.Namespace) -> None:
    from tokenspeed.config import EngineConfig
    from tokenspeed.engine.core import EngineCore

    config = EngineConfig(
        model=PRESET,
        dtype="bfloat16",
        device="cuda",
        load_format="dummy",
        max_model_len=4096,
        max_num_seqs=8,
        gpu_memory_utilization=0.9,
        enforce_eager=args.enforce_eager,
        disable_overlap=args.disable_overlap,
    )
    t = time.perf_counter()
    core = EngineCore(config)
    RESULTS["engine_startup_s"] = round(time.perf_counter() - t, 1)
    RESULTS["cuda_graphs"] = core.executor.cuda_graphs_enabled
    RESULTS["overlap"] = core.overlap
    layer0 = core.executor.model.model.layers[0].self_attn
    RESULTS["mla_backend"] = repr(getattr(layer0, "backend", None))
    mc = core.executor.model_config
    assert mc.mla is not None
    weights = active_bytes_per_token(core.executor.model)
    kv_per_token = mc.num_hidden_layers * mc.mla.cache_dim * torch.empty((), dtype=core.executor.dtype).element_size()
    RESULTS["active_weight_bytes_per_token"] = weights
    RESULTS["latent_kv_bytes_per_context_token"] = kv_per_token
    log(
        f"engine up in {RESULTS['engine_startup_s']} s, graphs={core.executor.cuda_graphs_enabled}, {RESULTS['mla_backend']}"
    )

    drv = Driver(core)
    rng = random.Random(0)
    drv.run([random_prompt(rng, PROMPT_LEN, mc.vocab_size)], 16)  # warm-up (Triton compiles)
    stamps = next(iter(drv.run([random_prompt(rng, PROMPT_LEN, mc.vocab_size)], NEW_TOKENS).values()))
    tpot = (stamps[-1] - stamps[0]) / (len(stamps) - 1)
    mean_context = PROMPT_LEN + NEW_TOKENS // 2
    roofline = (weights + kv_per_token * mean_context) / bw()
    RESULTS["moonlight_decode_bs1_tpot_ms"] = round(tpot * 1e3, 3)
    RESULTS["moonlight_decode_bs1_roofline_ms"] = round(roofline * 1e3, 3)
    RESULTS["moonlight_decode_bs1_roofline_ratio"] = round(tpot / roofline, 3)
    log(f"bs1 tpot {tpot * 1e3:.3f} ms, roofline {roofline * 1e3:.3f} ms, ratio {tpot / roofline:.3f}")
    if args.profile:  # where the step's time goes: `<out>.profile.txt`
        gpu_suite.profile_steps(core, drv, rng, mc.vocab_size, args, prefill_len=2048)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/h200_moonlight_decode.json"))
    parser.add_argument("--enforce-eager", action="store_true")
    parser.add_argument("--disable-overlap", action="store_true")
    parser.add_argument("--profile", action="store_true", help="torch.profiler table of decode/prefill steps")
    args = parser.parse_args()
    args.command = " ".join(["python", "benchmarks/moonlight_decode.py", *sys.argv[1:]])
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    ceilings()
    save(args.out, args.command)
    try:
        decode_section(args)
    except Exception as exc:  # the JSON keeps the ceilings and says what failed
        import traceback

        traceback.print_exc()
        NOTES.append(f"decode failed: {type(exc).__name__}: {exc}")
    gpu_suite.free()
    save(args.out, args.command)
    return 0 if "moonlight_decode_bs1_tpot_ms" in RESULTS else 1


if __name__ == "__main__":
    sys.exit(main())
