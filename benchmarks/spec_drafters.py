"""Host drafters on agent-like text: acceptance, accepted length, steps saved, host cost per step.

    python benchmarks/spec_drafters.py [--methods ngram suffix] [--k 8] [--out PATH]

Drafts only pay off if the model would have emitted them, so this replays
known outputs: each request's "model" emits a fixed token sequence (an agent's
typical output, below), and a replay executor verifies the scheduler's drafts
against it greedily (accept the longest matching prefix, then the true next
token), exactly as a greedy verifier would with a model that emits that text.
Everything else is the real control plane: `Scheduler` with
`speculative_config` (adaptive draft length, token budget, page rollback), the
real drafters, token ids from the embedded BPE tokenizer over Python
standard-library sources. Requests run one at a time (batch size 1, the
per-user latency case), in a fixed order, so the suffix drafter's corpus of
recent outputs and its session handover see what a server would.

Workloads (`WORKLOADS`):
- `edit`: a file in the prompt, reproduced with a change (a function renamed
  everywhere, a comment line added every 40 lines);
- `tool_json`: a tool call (JSON: path, old_str = 15 lines of a file in the
  context, new_str = the same lines with one changed);
- `session`: three turns of one agent session; each turn's prompt is the
  previous turn's prompt + output + a new instruction, each output re-emits
  the file with one more change;
- `novel`: an output that is nowhere in the context (another file): the
  drafters should mostly stay silent.

Per method and workload: `acceptance_rate` (accepted / drafted tokens),
`mean_accepted_length` (tokens emitted per verify step: accepted + 1),
`tokens_per_step` (output tokens / decode steps; 1.0 without speculation: the
upper bound of the bs1 decode speedup if a verify step cost a decode step),
`draft_tokens_per_step`, and host time: `drafter_us_per_step` (inside
`propose`) and `scheduler_us_per_step` (`next_plan` + `advance`, drafting
included). Results: `benchmarks/results/cpu/spec_drafters.json`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import re
import sys
import sysconfig
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from tokenizers import Tokenizer

from tokenspeed.scheduler import (
    ExecutionPlan,
    ExecutionResult,
    RowOutput,
    SamplingParams,
    Scheduler,
    SchedulerConfig,
)
from tokenspeed.spec import Drafter, parse_speculative_config

RESULTS = Path(__file__).parent / "results" / "cpu" / "spec_drafters.json"
TOKENIZER = Path(__file__).parents[1] / "tokenspeed" / "models" / "embedded" / "tokenizer.json"
SOURCES = ["textwrap.py", "shlex.py", "fnmatch.py", "bisect.py", "heapq.py", "glob.py", "json/encoder.py",
           "string.py", "colorsys.py", "keyword.py"]
SYSTEM = "You are a coding agent. Use the tools to read and edit files. Reply with code only.\n"


@dataclass
class Job:
    prompt: list[int]
    output: list[int]


def read(name: str) -> str:
    return (Path(sysconfig.get_paths()["stdlib"]) / name).read_text()


def edited(text: str, round_: int = 0) -> str:
    """The agent's change: rename the first function defined, add a comment every 40 lines."""
    names = re.findall(r"^def (\w+)", text, flags=re.M)
    if names:
        name = names[min(round_, len(names) - 1)]
        text = re.sub(rf"\b{name}\b", f"{name}_v{round_ + 2}", text)
    lines = text.splitlines(keepends=True)
    for i in range(len(lines) - 1, 0, -40):
        lines.insert(i, f"# reviewed ({round_})\n")
    return "".join(lines)


