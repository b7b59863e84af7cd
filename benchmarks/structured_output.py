"""Structured output's costs: grammar compilation, mask filling on the host, masking on the device, and
decode throughput with and without a grammar.

    python benchmarks/structured_output.py [--tokenizers embedded qwen3-8b] [--smoke] [--out PATH]

Sections of the result file (`{"command", "device", "date", "metrics"}`):
- `compile`: per tokenizer, a cold compilation of the acceptance test's JSON
  schema (nested objects, enums, arrays) and of a hermes tool-call grammar
  (two tools), in ms, and a cache hit of the same key in us
  (`GrammarCompiler`, the engine's path: worker thread, LRU);
- `fill`: per tokenizer, host time to fill one row's bitmask along a sampled
  schema-valid output (mean, p99 and max over the output's positions, us):
  what a constrained step adds before its launch;
- `apply`: device time of `sampling.bitmask` at [rows, vocab] for rows 1, 32,
  256, every kernel of the platform (reference, Triton), us (CUDA events on a
  GPU; wall time on the CPU);
- `decode`: the offline engine (`--model`, default the embedded model),
  `--batch` requests of `--tokens` tokens each, free vs constrained by a regex
  that admits the same length ([a-z ]{N}): output tokens/s and ms per step.
`--smoke` shrinks every section to run in seconds on a CPU.
"""

from __future__ import annotations

import argparse
import datetime
import json
import platform
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import xgrammar

from tokenspeed.api.tool_grammar import tool_call_grammar
from tokenspeed.engine.llm import load_tokenizer
from tokenspeed.grammar import GrammarCompiler
from tokenspeed.kernels.registry import list_kernels
from tokenspeed.models.embedded.materialize import package_dir
from tokenspeed.scheduler.structured_outputs import StructuredOutputsParams

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 12},
        "kind": {"enum": ["file", "dir", "link"]},
        "size": {"type": "integer", "minimum": 0, "maximum": 99999},
        "tags": {"type": "array", "items": {"type": "string", "maxLength": 8}, "maxItems": 4},
        "owner": {"type": "object", "properties": {"uid": {"type": "integer"}, "admin": {"type": "boolean"}},
                  "required": ["uid", "admin"]},
    },
    "required": ["name", "kind", "size", "tags", "owner"],
}
TOOLS = [
    {"type": "function", "function": {"name": "read_file", "parameters": {
        "type": "object", "properties": {"path": {"type": "string"}, "start": {"type": "integer"}},
        "required": ["path"]}}},
    {"type": "function", "function": {"name": "run", "parameters": {
        "type": "object", "properties": {"command": {"type": "string"}, "timeout": {"type": "integer"}},
        "required": ["command"]}}},
]


def _tokenizer(name: str) -> Any:
    if name == "embedded":
        return load_tokenizer(package_dir())
    from tokenspeed.models.presets import materialize_preset

    return load_tokenizer(materialize_preset(name))


def _vocab(tokenizer: Any) -> int:
    return (len(tokenizer) + 127) // 128 * 128


def compile_and_fill(name: str, smoke: bool) -> tuple[dict[str, Any], dict[str, Any]]:
    tokenizer = _tokenizer(name)
    vocab = _vocab(tokenizer)
    compiler = GrammarCompiler(lambda: tokenizer, vocab, [tokenizer.eos_token_id])
    compiler.compile(StructuredOutputsParams(regex="a")).result()  # builds the tokenizer info: not timed
    specs = {
        "json_schema": StructuredOutputsParams(json=SCHEMA),
        "hermes_tools": tool_call_grammar("hermes", TOOLS, None, parallel=True,
                                          token_markers=set(tokenizer.get_added_vocab())),
    }
    compiled: dict[str, xgrammar.CompiledGrammar] = {}
    timings: dict[str, Any] = {}
    for label, spec in specs.items():
        assert spec is not None
        start = time.perf_counter()
        compiled[label] = compiler.compile(spec).result()
        cold_ms = (time.perf_counter() - start) * 1e3
        start = time.perf_counter()
        compiler.compile(spec).result()
        timings[label] = {"cold_ms": round(cold_ms, 3), "cache_hit_us": round((time.perf_counter() - start) * 1e6, 1)}
    compiler.close()
    fills: dict[str, Any] = {}
    generator = torch.Generator().manual_seed(0)
    for label, grammar in compiled.items():
        samples: list[float] = []
        for _ in range(1 if smoke else 8):
            matcher = xgrammar.GrammarMatcher(grammar)
            bitmask = xgrammar.allocate_token_bitmask(1, vocab)
            for _ in range(400):
                start = time.perf_counter()
                matcher.fill_next_token_bitmask(bitmask, 0)
                samples.append((time.perf_counter() - start) * 1e6)
                bits = ((bitmask[0].unsqueeze(-1) >> torch.arange(32, dtype=torch.int32)) & 1).flatten()[:vocab]
                allowed = torch.nonzero(bits).flatten()
                token = int(allowed[torch.randint(len(allowed), (1,), generator=generator)])
                matcher.accept_token(token)
                if matcher.is_terminated():
                    break
        samples.sort()
        fills[label] = {"positions": len(samples), "mean_us": round(statistics.fmean(samples), 2),
                        "p99_us": round(samples[int(0.99 * (len(samples) - 1))], 2), "max_us": round(samples[-1], 2)}
    return {"vocab": vocab, **timings}, {"vocab": vocab, **fills}


