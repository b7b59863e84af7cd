"""grammar/: compilation off the loop with an LRU cache, per-request matchers, masks per step and per
drafted position (the verifier's interface), exact length-bounded strings."""

from __future__ import annotations

import json
import threading

import jsonschema
import pytest
import torch
import xgrammar

from tokenspeed.engine.llm import load_tokenizer
from tokenspeed.errors import InvalidRequest
from tokenspeed.grammar import GrammarCompiler, RequestGrammars
from tokenspeed.grammar.compiler import choice_grammar
from tokenspeed.grammar.json_schema import exact_string_lengths
from tokenspeed.kernels.sampling.bitmask_reference import allowed_tokens
from tokenspeed.models.embedded.materialize import package_dir
from tokenspeed.scheduler.plan import ExecutionPlan, ExecutionResult, RowOutput, ScheduledRow
from tokenspeed.scheduler.sampling_params import SamplingParams

VOCAB = 4096
EOS = 2
SCHEMA = {"type": "object", "properties": {"kind": {"enum": ["a", "b"]}, "name": {"type": "string", "maxLength": 3}},
          "required": ["kind", "name"]}


@pytest.fixture(scope="module")
def tokenizer():
    return load_tokenizer(package_dir())


def _compiler(tokenizer, **options) -> GrammarCompiler:
    loads = []

    def load():
        loads.append(1)
        return tokenizer

    compiler = GrammarCompiler(load, VOCAB, **options)
    compiler.loads = loads  # type: ignore[attr-defined]
    return compiler


def test_cache_by_key_shared_compilation_lru_and_no_cached_failures(tokenizer):
    compiler = _compiler(tokenizer, cache_size=2)
    params = SamplingParams(structured_outputs={"json": SCHEMA})
    first = compiler.compile(params.structured_outputs)
    same = compiler.compile(SamplingParams(structured_outputs={"json": json.dumps(SCHEMA)}).structured_outputs)
    assert same is first  # one compilation, even while it is in flight
    assert isinstance(first.result(timeout=30), xgrammar.CompiledGrammar)
    assert (compiler.hits, compiler.misses) == (1, 1)
    compiler.compile(SamplingParams(structured_outputs={"regex": "[0-9]"}).structured_outputs).result(30)
    compiler.compile(SamplingParams(structured_outputs={"choice": ["x"]}).structured_outputs).result(30)
    assert compiler.compile(params.structured_outputs) is not first  # evicted: least recently used of 2
    bad = SamplingParams(structured_outputs={"regex": "("}).structured_outputs
    with pytest.raises(InvalidRequest, match="regex cannot be compiled: Regex parsing error"):
        compiler.compile(bad).result(30)
    retry = compiler.compile(bad)  # a failure is not cached
    with pytest.raises(InvalidRequest):
        retry.result(30)
    assert compiler.misses == 6 and len(compiler.loads) == 1  # the tokenizer is loaded once
    compiler.close()


def test_choice_grammar_escapes_quotes_and_backslashes(tokenizer):
    choices = ['say "hi"', "back\\slash", "new\nline", "ünï"]
    assert choice_grammar(choices).startswith("root ::= ")
    compiler = _compiler(tokenizer)
    compiled = compiler.compile(SamplingParams(structured_outputs={"choice": choices}).structured_outputs).result(30)
    for choice in choices:
        matcher = xgrammar.GrammarMatcher(compiled)
        assert matcher.accept_string(choice) and matcher.is_completed(), choice
    assert not xgrammar.GrammarMatcher(compiled).accept_string("say hi")
    compiler.close()


def test_length_bounded_strings_become_exact_patterns():
    schema = {"type": "object", "properties": {
        "a": {"type": "string", "maxLength": 4},
        "b": {"type": "array", "items": {"type": "string", "minLength": 1, "maxLength": 2}},
        "c": {"type": "string", "maxLength": 4, "pattern": "^x+$"},  # already exact: kept
        "d": {"type": "integer", "maximum": 3}}}
    out = exact_string_lengths(schema)
    assert out["properties"]["a"] == {"type": "string", "pattern": out["properties"]["a"]["pattern"]}
    assert out["properties"]["a"]["pattern"].endswith("{0,4}$")
    assert out["properties"]["b"]["items"]["pattern"].endswith("{1,2}$")
    assert out["properties"]["c"] == schema["properties"]["c"] and out["properties"]["d"] == schema["properties"]["d"]
    assert schema["properties"]["a"] == {"type": "string", "maxLength": 4}  # the caller's schema is not changed
    jsonschema.validate({"a": "abcd"}, out)


