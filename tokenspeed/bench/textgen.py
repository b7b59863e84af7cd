"""Deterministic code-like text for benchmark prompts.

Why not random token ids: a prompt of random tokens exercises neither the
tokenizer (byte-level BPE compresses code ~3-4 chars/token but random bytes ~1)
nor the chat template, and it cannot be sent through a text API to a peer
server.  Coding agents mostly send source files, grep hits, test logs and
diffs, so that is what we write, from templates filled by a seeded
`random.Random`.  The same seed always gives the same bytes, on every machine.

Lengths are in characters; the caller converts a token budget to characters
with a tokens-per-character ratio calibrated against the server
(`calibrate.py`), so the text itself never needs a tokenizer.
"""

from __future__ import annotations

import json
import random
from collections.abc import Callable, Iterator

_NOUNS = (
    "request", "session", "buffer", "page", "token", "cache", "config", "parser", "handler", "worker",
    "queue", "batch", "tensor", "layer", "block", "index", "record", "client", "stream", "result",
    "schema", "module", "router", "engine", "metric", "payload", "header", "offset", "window", "state",
)
_VERBS = (
    "load", "parse", "build", "flush", "merge", "split", "encode", "decode", "apply", "resolve",
    "fetch", "update", "render", "validate", "schedule", "allocate", "release", "compute", "emit", "reset",
)
_TYPES = ("int", "str", "bytes", "float", "bool", "list[int]", "dict[str, int]", "Path", "None")
_EXCEPTIONS = ("ValueError", "KeyError", "TypeError", "AssertionError", "RuntimeError", "IndexError")
_DIRS = ("src", "lib", "core", "utils", "io", "api", "models", "tests")
_PROSE = (
    "the", "function", "should", "return", "when", "input", "is", "empty", "and", "not", "raise",
    "an", "error", "because", "callers", "rely", "on", "this", "behaviour", "after", "refactor",
    "fix", "regression", "in", "edge", "case", "where", "value", "missing", "from", "file",
)


def _ident(rng: random.Random) -> str:
    return f"{rng.choice(_VERBS)}_{rng.choice(_NOUNS)}"


def _path(rng: random.Random) -> str:
    depth = rng.randint(1, 3)
    parts = [rng.choice(_DIRS) for _ in range(depth)]
    return "/".join(parts) + f"/{rng.choice(_NOUNS)}_{rng.choice(_NOUNS)}.py"


def _sentence(rng: random.Random, words: tuple[int, int] = (6, 16)) -> str:
    text = " ".join(rng.choice(_PROSE) for _ in range(rng.randint(*words)))
    return text[0].upper() + text[1:] + "."


def _source_lines(rng: random.Random) -> Iterator[str]:
    """An endless Python module: classes, functions, branches, comments."""
    while True:
        cls = rng.choice(_NOUNS).capitalize() + rng.choice(_NOUNS).capitalize()
        yield f"class {cls}:"
        yield f'    """{_sentence(rng)}"""'
        yield ""
        for _ in range(rng.randint(2, 5)):
            name, arg, attr = _ident(rng), rng.choice(_NOUNS), rng.choice(_NOUNS)
            yield f"    def {name}(self, {arg}: {rng.choice(_TYPES)}) -> {rng.choice(_TYPES)}:"
            if rng.random() < 0.4:
                yield f"        # {_sentence(rng, (4, 10))}"
            yield f"        if {arg} is None:"
            yield f'            raise {rng.choice(_EXCEPTIONS)}(f"missing {arg}: {{{arg}!r}}")'
            for _ in range(rng.randint(1, 4)):
                yield f"        {rng.choice(_NOUNS)} = self.{attr}.{_ident(rng)}({arg}, {rng.randint(0, 4096)})"
            yield f"        return self.{_ident(rng)}({arg})"
            yield ""


def _file_read(rng: random.Random) -> Iterator[str]:
    yield f"$ cat -n {_path(rng)}"
    for number, line in enumerate(_source_lines(rng), start=1):
        yield f"{number:6d}\t{line}"


