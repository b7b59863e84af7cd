"""Speculative decoding on the device: bs1 speedup per drafter, verify cost, verify kernels, TPM at the floor.

    python benchmarks/spec_decode.py --out benchmarks/results/h200/spec/spec_decode.json
    python benchmarks/spec_decode.py --smoke --out benchmarks/results/cpu/spec/spec_decode.json   # CPU, minutes

Sections (`--sections`, each rewrites the JSON so a timeout keeps what finished):

- `bs1`: one request at a time, greedy, on agent-edit prompts (a file in the
  context reproduced with a change, the reproduction begun; a tool call whose
  JSON arguments echo lines of the context; `benchmarks/spec_drafters.py`
  builds the texts from Python's standard library) with the embedded models:
  speculation off, then `suffix` / `ngram` / `eagle` (the trained head) on
  `embedded`, and `mtp` / `suffix` on `embedded-moe`, each in the same run.
  Per case: decode tokens/s (first token to last), speedup over off, whether
  the tokens equal off's, and the drafter's acceptance rate and mean accepted
  length. `suffix_bs1_speedup` is the edit workload's.
- `cost`: a verify step against a decode step on the Llama-3.1-8B preset
  (dummy weights; `--smoke`: the embedded model), batch sizes x draft lengths,
  through the engine with a drafter that always proposes k tokens (rejected:
  each step verifies k+1 positions and emits one). `draft_token_cost` =
  (t_verify - t_decode) / (k t_decode): the price `speculative_config`'s
  adaptive length should be told.
- `kernels`: which kernel serves verify attention and how fast: MLA decode at
  q_len 1..5 (16 heads, Moonlight / V2-Lite: the folded kernel, F from
  `choose_fold`, against fold=1) and GQA verify (Llama-3.1-8B heads) at q_len
  1..9 against the extend kernel, per call in a CUDA graph.
- `serve`: `tokenspeed bench serve --workload agentic` against `tokenspeed
  serve` (embedded) with and without `suffix`; TPM/GPU of the best point at
  or above the TPS/user floor (70), and their ratio `suffix_tpm_at_70_gain`.

Results: `{"command", "device", "date", "metrics"}`.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import torch
from spec_drafters import SOURCES, SYSTEM, edited, read
from tokenizers import Tokenizer

from tokenspeed import LLM, SamplingParams
from tokenspeed.bench.pareto import TPS_FLOOR
from tokenspeed.models.embedded.materialize import embedded_eagle_path, embedded_model_path

RESULTS: dict[str, Any] = {}
CUDA = torch.cuda.is_available()


def log(message: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {message}", flush=True)


def save(path: Path, command: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    device = torch.cuda.get_device_name(0) if CUDA else f"CPU ({platform.machine()}, {os.cpu_count()} cores)"
    doc = {"command": command, "device": device,
           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "metrics": RESULTS}
    path.write_text(json.dumps(doc, indent=2) + "\n")


# ---- bs1 ----------------------------------------------------------------------------------------


def agent_prompts(lines: int, count: int) -> dict[str, list[list[int]]]:
    """Token ids of the edit and tool-call prompts: the answer is under way, mostly copied from the context."""
    tok = Tokenizer.from_file(str(embedded_model_path() / "tokenizer.json"))
    files = {name: "".join(read(name).splitlines(keepends=True)[:lines]) for name in SOURCES}
    edit, tool = [], []
    for name, text in list(files.items())[:count]:
        new = edited(text)
        edit.append(f"{SYSTEM}File {name}:\n{text}\nRename the first function and mark reviewed lines.\n"
                    f"File {name}, edited:\n{new[: len(new) // 8]}")
        cut = text.splitlines(keepends=True)
        old = "".join(cut[len(cut) // 3 : len(cut) // 3 + 12])
        call = json.dumps({"name": "str_replace", "arguments": {"path": name, "old_str": old, "new_str": old}})
        tool.append(f"{SYSTEM}File {name}:\n{text}\nFix the return.\n{call[: len(call) // 3]}")
    return {"edit": [tok.encode(t).ids for t in edit], "tool_json": [tok.encode(t).ids for t in tool]}


def decode_run(llm: LLM, prompts: list[list[int]], max_tokens: int) -> tuple[list[list[int]], float, int]:
    """One request at a time: (outputs, decode seconds from first token to last, decode tokens)."""
    core = llm.core
    outputs, seconds, tokens = [], 0.0, 0
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True, detokenize=False)
    for i, prompt in enumerate(prompts):
        core.add_request(f"bs1-{i}", list(prompt), params)
        out: list[int] = []
        first = 0.0
        while core.has_unfinished():
            for update in core.step():
                if update.new_token_ids and not out:
                    first = time.perf_counter()
                out.extend(update.new_token_ids)
        seconds += time.perf_counter() - first
        tokens += len(out) - 1
        outputs.append(out)
    return outputs, seconds, tokens


def first_divergence(off_llm: LLM, prompts: list[list[int]], off: list[list[int]], spec: list[list[int]]
                     ) -> list[dict[str, Any]]:
    """Per prompt whose speculative tokens differ from off's: the first divergent position, both tokens, and
    the off model's top-2 logprob margin there (re-scored by one off step over the prompt and off's tokens
    before it). A margin near 0 is a bf16 near-tie (verify and decode round differently); a large margin
    is a bug. The margin equals the top-2 logit margin (log-softmax shifts both by the same amount)."""
    found = []
    params = SamplingParams(temperature=0.0, max_tokens=1, logprobs=2, detokenize=False)
    for i, (prompt, a, b) in enumerate(zip(prompts, off, spec)):
        if a == b:
            continue
        position = next((p for p, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        entry: dict[str, Any] = {"prompt": i, "position": position,
                                 "off_token": a[position] if position < len(a) else None,
                                 "spec_token": b[position] if position < len(b) else None}
        core = off_llm.core
        core.add_request(f"diverge-{i}", list(prompt) + a[:position], params)
        top: list[tuple[int, float]] = []
        while core.has_unfinished():
            for update in core.step():
                if update.new_logprobs:
                    top = update.new_logprobs[0].top
        if len(top) >= 2:
            entry["off_top2"] = [top[0][0], top[1][0]]
            entry["off_top2_logprob_margin"] = round(top[0][1] - top[1][1], 5)
        found.append(entry)
    return found


def bs1_section(smoke: bool, out: Path, command: str) -> None:
    prompts = agent_prompts(lines=12 if smoke else 90, count=1 if smoke else 4)
    max_tokens = 16 if smoke else 256
    k_suffix = 8 if smoke else 15
    cases: dict[str, list[tuple[str, dict[str, Any] | None]]] = {
        "embedded": [("off", None), ("suffix", {"method": "suffix", "num_speculative_tokens": k_suffix}),
                     ("ngram", {"method": "ngram", "num_speculative_tokens": 8, "prompt_lookup_min": 2,
                                "prompt_lookup_max": 5}),
                     ("eagle", {"method": "eagle", "model": str(embedded_eagle_path()), "num_speculative_tokens": 3})],
        "embedded-moe": [("off", None), ("mtp", {"method": "mtp", "num_speculative_tokens": 2}),
                         ("suffix", {"method": "suffix", "num_speculative_tokens": k_suffix})],
    }
    section: dict[str, Any] = RESULTS.setdefault("bs1", {})
    for model, runs in cases.items():
        base: dict[str, tuple[list[list[int]], float]] = {}
        off_llm: LLM | None = None  # kept to re-score divergent positions
        for name, spec in runs:
            llm = LLM(model, speculative_config=spec, max_model_len=4096, show_progress=False, max_num_seqs=8)
            drafter = getattr(getattr(llm.core.executor, "speculator", None), "drafter", None)
            graphs = getattr(drafter, "graphs", None)  # EAGLE/MTP: their own CUDA graphs (spec/draft_graphs.py)
            decode_run(llm, prompts["edit"][:1], 4)  # warm-up (Triton compiles, graphs)
            for workload, batch in prompts.items():
                stats = llm.core.speculation_stats
                before = (stats.num_drafts, stats.num_draft_tokens, stats.num_accepted_tokens) if stats else (0, 0, 0)
                outputs, seconds, tokens = decode_run(llm, batch, max_tokens)
                row: dict[str, Any] = {"decode_tokens_per_s": round(tokens / seconds, 2), "decode_tokens": tokens}
                if spec is None:
                    base[workload] = (outputs, row["decode_tokens_per_s"])
                else:
                    row["speedup"] = round(row["decode_tokens_per_s"] / base[workload][1], 3)
                    row["same_tokens_as_off"] = outputs == base[workload][0]
                    if not row["same_tokens_as_off"] and off_llm is not None:
                        row["divergence"] = first_divergence(off_llm, batch, base[workload][0], outputs)
                    assert stats is not None
                    drafts, drafted, accepted = (stats.num_drafts - before[0], stats.num_draft_tokens - before[1],
                                                 stats.num_accepted_tokens - before[2])
                    row["acceptance_rate"] = round(accepted / drafted, 3) if drafted else 0.0
                    row["mean_accepted_length"] = round(1 + accepted / drafts, 3) if drafts else 0.0
                    row["num_speculative_tokens"] = spec["num_speculative_tokens"]
                    if drafter is not None:
                        row["drafter_cuda_graphs"] = 0 if graphs is None else len(graphs._propose) + len(graphs._observe)
                section[f"{model}/{name}/{workload}"] = row
                log(f"bs1 {model} {name} {workload}: {row}")
            if spec is None:
                off_llm = llm
            del llm
            save(out, command)
        del off_llm
    for name, key in (("suffix", "embedded/suffix/edit"), ("eagle", "embedded/eagle/edit"),
                      ("mtp", "embedded-moe/mtp/edit")):
        RESULTS[f"{name}_bs1_speedup"] = section.get(key, {}).get("speedup")
    save(out, command)


# ---- cost of a verify step ---------------------------------------------------------------------------


class FixedDrafter:
    """Proposes k tokens no model emits, every step: each step verifies k+1 positions and keeps one."""

    method = "fixed"

    def __init__(self, token: int) -> None:
        self.token = token

    def propose(self, request_id: str, prompt: Any, output: Any, max_tokens: int) -> list[int]:
        return [self.token] * max_tokens

    def release(self, request_id: str, prompt: Any, output: Any) -> None:
        pass


def cost_section(smoke: bool, out: Path, command: str) -> None:
    model = "embedded" if smoke else "llama-3.1-8b"
    batch_sizes, draft_lengths = ([1, 4], [0, 1, 3]) if smoke else ([1, 8, 32], [0, 1, 3, 7])
    steps, context = (24, 64) if smoke else (64, 2048)
    section: dict[str, Any] = RESULTS.setdefault("cost", {"model": model, "context": context})
    for k in draft_lengths:
        spec = None if k == 0 else {"method": "ngram", "num_speculative_tokens": k, "adaptive_draft_length": False}
        llm = LLM(model, speculative_config=spec, max_model_len=context + steps + 64, show_progress=False,
                  max_num_seqs=max(batch_sizes), skip_tokenizer_init=True)
        core = llm.core
        if core.scheduler.speculation is not None:
            core.scheduler.speculation.drafter = FixedDrafter(token=7)
        for bs in batch_sizes:
            params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True, detokenize=False)
            for i in range(bs):
                core.add_request(f"c{k}-{bs}-{i}", [(i * 31 + j) % 1000 + 10 for j in range(context)], params)
            times = []
            while core.has_unfinished():
                start = time.perf_counter()
                updates = core.step()
                if CUDA:
                    torch.cuda.synchronize()
                if updates and all(len(u.new_token_ids) == 1 for u in updates) and len(updates) == bs:
                    times.append(time.perf_counter() - start)
            step_ms = statistics.median(times[2:] or times) * 1e3
            section[f"bs{bs}_k{k}_step_ms"] = round(step_ms, 3)
            if k:
                decode = section[f"bs{bs}_k0_step_ms"]
                section[f"bs{bs}_k{k}_draft_token_cost"] = round((step_ms - decode) / (k * decode), 4)
            log(f"cost {model} bs{bs} k{k}: {step_ms:.3f} ms/step")
        del llm, core
        save(out, command)


# ---- verify kernels ---------------------------------------------------------------------------------


def kernel_ms(fn: Any, reps: int = 20) -> float:
    """Median ms per call: CUDA-graph replays on a GPU, wall time on the CPU."""
    fn()
    if not CUDA:
        start = time.perf_counter()
        for _ in range(3):
            fn()
        return (time.perf_counter() - start) / 3 * 1e3
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    times = []
    for _ in range(reps):
        begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        begin.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(begin.elapsed_time(end))
    return statistics.median(times)


def kernels_section(smoke: bool, out: Path, command: str) -> None:
    from tokenspeed.kernels import select_kernel
    from tokenspeed.kernels.attention.decode_plan import choose_fold as gqa_fold
    from tokenspeed.kernels.mla.decode_plan import choose_fold as mla_fold

    device = torch.device("cuda" if CUDA else "cpu")
    dtype = torch.bfloat16 if CUDA else torch.float32
    platform_name = "cuda" if CUDA else "cpu"
    rows, context, page_size = (2, 64, 16) if smoke else (8, 4096, 16)
    pages = rows * context // page_size + 1
    table = torch.arange(1, pages, dtype=torch.int32, device=device).view(rows, -1)
    section: dict[str, Any] = RESULTS.setdefault("kernels", {"rows": rows, "context": context})
    mla = select_kernel("mla", "decode", platform=platform_name, dtype=dtype)
    heads, latent, rope = (4, 32, 16) if smoke else (16, 512, 64)
    cache = torch.randn(pages, page_size, 1, latent + rope, device=device, dtype=dtype)
    for q_len in range(1, 6):
        q = torch.randn(rows * q_len, heads, latent + rope, device=device, dtype=dtype)
        lens = torch.full((rows,), context, dtype=torch.int32, device=device)
        kwargs = dict(q_len=q_len, scale=0.1, kv_lora_rank=latent)
        entry = {"kernel": mla.name, "fold": mla_fold(heads, q_len),
                 "ms": round(kernel_ms(lambda: mla.impl(q, cache, table, lens, **kwargs)), 4)}  # noqa: B023
        if mla.name == "triton":
            entry["ms_fold1"] = round(kernel_ms(lambda: mla.impl(q, cache, table, lens, fold=1, **kwargs)), 4)  # noqa: B023
        section[f"mla_h{heads}_q{q_len}"] = entry
        log(f"kernels mla q{q_len}: {entry}")
    verify = select_kernel("attention", "verify", platform=platform_name, dtype=dtype)
    extend = select_kernel("attention", "extend", platform=platform_name, dtype=dtype)
    heads, kv_heads, dim = (4, 2, 16) if smoke else (32, 8, 128)
    k_cache = torch.randn(pages, page_size, kv_heads, dim, device=device, dtype=dtype)
    v_cache = torch.randn_like(k_cache)
    for q_len in (1, 2, 3, 4, 5, 9):
        q = torch.randn(rows * q_len, heads, dim, device=device, dtype=dtype)
        lens = torch.full((rows,), context, dtype=torch.int32, device=device)
        starts = torch.arange(0, (rows + 1) * q_len, q_len, dtype=torch.int32, device=device)
        entry = {"kernel": verify.name, "fold": gqa_fold(heads // kv_heads, q_len),
                 "ms": round(kernel_ms(lambda: verify.impl(q, k_cache, v_cache, table, lens, q_len=q_len,  # noqa: B023
                                                           scale=0.1)), 4),
                 "extend_kernel": extend.name,
                 "extend_ms": round(kernel_ms(lambda: extend.impl(q, k_cache, v_cache, starts, lens, table,  # noqa: B023
                                                                  scale=0.1, max_query_len=q_len)), 4)}  # noqa: B023
        section[f"gqa_h{heads}_kv{kv_heads}_q{q_len}"] = entry
        log(f"kernels gqa q{q_len}: {entry}")
    save(out, command)


# ---- TPM at the floor ---------------------------------------------------------------------------------


def serve_section(smoke: bool, out: Path, command: str) -> None:
    from tokenspeed.cli import main as cli

    concurrency = "1,2" if smoke else "1,2,4,8,16,32,64"
    sessions, turns = ("2", "2") if smoke else ("64", "4")
    section: dict[str, Any] = RESULTS.setdefault("serve", {"concurrency": concurrency})
    best: dict[str, float | None] = {}
    for name, spec in (("off", None), ("suffix", '{"method": "suffix", "num_speculative_tokens": 15}')):
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            port = probe.getsockname()[1]
        args = [sys.executable, "-m", "tokenspeed.cli", "serve", "--port", str(port), "--max-model-len", "4096",
                "--disable-access-log"] + (["--speculative-config", spec] if spec else [])
        with tempfile.NamedTemporaryFile("w", suffix=".log") as log_file, tempfile.TemporaryDirectory() as folder:
            server = subprocess.Popen(args, stdout=log_file, stderr=subprocess.STDOUT, env={**os.environ})
            try:
                _wait_ready(f"http://127.0.0.1:{port}", server, log_file.name)
                cli(["bench", "serve", "--base-url", f"http://127.0.0.1:{port}", "--output-dir", folder,
                     "--label", name, "--workload", "agentic", "--concurrency", concurrency, "--sessions", sessions,
                     "--turns", turns, "--max-context", "4096", "--time-scale", "0", "--no-progress"])
                rows = json.loads((Path(folder) / "results.json").read_text())["rows"]
            finally:
                server.terminate()
                server.wait(timeout=60)
        keep = ("concurrency", "tps_per_user", "total_tpm_per_gpu", "spec_acceptance_rate", "spec_mean_accepted_length")
        section[name] = [{k: r.get(k) for k in keep} for r in rows]
        floor = [r["total_tpm_per_gpu"] for r in rows if (r.get("tps_per_user") or 0) >= TPS_FLOOR]
        best[name] = max(floor) if floor else None
        section[f"{name}_tpm_at_{TPS_FLOOR:g}"] = best[name]
        log(f"serve {name}: best TPM/GPU at >= {TPS_FLOOR} TPS/user: {best[name]}")
        save(out, command)
    off, on = best.get("off"), best.get("suffix")
    RESULTS["suffix_tpm_at_70_gain"] = round(on / off, 3) if off and on else None
    save(out, command)


def _wait_ready(url: str, server: subprocess.Popen[bytes], log_path: str) -> None:
    import httpx

    deadline = time.monotonic() + 600
    while time.monotonic() < deadline:
        if server.poll() is not None:
            raise RuntimeError(f"server exited: {Path(log_path).read_text()[-2000:]}")
        try:
            if httpx.get(url + "/health", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.5)
    raise RuntimeError("server did not start")


SECTIONS = {"bs1": bs1_section, "cost": cost_section, "kernels": kernels_section, "serve": serve_section}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes (CPU): every section in minutes")
    parser.add_argument("--sections", default=",".join(SECTIONS), help="comma-separated: " + ",".join(SECTIONS))
    args = parser.parse_args(argv)
    command = " ".join(["python", "benchmarks/spec_decode.py", *(argv if argv is not None else sys.argv[1:])])
    if args.out.is_file():  # sections run separately accumulate in one file
        RESULTS.update(json.loads(args.out.read_text()).get("metrics", {}))
    for name in args.sections.split(","):
        log(f"section {name}")
        RESULTS.setdefault("section_commands", {})[name] = command  # sections run separately keep their own
        SECTIONS[name](args.smoke, args.out, command)
    return 0


if __name__ == "__main__":
    sys.exit(main())
