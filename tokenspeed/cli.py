"""`tokenspeed`: serve | generate | chat | bench | eval-ppl | kernels | placement | env.

Every subcommand that builds an engine takes the same engine flags
(`engine_args.py`); with no `--model` it uses the embedded tiny model.
"""

from __future__ import annotations

import argparse
import json
import logging
import platform
import shlex
import sys

from tokenspeed.engine_args import add_engine_args, engine_config_from_args

_LOG_LEVELS = ("debug", "info", "warning", "error", "critical")


def _add_sampling_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("sampling")
    group.add_argument("--max-tokens", type=int, default=64, help="new tokens per completion (default: %(default)s)")
    group.add_argument("--temperature", type=float, default=0.0,
                       help="sampling temperature; 0 is greedy (default: %(default)s)")
    group.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass (default: %(default)s)")
    group.add_argument("--top-k", type=int, default=0, help="sample among the k likeliest; 0 is off (default: %(default)s)")
    group.add_argument("--sampling-seed", type=int, default=None,
                       help="per-request seed: the same seed gives the same tokens (default: random)")
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable; default: none)")


def _sampling_from_args(args: argparse.Namespace):  # type: ignore[no-untyped-def]
    from tokenspeed import SamplingParams

    return SamplingParams(
        max_tokens=args.max_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        top_k=args.top_k,
        seed=args.sampling_seed,
        stop=args.stop,
    )


def _random_weights_notice(args: argparse.Namespace) -> None:
    """Say so when the weights are random (untrained embedded model, dummy loading): the text means nothing.

    A preset's notice comes from the engine itself (`EngineCore`), for every front end."""
    from tokenspeed.models.embedded.materialize import has_trained_weights, is_embedded_model

    model = getattr(args, "model_positional", None) or args.model
    if args.load_format == "dummy":
        what = f"{model or 'the embedded model'} with --load-format dummy"
    elif is_embedded_model(model):
        if has_trained_weights(model or "embedded"):
            return
        what = f"the embedded model {model or 'embedded'!r} (no trained weights in this checkout)"
    else:
        return
    print(f"# {what}: random weights, its text is not meaningful", file=sys.stderr)


def _generate(args: argparse.Namespace) -> int:
    from tokenspeed import LLM

    _random_weights_notice(args)
    llm = LLM.from_config(engine_config_from_args(args))
    for output in llm.generate(args.prompt, _sampling_from_args(args)):
        for completion in output.outputs:
            if args.json:
                print(json.dumps({"prompt": output.prompt, "text": completion.text,
                                  "token_ids": completion.token_ids, "finish_reason": completion.finish_reason}))
            else:
                print(f"{output.prompt}{completion.text}")
    return 0


def _chat(args: argparse.Namespace) -> int:
    from tokenspeed import LLM

    _random_weights_notice(args)
    llm = LLM.from_config(engine_config_from_args(args))
    messages = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    messages.append({"role": "user", "content": args.message})
    output = llm.chat(messages, _sampling_from_args(args))[0]
    print(output.outputs[0].text)
    return 0


def _serve(args: argparse.Namespace) -> int:
    from tokenspeed.api.args import serve_config
    from tokenspeed.api.server import run_server

    _random_weights_notice(args)
    if args.grpc_port is None and args.gateway is None:
        return run_server(args, args.serve_parser)
    config, settings, listen = serve_config(args, args.serve_parser)
    if args.grpc_port is not None:  # one headless replica
        from tokenspeed.grpc.server import GrpcOptions, run_grpc_server

        options = GrpcOptions(listen.host, args.grpc_port, settings.model_name, listen.max_waiting_requests)
        return run_grpc_server(config, options)
    from tokenspeed.gateway.launcher import run_gateway

    return run_gateway(config, settings, listen, replicas=args.data_parallel_size, log_level=args.log_level)


def _env(args: argparse.Namespace) -> int:
    import torch
    import transformers

    import tokenspeed

    info = {
        "tokenspeed": tokenspeed.__version__,
        "python": platform.python_version(),
        "torch": torch.__version__,
        "transformers": transformers.__version__,
        "cuda_available": torch.cuda.is_available(),
        "devices": [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())],
    }
    print(json.dumps(info, indent=2))
    return 0