def _row(request_id: str, sample_index: int, drafts: list[int] | None = None) -> ScheduledRow:
    return ScheduledRow(request_id, [7], 10 + sample_index, 0, [], SamplingParams(), True, 0, sample_index,
                        num_draft_tokens=len(drafts or []), draft_token_ids=list(drafts or []))


def _allowed(bits: bytes, words: int, entry: int) -> set[int]:
    mask = torch.frombuffer(bytearray(bits), dtype=torch.int32).view(-1, words)[entry : entry + 1]
    return set(torch.nonzero(allowed_tokens(mask, VOCAB)[0]).flatten().tolist())


def test_masks_accept_and_drafted_positions(tokenizer):
    grammars = RequestGrammars(_compiler(tokenizer))
    params = SamplingParams(structured_outputs={"choice": ["abc", "abd"]}, eos_token_ids=(EOS,))
    grammars.add("r", params)
    ready: list[str] = []
    while not ready:
        grammars.wait(1.0)
        ready, failed = grammars.poll()
        assert not failed
    assert ready == ["r"] and grammars.num_compiling == 0
    a, b, c, d = (tokenizer.convert_tokens_to_ids(t) for t in "abcd")

    plan = ExecutionPlan(1, [_row("free", 0), _row("r", 0)])
    assert grammars.constrains(plan) and not grammars.constrains(ExecutionPlan(1, [_row("free", 0)]))
    masks = grammars.masks(plan)
    assert masks is not None and masks.positions == [(1, 0)]
    first = _allowed(masks.bits, masks.num_words, 0)
    assert a in first and b not in first and EOS not in first
    assert grammars.accept(plan, ExecutionResult(1, [RowOutput("free", [b]), RowOutput("r", [a])])) == []

    # A verify row drafting b, d: position 0 is now, 1 after b, 2 after b d; the matcher ends where it began.
    verify = ExecutionPlan(2, [_row("r", 1, [b, d])])
    masks = grammars.masks(verify)
    assert masks is not None and masks.positions == [(0, 0), (0, 1), (0, 2)]
    after_a, after_ab, after_abd = (_allowed(masks.bits, masks.num_words, i) for i in range(3))
    assert b in after_a and a not in after_a
    assert {c, d} <= after_ab and b not in after_ab
    assert after_abd == {EOS}
    again = grammars.masks(ExecutionPlan(3, [_row("r", 1)]))
    assert again is not None and _allowed(again.bits, again.num_words, 0) == after_a  # rolled back
    # The verifier accepted b and emitted c (rejecting d): the matcher takes b, c.
    assert grammars.accept(verify, ExecutionResult(2, [RowOutput("r", [b, c])])) == []
    last = grammars.masks(ExecutionPlan(4, [_row("r", 3)]))
    assert last is not None and _allowed(last.bits, last.num_words, 0) == {EOS}
    # A token the grammar refuses is reported (and the request forgotten), never silently accepted.
    violations = grammars.accept(ExecutionPlan(4, [_row("r", 3)]), ExecutionResult(4, [RowOutput("r", [a])]))
    assert [rid for rid, _ in violations] == ["r"] and "r" not in grammars


def test_failed_compilation_is_reported_by_poll(tokenizer):
    grammars = RequestGrammars(_compiler(tokenizer))
    grammars.add("bad", SamplingParams(structured_outputs={"grammar": "root ::= ("}))
    failed: list = []
    while not failed:
        grammars.wait(1.0)
        _, failed = grammars.poll()
    assert failed[0][0] == "bad" and isinstance(failed[0][1], InvalidRequest) and "bad" not in grammars


def test_compilation_runs_in_a_worker_thread(tokenizer):
    seen: list[str] = []
    compiler = GrammarCompiler(lambda: seen.append(threading.current_thread().name) or tokenizer, VOCAB)
    compiler.compile(SamplingParams(structured_outputs={"regex": "a+"}).structured_outputs).result(30)
    assert seen and seen[0].startswith("tokenspeed-grammar")
    compiler.close()


def test_the_cache_is_bounded_in_bytes_too(tokenizer):
    compiler = _compiler(tokenizer, cache_bytes=1)  # every grammar is over it: only the newest stays
    first = SamplingParams(structured_outputs={"regex": "[a-c]+"}).structured_outputs
    compiler.compile(first).result(30)
    compiler.compile(SamplingParams(structured_outputs={"regex": "[d-f]+"}).structured_outputs).result(30)
    compiler.compile(first).result(30)
    assert (compiler.hits, compiler.misses) == (0, 3)
    compiler.close()
