"""Chat prompt tokenisation per agent turn, with and without the segment cache (`--tokenizer-cache-tokens`).

    python benchmarks/prompt_tokenize.py --out benchmarks/results/cpu/prompt_tokenize.json

Replays agent sessions of the agentic workload (`bench/agentic.py`: a shared
system prompt, a task, then tool outputs and replies, at its native 128K
window) through the server's `ChatRenderer` with the Qwen3-8B preset's
tokenizer and chat template, and times render + tokenise of every turn's
whole prompt, the work the server does before a request reaches the
scheduler. The same turns run without the cache and with it (a fresh cache
per run, sessions interleaved as concurrent agents would be), and every
prompt's ids must be equal both ways. CPU only: this is the API process's
work on any machine.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import random
import time
from pathlib import Path
from typing import Any

from tokenspeed.api.templating import ChatRenderer
from tokenspeed.bench import textgen
from tokenspeed.bench.agentic import agentic_plan
from tokenspeed.bench.conversation import Conversation, TextRatios, system_text
from tokenspeed.bench.metrics import percentile
from tokenspeed.models.presets import materialize_preset

PRESET = "qwen3-8b"


def sessions_turns(sessions: int, turns: int) -> list[list[list[dict[str, str]]]]:
    """Each session's message lists, turn by turn (replies synthesised at the planned lengths)."""
    plan = agentic_plan(sessions, seed=0, turns=turns)
    ratios = TextRatios()
    prefix = system_text(0, plan.prefix_tokens, ratios)
    out = []
    for session in plan.sessions:
        conversation = Conversation(plan, session, ratios, salt="tokenize", prefix_text=prefix)
        per_turn = []
        for turn in session.turns:
            per_turn.append(conversation.next_messages())
            rng = random.Random(f"reply:{session.session_id}:{conversation.turn_index}")
            conversation.add_reply(textgen.user_task(rng, ratios.chars("task", turn.output_tokens)))
        out.append(per_turn)
    return out


def run(tokenizer: Any, template: str | None, sessions: list[list[list[dict[str, str]]]],
        cache_tokens: int) -> tuple[list[float], list[list[int]], list[int]]:
    renderer = ChatRenderer(tokenizer, template, cache_tokens)
    times, ids, lengths = [], [], []
    for turn in range(max(len(s) for s in sessions)):  # interleaved, as concurrent agents
        for session in sessions:
            if turn < len(session):
                start = time.perf_counter()
                rendered = renderer.render(session[turn])
                times.append(time.perf_counter() - start)
                ids.append(rendered.token_ids)
                lengths.append(len(rendered.token_ids))
    return times, ids, lengths


def summary(times: list[float]) -> dict[str, float]:
    ms = [t * 1e3 for t in times]
    return {"mean_ms": round(sum(ms) / len(ms), 2), "p50_ms": round(percentile(ms, 50), 2),
            "p99_ms": round(percentile(ms, 99), 2), "total_s": round(sum(times), 2)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--sessions", type=int, default=4)
    parser.add_argument("--turns", type=int, default=30)
    args = parser.parse_args()
    from transformers import AutoTokenizer

    folder = materialize_preset(PRESET)
    tokenizer = AutoTokenizer.from_pretrained(folder)
    sessions = sessions_turns(args.sessions, args.turns)
    off, off_ids, lengths = run(tokenizer, None, sessions, 0)
    on, on_ids, _ = run(tokenizer, None, sessions, 8_000_000)
    if off_ids != on_ids:
        raise SystemExit("the cache changed a prompt's token ids")
    long = [i for i, n in enumerate(lengths) if n >= 50_000]
    result = {
        "command": "python benchmarks/prompt_tokenize.py " + " ".join(f"--{k} {v}" for k, v in
                                                                     (("sessions", args.sessions),
                                                                      ("turns", args.turns))),
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} cores",
        "tokenizer": PRESET, "prompts": len(lengths), "prompt_tokens_max": max(lengths),
        "prompt_tokens_mean": round(sum(lengths) / len(lengths)), "ids_identical": True,
        "cache_off": summary(off), "cache_on": summary(on),
        "prompts_50k_plus": len(long),
        "cache_off_50k_plus": summary([off[i] for i in long]) if long else None,
        "cache_on_50k_plus": summary([on[i] for i in long]) if long else None,
    }
    result["speedup_total"] = round(result["cache_off"]["total_s"] / result["cache_on"]["total_s"], 2)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