def _kernels(args: argparse.Namespace) -> int:
    from tokenspeed.kernels.selection_table import (
        DTYPES,
        default_dtype,
        default_platform,
        parse_assignments,
        selection_table,
    )

    platform_name = args.platform or default_platform()
    dtype = DTYPES[args.dtype] if args.dtype else default_dtype(platform_name)
    try:
        traits = parse_assignments(args.trait, as_range=False)
        workload = parse_assignments(args.workload, as_range=True)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    reports = selection_table(
        platform=platform_name, dtype=dtype, family=args.family, traits=traits, workload=workload
    )
    if not reports:
        print(f"error: no kernels registered for family {args.family!r}", file=sys.stderr)
        return 2
    print("\n\n".join(str(report) for report in reports))
    unserved = [f"{r.family}.{r.mode}" for r in reports if r.chosen is None]
    if unserved:
        print(f"error: no registered kernel serves {len(unserved)} op(s) on platform {platform_name!r}: "
              f"{', '.join(unserved)}", file=sys.stderr)
        return 1
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tokenspeed", description="LLM inference engine for agentic workloads")
    parser.add_argument("--log-level", default="warning", type=str.lower, choices=_LOG_LEVELS,
                        help="log level of tokenspeed and its libraries (default: %(default)s)")
    sub = parser.add_subparsers(dest="command", required=True)

    from tokenspeed.api.args import add_serve_args

    serve = sub.add_parser(
        "serve",
        help="OpenAI- and Anthropic-compatible HTTP server",
        description="Serve a model over HTTP: OpenAI /v1/completions, /v1/chat/completions, /v1/models; "
        "Anthropic /v1/messages; /tokenize, /detokenize, /health, /metrics.",
    )
    add_serve_args(serve)
    serve.set_defaults(handler=_serve, serve_parser=serve)

    generate = sub.add_parser("generate", help="generate completions for prompts")
    generate.add_argument("prompt", nargs="+", help="prompt text (several prompts run as one batch)")
    generate.add_argument("--json", action="store_true", help="one JSON object per completion")
    add_engine_args(generate)
    _add_sampling_args(generate)
    generate.set_defaults(handler=_generate)

    chat = sub.add_parser("chat", help="one chat turn through the model's chat template")
    chat.add_argument("message", help="the user's message")
    chat.add_argument("--system", default=None, help="a system message before it (default: none)")
    add_engine_args(chat)
    _add_sampling_args(chat)
    chat.set_defaults(handler=_chat)

    bench = sub.add_parser("bench", help="benchmarks")
    bench_sub = bench.add_subparsers(dest="bench_command", required=True)
    from tokenspeed.bench import offline
    from tokenspeed.bench import plot as bench_plot
    from tokenspeed.bench import serve as bench_serve

    offline.add_parser(bench_sub)
    bench_serve.add_parser(bench_sub)
    bench_plot.add_parser(bench_sub)

    from tokenspeed import eval_ppl

    eval_ppl.add_parser(sub)

    kernels = sub.add_parser(
        "kernels",
        help="which kernel the registry picks for every op on this machine, and why",
        description="Overrides (TOKENSPEED_KERNEL_<FAMILY>_<MODE>=name) are honoured, as in the engine.",
    )
    kernels.add_argument("--family", default=None, help="only this family (e.g. attention, moe, mla)")
    kernels.add_argument("--platform", default=None, help="cpu | cuda (default: this machine)")
    kernels.add_argument("--dtype", choices=["float32", "float16", "bfloat16"], default=None,
                         help="activation dtype (default: the platform's: float32 on cpu, bfloat16 on cuda)")
    kernels.add_argument("--trait", action="append", help="key=value, e.g. head_dim=128 (repeatable)")
    kernels.add_argument("--workload", action="append", help="key=n or key=lo-hi, e.g. num_tokens=1-8")
    kernels.set_defaults(handler=_kernels)

    from tokenspeed.models.parallel import report as placement_command

    placement_command.add_parser(sub)

    env = sub.add_parser("env", help="versions and devices")
    env.set_defaults(handler=_env)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    # What results files record as the command that made them: the arguments given, not the process's
    # (a program or test calling main([...]) is not the command line it runs under).
    args.command_line = shlex.join(["tokenspeed", *(sys.argv[1:] if argv is None else argv)])
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from tokenspeed.errors import TokenSpeedError

    try:
        return int(args.handler(args))
    except TokenSpeedError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
