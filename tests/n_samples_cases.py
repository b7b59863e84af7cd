"""Seeded `n > 1` generations on a fixed tiny checkpoint, and their recorded token ids.

`tests/data/n_samples.json` was recorded with `python -m tests.n_samples_cases --record`
on the code as it stood before `n > 1` became fan-out in the front end (the
scheduler forked one request into n streams then). `test_n_samples_fixture.py`
runs the same cases on today's code and compares token for token: a seeded
request must return the same n outputs however the engine serves it.

The cases cover a prompt with a partially filled last page and a page-aligned
one, device sampling (top-k/top-p) and host sampling (penalties), overlap on
and off, and the `AsyncEngine` path through the core process.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import tempfile
from pathlib import Path
from typing import Any

from tests.checkpoints import make_checkpoint
from tokenspeed import LLM, SamplingParams

FIXTURE = Path(__file__).parent / "data" / "n_samples.json"
PAGE_SIZE = 4
PROMPTS = [
    [17, 250, 33, 91, 8, 120, 64, 5, 301, 77],  # 10 tokens: the last page is partial
    [44, 12, 199, 3, 86, 150, 27, 310, 9, 61, 222, 140],  # 12 tokens: page-aligned
]
CASES: dict[str, dict[str, Any]] = {
    "n3_t1": dict(n=3, temperature=1.0, seed=7, max_tokens=8, ignore_eos=True),
    "n4_topk_topp": dict(n=4, temperature=0.8, top_k=50, top_p=0.9, seed=11, max_tokens=6, ignore_eos=True),
    "n3_penalties": dict(
        n=3, temperature=1.0, seed=5, presence_penalty=0.5, repetition_penalty=1.2, max_tokens=6, ignore_eos=True
    ),
}
ASYNC_CASE = "n3_t1"


def engine_kwargs() -> dict[str, Any]:
    return dict(skip_tokenizer_init=True, page_size=PAGE_SIZE, device="cpu", dtype="float32", seed=0)


def checkpoint(root: Path) -> Path:
    return make_checkpoint("llama", root / "llama", seed=0)


def run_llm(folder: Path, *, disable_overlap: bool) -> dict[str, list[list[list[int]]]]:
    """case -> prompt -> sample index -> token ids."""
    llm = LLM(str(folder), disable_overlap=disable_overlap, show_progress=False, **engine_kwargs())
    results = {}
    for name, params in CASES.items():
        outputs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], SamplingParams(**params))
        results[name] = [[list(c.token_ids) for c in out.outputs] for out in outputs]
    return results


def run_async(folder: Path) -> list[list[list[int]]]:
    """ASYNC_CASE through `AsyncEngine` (a core process): prompt -> sample index -> token ids."""
    from tokenspeed.config import EngineConfig
    from tokenspeed.engine.async_engine import AsyncEngine

    async def main() -> list[list[list[int]]]:
        engine = AsyncEngine(EngineConfig(model=str(folder), **engine_kwargs()))
        await engine.start()
        try:
            params = SamplingParams(**CASES[ASYNC_CASE])

            async def one(i: int, prompt: list[int]) -> list[list[int]]:
                tokens: dict[int, list[int]] = {}
                async for delta in engine.generate(f"req-{i}", prompt, params):
                    for piece in delta.deltas:
                        tokens.setdefault(piece.index, []).extend(piece.token_ids)
                return [tokens[k] for k in sorted(tokens)]

            return list(await asyncio.gather(*(one(i, p) for i, p in enumerate(PROMPTS))))
        finally:
            await engine.close()

    return asyncio.run(main())


def record() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        folder = checkpoint(Path(tmp))
        overlapped = run_llm(folder, disable_overlap=False)
        synchronous = run_llm(folder, disable_overlap=True)
        assert overlapped == synchronous, "overlap changed seeded outputs"
        through_core = run_async(folder)
        assert through_core == overlapped[ASYNC_CASE], "AsyncEngine disagrees with LLM"
    FIXTURE.parent.mkdir(parents=True, exist_ok=True)
    body = {"page_size": PAGE_SIZE, "prompts": PROMPTS, "cases": CASES, "outputs": overlapped}
    FIXTURE.write_text(json.dumps(body, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--record", action="store_true", help=f"(re)write {FIXTURE}")
    if parser.parse_args().record:
        record()
