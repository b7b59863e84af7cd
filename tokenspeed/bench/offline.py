"""`tokenspeed bench offline`: throughput of the offline engine on random prompts.

Prompts are random token ids (special tokens excluded) and generation ignores
EOS, so every run does exactly `num_prompts x (input_len + output_len)` tokens
of work and runs are comparable. Prints one JSON line on stdout (with
speculative decoding: the drafts, accepted tokens, acceptance rate and mean
accepted length of the timed run); the progress bar of the timed run goes to
stderr (`--disable-tqdm` turns it off).
"""

from __future__ import annotations

import argparse
import json
import random
import time

from tokenspeed.engine_args import add_engine_args, engine_config_from_args


def add_parser(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    parser = subparsers.add_parser("offline", help="offline throughput on random prompts")
    add_engine_args(parser)
    parser.add_argument("--num-prompts", type=int, default=64, help="random prompts in the batch (default: %(default)s)")
    parser.add_argument("--input-len", type=int, default=256, help="tokens per prompt (default: %(default)s)")
    parser.add_argument("--output-len", type=int, default=64, help="tokens generated per prompt (default: %(default)s)")
    parser.add_argument("--disable-tqdm", action="store_true", help="no progress bar (on stderr) for the timed run")
    parser.set_defaults(handler=run)


def run(args: argparse.Namespace) -> int:
    from tokenspeed import LLM, SamplingParams

    llm = LLM.from_config(engine_config_from_args(args), show_progress=not args.disable_tqdm)
    rng = random.Random(args.seed)
    special = set(getattr(llm.tokenizer, "all_special_ids", []) or [])
    vocab = [t for t in range(llm.core.limits.vocab_size) if t not in special]
    prompts = [{"prompt_token_ids": rng.choices(vocab, k=args.input_len)} for _ in range(args.num_prompts)]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True, detokenize=False)

    llm.generate(prompts[:1], SamplingParams(max_tokens=2, ignore_eos=True), use_tqdm=False)  # warm-up
    before = _speculation(llm)
    start = time.perf_counter()
    outputs = llm.generate(prompts, params)
    elapsed = time.perf_counter() - start

    input_tokens = sum(len(o.prompt_token_ids) for o in outputs)
    output_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
    result = {
        "command": args.command_line,
        "model": args.model or "embedded",
        "device": llm.core.limits.device,
        "num_prompts": args.num_prompts,
        "input_len": args.input_len,
        "output_len": args.output_len,
        "elapsed_s": round(elapsed, 4),
        "requests_per_s": round(len(outputs) / elapsed, 4),
        "input_tokens_per_s": round(input_tokens / elapsed, 2),
        "output_tokens_per_s": round(output_tokens / elapsed, 2),
        "total_tokens_per_s": round((input_tokens + output_tokens) / elapsed, 2),
    }
    after = _speculation(llm)
    if after is not None and before is not None:
        drafts, drafted, accepted = (after[k] - before[k] for k in ("num_drafts", "num_draft_tokens",
                                                                     "num_accepted_tokens"))
        result.update({
            "spec_method": llm.core.speculative_config.method if llm.core.speculative_config else None,
            "spec_num_drafts": drafts,
            "spec_num_draft_tokens": drafted,
            "spec_num_accepted_tokens": accepted,
            "spec_acceptance_rate": round(accepted / drafted, 4) if drafted else 0.0,
            "spec_mean_accepted_length": round(1 + accepted / drafts, 4) if drafts else 0.0,
        })
    print(json.dumps(result))
    return 0


def _speculation(llm: object) -> dict[str, int] | None:
    """The engine's draft counters so far (None without speculative decoding)."""
    stats = llm.core.speculation_stats  # type: ignore[attr-defined]
    if stats is None:
        return None
    return {"num_drafts": stats.num_drafts, "num_draft_tokens": stats.num_draft_tokens,
            "num_accepted_tokens": stats.num_accepted_tokens}
