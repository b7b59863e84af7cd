"""Command-line flags for `EngineConfig`, shared by every subcommand that builds an engine.

Flag names match vLLM's (`--max-model-len`, `--max-num-seqs`, ...), so scripts port.
"""

from __future__ import annotations

import argparse

from tokenspeed.config import EngineConfig
from tokenspeed.models.presets import presets_help
from tokenspeed.spec.config import speculative_config_dict


def add_engine_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("engine")
    group.add_argument("--model", default=None,
                       help=f"checkpoint folder, hub id, embedded-moe, or a preset: a real model's shape with "
                            f"random weights ({presets_help()}; the bare lower-case name works too) "
                            f"(default: the embedded tiny model)")
    group.add_argument("--tokenizer", default=None, help="tokenizer folder (default: the model's)")
    group.add_argument("--trust-remote-code", action="store_true",
                       help="run the checkpoint's own tokenizer code (e.g. Kimi-K2's); the model is always ours")
    group.add_argument("--dtype", default="auto", help="auto | float32 | bfloat16 | float16; auto: fp32 on CPU, the checkpoint's half type on GPU "
                            "(default: %(default)s)")
    group.add_argument("--device", default="auto", help="auto | cpu | cuda; auto picks cuda when there is one (default: %(default)s)")
    group.add_argument("--max-model-len", type=int, default=None,
                       help="longest prompt + output (default: the model's max_position_embeddings)")
    group.add_argument("--max-num-seqs", type=int, default=256, help="requests running at once (default: %(default)s)")
    group.add_argument("--max-num-batched-tokens", type=int, default=None, help="per-step token budget (default: 8192; 1024 on the CPU)")
    group.add_argument("--page-size", type=int, default=16, help="tokens per KV page (default: %(default)s)")
    group.add_argument("--disable-prefix-cache", action="store_true", help="turn prefix caching off")
    group.add_argument("--load-format", default="auto", help="auto | safetensors | dummy (random weights) (default: %(default)s)")
    group.add_argument("--seed", type=int, default=0,
                       help="seed of dummy weights and of requests without a seed (default: %(default)s)")
    group.add_argument("--num-kv-pages", type=int, default=None, help="force the KV pool size (default: sized from memory)")
    group.add_argument("--kv-cache-memory-bytes", type=int, default=None,
                       help="bytes for the KV pool (default: CPU 512 MiB, GPU what --gpu-memory-utilization leaves)")
    group.add_argument("--gpu-memory-utilization", type=float, default=0.9,
                       help="fraction of the device's memory the engine may fill (weights, KV pool, graphs) "
                            "(default: %(default)s)")
    group.add_argument("--enforce-eager", action="store_true", help="turn CUDA graphs off")
    group.add_argument("--cuda-graph-max-bs", type=int, default=None,
                       help="largest decode batch captured in a CUDA graph")
    group.add_argument("--disable-overlap", action="store_true", help="turn overlap scheduling off")
    group.add_argument("--disable-cpu-decode-forward", action="store_true",
                       help="CPU: run decode steps through the model's eager layers, not the few-op decode forward")
    group.add_argument("--disable-cpu-prefill-forward", action="store_true",
                       help="CPU: run steps with prompt chunks (prefill, mixed) through the model's eager layers")
    group.add_argument("--disable-cpu-gemm-prepack", action="store_true",
                       help="CPU: run the CPU forward's GEMMs with F.linear, not on oneDNN pre-packed weights "
                            "(env TOKENSPEED_CPU_GEMM_PREPACK=0 too)")
    group.add_argument("--disable-cpu-paged-attention", action="store_true",
                       help="CPU: gather decode rows' KV pages for SDPA instead of the native in-place paged kernel")
    group.add_argument("--disable-cpu-fused-ops", action="store_true",
                       help="CPU: torch ops instead of the native fused norm / RoPE + KV write / SiLU ops")
    group.add_argument("--cpu-threads", type=int, default=None,
                       help="torch threads of the engine on the CPU (serve default: all cores but one)")
    group.add_argument("--kernel", action="append", default=[], metavar="FAMILY.MODE=NAME",
                       help="force a kernel, e.g. attention.decode=reference (repeatable)")
    group.add_argument("--speculative-config", default=None, metavar="JSON",
                       help='speculative decoding, vLLM\'s option: e.g. \'{"method": "suffix"}\', '
                            '\'{"method": "ngram", "num_speculative_tokens": 4}\', \'{"method": "eagle", '
                            '"model": "PATH", "num_speculative_tokens": 3}\', \'{"method": "mtp"}\' (default: off)')
    group.add_argument("--quantization", "-q", default=None, choices=["fp8"],
                       help="fp8: quantise the weights at load (per output channel); FP8 checkpoints "
                            "(quantization_config) load as they are without it (default: the checkpoint's)")
    group.add_argument("--kv-cache-dtype", default="auto", choices=["auto", "fp8", "fp8_e4m3"],
                       help="KV cache storage: auto (the model dtype) or fp8 (e4m3, half the bytes of bf16) "
                            "(default: %(default)s)")
    group.add_argument("--calculate-kv-scales", action="store_true",
                       help="fp8 KV cache: measure each layer's K/V scales, per KV head, on one prompt of random "
                            "tokens at start-up (default: the checkpoint's k_scale / v_scale, else 1.0)")
    group.add_argument("--tensor-parallel-size", "-tp", type=int, default=1,
                       help="ranks, one device each (CPU: one process each); heads, vocabulary and MLPs are "
                            "split by the compiled placement plan (default: %(default)s)")
    group.add_argument("--enable-expert-parallel", action="store_true",
                       help="split routed experts by expert over the ranks instead of by intermediate size")
    group.add_argument("--enable-dp-attention", action="store_true",
                       help="data-parallel attention over the ranks (SGLang's flag; for MLA models): each rank "
                            "runs attention over its own requests; eager only (no CUDA graphs)")

    add_kv_tier_args(parser)


