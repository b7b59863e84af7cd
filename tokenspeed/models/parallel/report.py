"""`tokenspeed placement MODEL --tp N [--ep M] [--dp-attention]`: the compiled plan, and what each rank holds.

Needs only the model's config: a preset (`llama-3.1-8b`), `embedded`, or a
folder with a `config.json`; no weights are read and no device is used, so
capacity planning for a 685B model runs on a laptop.
"""

from __future__ import annotations

import argparse
import json
from importlib import resources
from pathlib import Path

from tokenspeed.errors import ModelNotFound
from tokenspeed.models.config import ModelConfig
from tokenspeed.models.parallel.footprint import format_footprint, kv_bytes_per_token, weights_per_rank
from tokenspeed.models.parallel.fp8_sharding import check_fp8_sharding
from tokenspeed.models.quant_config import resolve_quantization
from tokenspeed.placement.compiler import compile_plan
from tokenspeed.placement.model_graph import describe_model
from tokenspeed.placement.parallel_config import ALL2ALL_BACKENDS, ParallelConfig
from tokenspeed.placement.plan_text import format_plan

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def add_parser(sub: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    parser = sub.add_parser(
        "placement",
        help="the compiled parallel plan of a model: collectives per layer, bytes per rank",
        description=__doc__.splitlines()[0] if __doc__ else None,
    )
    parser.add_argument("model", nargs="?", default="embedded",
                        help="preset name, 'embedded', or a folder with config.json (default: %(default)s)")
    parser.add_argument("--tp", "-tp", "--tensor-parallel-size", dest="tp", type=int, default=1,
                        help="tensor_parallel_size: ranks (devices) in the world (default: %(default)s)")
    parser.add_argument("--ep", "--expert-parallel-size", dest="ep", type=int, default=None,
                        help="split routed experts by expert over this many ranks (implies expert parallelism)")
    parser.add_argument("--enable-expert-parallel", action="store_true",
                        help="expert parallelism over every rank (vLLM's flag; --ep picks a smaller EP size)")
    parser.add_argument("--dp-attention", "--enable-dp-attention", dest="dp_attention", action="store_true",
                        help="data-parallel attention (SGLang's flag): each attention group holds whole requests")
    parser.add_argument("--dp", "--data-parallel-size", dest="dp", type=int, default=None,
                        help="attention data-parallel groups with --dp-attention (default: --tp)")
    parser.add_argument("--all2all-backend", choices=ALL2ALL_BACKENDS, default=ALL2ALL_BACKENDS[0],
                        help="how MoE tokens move under DP attention (default: %(default)s)")
    parser.add_argument("--dtype", choices=sorted(DTYPE_BYTES), default=None,
                        help="activation and weight dtype (default: the checkpoint's, else bfloat16)")
    parser.set_defaults(handler=run)


def load_model_config(model: str) -> ModelConfig:
    """The config of a preset, of the embedded model, or of a folder (no weights are touched)."""
    from tokenspeed.models.presets import load_preset, preset_name

    if model == "embedded":
        text = resources.files("tokenspeed.models.embedded").joinpath("config.json").read_text()
        return ModelConfig.from_dict(json.loads(text))
    preset = preset_name(model)
    if preset is not None and not Path(model).expanduser().exists():  # a folder of that name wins, as in the engine
        return load_preset(preset)
    try:
        return ModelConfig.from_pretrained(model)
    except FileNotFoundError:
        raise ModelNotFound(f"{model!r} is neither a preset, 'embedded', nor a folder with config.json") from None


def run(args: argparse.Namespace) -> int:
    config = load_model_config(args.model)
    parallel = ParallelConfig(
        tensor_parallel_size=args.tp,
        enable_expert_parallel=args.enable_expert_parallel or args.ep is not None,
        expert_parallel_size=args.ep,
        data_parallel_size=(args.dp or args.tp) if args.dp_attention else (args.dp or 1),
        enable_dp_attention=args.dp_attention,
        all2all_backend=args.all2all_backend,
    )
    topology = parallel.validate_for_model(config)
    fp8 = resolve_quantization(config.raw, None)  # a block-FP8 checkpoint's own (presets: *-fp8)
    check_fp8_sharding(config, fp8, topology)
    dtype = args.dtype or (config.dtype if config.dtype in DTYPE_BYTES else "bfloat16")
    plan = compile_plan(describe_model(config), topology, dtype_bytes=DTYPE_BYTES[dtype])
    print(
        f"{args.model}: {config.architecture}, {config.num_layers} layers, hidden {config.hidden_size}, "
        f"vocab {config.vocab_size}, {dtype}; {parallel.describe()}"
    )
    print(format_plan(plan))
    print()
    print(format_footprint(
        weights_per_rank(config, topology, DTYPE_BYTES[dtype], fp8),
        kv_bytes_per_token(config, topology, DTYPE_BYTES[dtype]),
        topology.dp_attention,
    ))
    return 0