def workloads(tok: Tokenizer) -> dict[str, list[list[Job]]]:
    """Per workload, its sessions; a session's jobs run in order (a later turn extends the earlier one)."""

    def ids(text: str) -> list[int]:
        return list(tok.encode(text).ids)

    files = {name: read(name) for name in SOURCES}
    edit = [[Job(ids(f"{SYSTEM}File {name}:\n{text}\nRename the first function and mark reviewed lines. "
                     "Reply with the whole file.\n"), ids(edited(text)))] for name, text in list(files.items())[:6]]
    tool = []
    for name, text in list(files.items())[2:8]:
        lines = text.splitlines(keepends=True)
        old = "".join(lines[len(lines) // 2 : len(lines) // 2 + 15])
        new = old.replace("return", "return  # checked", 1)
        call = json.dumps({"name": "str_replace", "arguments": {"path": name, "old_str": old, "new_str": new}})
        context = "".join(f"File {n}:\n{t}\n" for n, t in list(files.items())[:3] if n != name)
        tool.append([Job(ids(f"{SYSTEM}{context}File {name}:\n{text}\nFix the return.\n"), ids(call))])
    session = []
    for name in SOURCES[:3]:
        text, jobs, prompt_text = files[name], [], f"{SYSTEM}File {name}:\n{files[name]}\n"
        for round_ in range(3):
            prompt_text += f"Round {round_}: rename the next function and mark reviewed lines.\n"
            text = edited(text, round_)
            jobs.append(Job(ids(prompt_text), ids(text)))
            prompt_text += text + "\n"
        session.append(jobs)
    novel = [[Job(ids(f"{SYSTEM}File {a}:\n{files[a]}\nWrite another module.\n"), ids(files[b]))]
             for a, b in zip(SOURCES[:4], SOURCES[6:10])]
    return {"edit": edit, "tool_json": tool, "session": session, "novel": novel}


class ReplayExecutor:
    """The "model" emits each request's known output; drafts are verified greedily against it."""

    def __init__(self) -> None:
        self.outputs: dict[str, list[int]] = {}

    def run(self, plan: ExecutionPlan) -> ExecutionResult:
        rows = []
        for row in plan.rows:
            out = RowOutput(row.request_id)
            if row.sample:
                known = self.outputs[row.request_id][row.sample_index :]
                drafts = row.draft_token_ids
                accepted = 0
                while accepted < len(drafts) and drafts[accepted] == known[accepted]:
                    accepted += 1
                out.sampled_token_ids = known[: accepted + 1]
            rows.append(out)
        return ExecutionResult(plan.step_id, rows)


class TimedDrafter:
    """Wraps a drafter to time its proposals."""

    def __init__(self, inner: Drafter) -> None:
        self.inner = inner
        self.seconds = 0.0

    @property
    def method(self) -> str:
        return self.inner.method

    def propose(self, request_id: str, prompt: Sequence[int], output: Sequence[int], max_tokens: int) -> list[int]:
        start = time.perf_counter()
        try:
            return self.inner.propose(request_id, prompt, output, max_tokens)
        finally:
            self.seconds += time.perf_counter() - start

    def release(self, request_id: str, prompt: Sequence[int], output: Sequence[int]) -> None:
        self.inner.release(request_id, prompt, output)


def measure(method: str, k: int, jobs: dict[str, list[list[Job]]]) -> dict[str, dict[str, float]]:
    options: dict[str, object] = {"method": method, "num_speculative_tokens": k}
    if method == "ngram":
        options.update(prompt_lookup_min=2, prompt_lookup_max=5)
    config = parse_speculative_config(options)
    assert config is not None
    drafter = config.make_drafter()
    assert drafter is not None
    timed = TimedDrafter(drafter)
    scheduler = Scheduler(SchedulerConfig(max_num_seqs=8, max_num_batched_tokens=8192, max_model_len=32768,
                                          page_size=16, num_pages=4096, speculation=config.draft_policy()), timed)
    executor = ReplayExecutor()
    results = {}
    for workload, sessions in jobs.items():
        stats = scheduler.speculation_stats
        assert stats is not None
        before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens)
        timed.seconds = 0.0
        steps, output_tokens, host = 0, 0, 0.0
        for s, session in enumerate(sessions):
            for t, job in enumerate(session):
                request_id = f"{workload}-{s}-{t}"
                executor.outputs[request_id] = job.output
                scheduler.submit(request_id, list(job.prompt),
                                 SamplingParams(temperature=0.0, max_tokens=len(job.output)))
                while scheduler.has_unfinished():
                    start = time.perf_counter()
                    plan = scheduler.next_plan()
                    host += time.perf_counter() - start
                    result = executor.run(plan)
                    start = time.perf_counter()
                    updates = scheduler.advance(plan, result)
                    host += time.perf_counter() - start
                    if plan.rows[0].sample:
                        steps += 1
                    output_tokens += sum(len(u.new_token_ids) for u in updates)
        drafts = stats.num_drafts - before[0]
        drafted = stats.num_draft_tokens - before[1]
        accepted = stats.num_accepted_tokens - before[2]
        results[workload] = {
            "output_tokens": output_tokens,
            "steps": steps,
            "tokens_per_step": round(output_tokens / steps, 3),
            "acceptance_rate": round(accepted / drafted, 3) if drafted else 0.0,
            "mean_accepted_length": round(1 + accepted / drafts, 3) if drafts else 0.0,
            "draft_tokens_per_step": round(drafted / steps, 3),
            "drafter_us_per_step": round(1e6 * timed.seconds / steps, 1),
            "scheduler_us_per_step": round(1e6 * host / steps, 1),
        }
        print(method, workload, results[workload], flush=True)
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--methods", nargs="+", default=["ngram", "suffix"])
    parser.add_argument("--k", type=int, default=8, help="num_speculative_tokens")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args(argv)
    jobs = workloads(Tokenizer.from_file(str(TOKENIZER)))
    metrics = {method: measure(method, args.k, jobs) for method in args.methods}
    sizes = {w: {"requests": sum(len(s) for s in sessions),
                 "prompt_tokens": sum(len(j.prompt) for s in sessions for j in s),
                 "output_tokens": sum(len(j.output) for s in sessions for j in s)} for w, sessions in jobs.items()}
    body = {
        "command": " ".join(["python", "benchmarks/spec_drafters.py", *(argv if argv is not None else sys.argv[1:])]),
        "device": f"CPU ({platform.processor() or platform.machine()}), Python {platform.python_version()}",
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "workloads": sizes,
        "metrics": metrics,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(body, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