def add_kv_tier_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("KV tiers")
    group.add_argument("--host-kv-cache-bytes", type=int, default=None,
                       help="host memory for the KV host tier (prefix pages evicted from the device, retracted "
                            "requests) (default: a quarter of available host memory on GPU, 0 on CPU)")
    group.add_argument("--kv-cache-dir", default=None, help="directory of the KV disk tier (default: off)")
    group.add_argument("--kv-cache-dir-bytes", type=int, default=64 * 1024**3,
                       help="bytes the disk tier may use (default: %(default)s)")
    group.add_argument("--session-ttl", type=float, default=300.0,
                       help="seconds a finished turn's KV stays protected for its session (prompt_cache_key, "
                            "user, cache_control) (default: %(default)s)")
    group.add_argument("--preemption-mode", choices=("retract", "recompute"), default=None,
                       help="under memory pressure, save a victim's KV to the host (retract) or recompute it "
                            "(default: retract when there is a host tier)")

def engine_config_from_args(args: argparse.Namespace) -> EngineConfig:
    return EngineConfig(
        model=args.model,
        tokenizer=args.tokenizer,
        trust_remote_code=args.trust_remote_code,
        dtype=args.dtype,
        device=args.device,
        max_model_len=args.max_model_len,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        page_size=args.page_size,
        enable_prefix_caching=not args.disable_prefix_cache,
        load_format=args.load_format,
        seed=args.seed,
        num_kv_pages=args.num_kv_pages,
        kv_cache_memory_bytes=args.kv_cache_memory_bytes,
        gpu_memory_utilization=args.gpu_memory_utilization,
        enforce_eager=args.enforce_eager,
        cuda_graph_max_bs=args.cuda_graph_max_bs,
        disable_overlap=args.disable_overlap,
        disable_cpu_decode_forward=args.disable_cpu_decode_forward,
        disable_cpu_prefill_forward=args.disable_cpu_prefill_forward,
        disable_cpu_gemm_prepack=args.disable_cpu_gemm_prepack,
        disable_cpu_paged_attention=args.disable_cpu_paged_attention,
        disable_cpu_fused_ops=args.disable_cpu_fused_ops,
        kernel_overrides=tuple(args.kernel),
        cpu_threads=args.cpu_threads,
        speculative_config=speculative_config_dict(args.speculative_config),
        quantization=args.quantization,
        kv_cache_dtype=args.kv_cache_dtype,
        calculate_kv_scales=args.calculate_kv_scales,
        host_kv_cache_bytes=args.host_kv_cache_bytes,
        kv_cache_dir=args.kv_cache_dir,
        kv_cache_dir_bytes=args.kv_cache_dir_bytes,
        session_ttl=args.session_ttl,
        preemption_mode=args.preemption_mode,
        tensor_parallel_size=args.tensor_parallel_size,
        enable_expert_parallel=args.enable_expert_parallel,
        enable_dp_attention=args.enable_dp_attention,
    )
