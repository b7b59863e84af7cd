"""`JsonStream`: JSON read as it is written, re-serialised canonically, in any chunks."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tokenspeed.api.canonical_json import canonical_json
from tokenspeed.api.parsers.json_stream import JsonStream

_SCALARS = st.none() | st.booleans() | st.integers(-(2**70), 2**70) | st.floats(allow_nan=False, allow_infinity=False) \
    | st.text(st.characters(codec="utf-8"), max_size=12)
VALUES = st.recursive(_SCALARS, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.text(max_size=6), inner, max_size=4), max_leaves=20)


def canonical_prefix(text: str) -> tuple[str, bool]:
    """`text` read as one JSON value: (what was emitted, complete?)."""
    out, reader = stream([text])
    return out, reader.done


def stream(chunks: list[str]) -> tuple[str, JsonStream]:
    reader = JsonStream()
    return "".join(reader.feed(c) for c in chunks) + reader.finish(), reader


@settings(max_examples=400, deadline=None)
@given(value=VALUES, indent=st.sampled_from([None, 0, 2]), ascii_only=st.booleans(),
       compact=st.booleans(), cuts=st.lists(st.integers(0, 300), max_size=10))
def test_any_formatting_in_any_chunks_comes_out_canonical(value, indent, ascii_only, compact, cuts):
    text = json.dumps(value, indent=indent, ensure_ascii=ascii_only, separators=(",", ":") if compact else None)
    bounds = sorted({min(c, len(text)) for c in cuts} | {0, len(text)})
    out, reader = stream([text[a:b] for a, b in zip(bounds, bounds[1:])])
    assert out == canonical_json(value) and reader.done and not reader.failed
    for cut in bounds:  # whatever was emitted so far is a prefix of the canonical text
        assert canonical_json(value).startswith(JsonStream().feed(text[:cut]))


def test_text_after_the_value_is_the_tail():
    reader = JsonStream()
    assert reader.feed('{"a" : 1}  trailing') == '{"a": 1}'
    assert reader.done and reader.tail == "  trailing"
    assert reader.feed(" more") == "" and reader.tail == "  trailing more"


def test_escapes_are_normalised():
    out, _ = canonical_prefix(r'{"s": "\u00e9\/\ud83d\ude00\n\u0007", "lone": "\ud800x"}')
    assert out == '{"s": "é/😀\\n\\u0007", "lone": "\\ud800x"}'
    assert out.encode("utf-8")  # a lone surrogate stays escaped: the text can be sent


@pytest.mark.parametrize(
    "text",
    ['{"a": NaN}', '{"a": 1,}', "[1 2]", '{"a" 1}', '{"a": "raw\ncontrol"}', '{"a": tru}', "{'a': 1}",
     '{"a": 01}', '{"a": 1.}', '{"a": "\\x"}', "]"],
)
def test_invalid_json_fails_at_the_first_bad_character(text):
    out, complete = canonical_prefix(text)
    assert not complete
    reader = JsonStream()
    reader.feed(text)
    assert reader.failed


def test_a_value_cut_off_is_incomplete_and_a_prefix():
    out, complete = canonical_prefix('{"path": "a.py", "content": "line 1\\nline')
    assert not complete and out == '{"path": "a.py", "content": "line 1\\nline'