def _grep(rng: random.Random) -> Iterator[str]:
    needle = _ident(rng)
    yield f"$ grep -rn '{needle}' ."
    while True:
        yield f"./{_path(rng)}:{rng.randint(1, 900)}:        {rng.choice(_NOUNS)} = {needle}(self.{rng.choice(_NOUNS)})"


def _test_log(rng: random.Random) -> Iterator[str]:
    yield "$ python -m pytest -x -q"
    while True:
        test = f"tests/test_{rng.choice(_NOUNS)}.py::test_{_ident(rng)}"
        if rng.random() < 0.8:
            yield f"PASSED {test}"
            continue
        yield f"FAILED {test} - {rng.choice(_EXCEPTIONS)}: {_sentence(rng, (3, 8))}"
        yield f"    def test_{_ident(rng)}():"
        yield f">       assert {_ident(rng)}({rng.randint(0, 99)}) == {rng.randint(0, 99)}"
        yield f"E       assert {rng.randint(0, 99)} == {rng.randint(0, 99)}"


def _diff(rng: random.Random) -> Iterator[str]:
    path = _path(rng)
    yield f"diff --git a/{path} b/{path}"
    yield f"--- a/{path}"
    yield f"+++ b/{path}"
    source = _source_lines(rng)
    while True:
        start = rng.randint(1, 800)
        yield f"@@ -{start},7 +{start},8 @@"
        for _ in range(rng.randint(3, 8)):
            yield rng.choice(("+", "-", " ", " ")) + next(source)


_TOOL_OUTPUTS: tuple[Callable[[random.Random], Iterator[str]], ...] = (_file_read, _grep, _test_log, _diff)


def _take(lines: Iterator[str], chars: int) -> str:
    """Join lines until `chars` characters, cut exactly there (so lengths are exact)."""
    parts: list[str] = []
    total = 0
    for line in lines:
        parts.append(line)
        total += len(line) + 1
        if total >= chars:
            break
    return "\n".join(parts)[: max(chars, 0)]


def tool_output(rng: random.Random, chars: int) -> str:
    """What a tool call returns: a file, grep hits, a test log or a diff."""
    return _take(rng.choice(_TOOL_OUTPUTS)(rng), chars)


def _tool_schema(rng: random.Random) -> dict[str, object]:
    params = {rng.choice(_NOUNS): {"type": "string", "description": _sentence(rng, (4, 9))} for _ in range(3)}
    return {
        "type": "function",
        "function": {
            "name": _ident(rng),
            "description": _sentence(rng, (8, 20)),
            "parameters": {"type": "object", "properties": params, "required": sorted(params)[:1]},
        },
    }


def _system_lines(rng: random.Random) -> Iterator[str]:
    yield "You are a coding agent working in a git repository. Use the tools to read, search, edit and test."
    yield ""
    yield "# Rules"
    for _ in range(12):
        yield f"- {_sentence(rng)}"
    yield ""
    yield "# Tools"
    while True:
        yield json.dumps(_tool_schema(rng), sort_keys=True)


def system_prompt(rng: random.Random, chars: int) -> str:
    """A coding agent's system prompt: rules, then tool schemas (the bulk of a real one)."""
    return _take(_system_lines(rng), chars)


def _task_lines(rng: random.Random) -> Iterator[str]:
    yield f"Issue: `{_ident(rng)}` fails in {_path(rng)}."
    while True:
        yield _sentence(rng)


def user_task(rng: random.Random, chars: int) -> str:
    """The first user message of a session: an issue to fix."""
    return _take(_task_lines(rng), chars)


def calibration_text(chars: int) -> str:
    """Fixed text for measuring a server's tokens per character (same mix as the workload)."""
    rng = random.Random(0x7E57)
    per_kind = max(chars // len(_TOOL_OUTPUTS), 1)
    text = "\n".join(_take(kind(rng), per_kind) for kind in _TOOL_OUTPUTS)
    return text[:chars]
