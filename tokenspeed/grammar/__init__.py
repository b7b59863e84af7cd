"""Structured output: grammars compiled off the step's path, matchers per request, masks per step.

`GrammarCompiler` (compiler.py) turns a request's `StructuredOutputsParams`
into an xgrammar `CompiledGrammar` in a worker thread, cached LRU by the
grammar's key; `RequestGrammars` (states.py) keeps each constrained
request's matcher, fills the allowed-token bitmasks of a step's plan and
advances (or, for rejected drafts, rolls back) the matchers with the tokens
the step produced. The engine core wires them in (`engine/core.py`).
"""

from __future__ import annotations

from tokenspeed.grammar.compiler import GrammarCompiler
from tokenspeed.grammar.states import RequestGrammars

__all__ = ["GrammarCompiler", "RequestGrammars"]