def apply_kernels(vocab: int, device: torch.device, smoke: bool) -> dict[str, Any]:
    out: dict[str, Any] = {}
    platform_name = device.type
    kernels = [k for k in list_kernels("sampling") if k.mode == "bitmask" and platform_name in k.platforms]
    for rows in (1, 32) if smoke else (1, 32, 256):
        logits = torch.randn(rows, vocab, device=device)
        bitmask = torch.randint(-(2**31), 2**31 - 1, (rows, (vocab + 31) // 32), dtype=torch.int32, device=device)
        indices = torch.arange(rows, device=device)
        for kernel in kernels:
            repeats = 3 if smoke else 50
            kernel.impl(logits.clone(), bitmask, indices)  # warm up (Triton compiles here)
            work = [logits.clone() for _ in range(repeats)]
            if device.type == "cuda":
                torch.cuda.synchronize()
                begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                begin.record()
                for w in work:
                    kernel.impl(w, bitmask, indices)
                end.record()
                torch.cuda.synchronize()
                per_call = begin.elapsed_time(end) * 1e3 / repeats
            else:
                start = time.perf_counter()
                for w in work:
                    kernel.impl(w, bitmask, indices)
                per_call = (time.perf_counter() - start) * 1e6 / repeats
            out[f"{kernel.name}/rows{rows}"] = {"us": round(per_call, 2),
                                                "GBps": round(rows * vocab * 4 / per_call / 1e3, 1)}
    return out


def decode(model: str | None, batch: int, tokens: int) -> dict[str, Any]:
    from tokenspeed import LLM, SamplingParams

    llm = LLM(model, show_progress=False)
    prompts = [f"# file {i}\ndef handler(request):" for i in range(batch)]
    results: dict[str, Any] = {}
    cases = {"free": None, "regex": StructuredOutputsParams(regex=f"[a-z ]{{{tokens * 4}}}")}
    for label, spec in cases.items():
        params = SamplingParams(temperature=1.0, seed=0, max_tokens=tokens, ignore_eos=True, structured_outputs=spec)
        llm.generate(prompts[:2], params, use_tqdm=False)  # warm up (and compile the grammar)
        start = time.perf_counter()
        outs = llm.generate(prompts, params, use_tqdm=False)
        elapsed = time.perf_counter() - start
        generated = sum(len(o.outputs[0].token_ids) for o in outs)
        results[label] = {"output_tokens": generated, "tokens_per_s": round(generated / elapsed, 1),
                          "ms_per_step": round(elapsed * 1e3 / max(len(o.outputs[0].token_ids) for o in outs), 3)}
    results["constrained_over_free"] = round(results["free"]["tokens_per_s"] / results["regex"]["tokens_per_s"], 3)
    return results


def main(argv: list[str] | None = None) -> dict[str, Any]:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokenizers", nargs="+", default=["embedded", "qwen3-8b"])
    parser.add_argument("--model", default=None, help="decode section's model (default: the embedded model)")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--tokens", type=int, default=128)
    parser.add_argument("--smoke", action="store_true", help="tiny sizes, seconds on a CPU")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args(argv)
    if args.smoke:
        args.tokenizers, args.batch, args.tokens = ["embedded"], 4, 8
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    metrics: dict[str, Any] = {"compile": {}, "fill": {}, "apply": {}}
    for name in args.tokenizers:
        metrics["compile"][name], metrics["fill"][name] = compile_and_fill(name, args.smoke)
        metrics["apply"][name] = apply_kernels(metrics["fill"][name]["vocab"], device, args.smoke)
    metrics["decode"] = decode(args.model, args.batch, args.tokens)
    default = f"benchmarks/results/{'h200' if device.type == 'cuda' else 'cpu'}/structured_output.json"
    out = args.out or Path(default)
    doc = {"command": " ".join(["python", "benchmarks/structured_output.py", *(argv if argv is not None else sys.argv[1:])]),
           "device": torch.cuda.get_device_name() if device.type == "cuda" else platform.processor() or "cpu",
           "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"), "metrics": metrics}
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps(doc, indent=1) + "\n")
    print(json.dumps(doc, indent=1))
    return doc


if __name__ == "__main__":
    main()
