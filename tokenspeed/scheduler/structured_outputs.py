"""`StructuredOutputsParams`: the grammar a request's output must follow (vLLM's names).

vLLM calls it `SamplingParams(structured_outputs=StructuredOutputsParams(...))`
(older releases: `guided_decoding=GuidedDecodingParams(...)`); both spellings
work here. Exactly one constraint is set:

| field | the output is |
|---|---|
| `json` | JSON valid against this JSON schema (a dict or its JSON text) |
| `json_object` | any JSON object |
| `regex` | a full match of this regular expression |
| `choice` | exactly one of these strings |
| `grammar` | a sentence of this EBNF grammar (GBNF-style, root rule `root`) |
| `structural_tag` | xgrammar's structural tag (JSON text): how forced tool calls are enforced |

This record is plain data, checked for shape here (no grammar library is
imported below the engine): whether a schema, regex or grammar actually
compiles is learnt when the engine compiles it, in a thread, and a failure
is an `InvalidRequest` for that request alone (HTTP 400).

`whitespace_pattern` is not offered: JSON is generated in one fixed layout
(`", "` and `": "`, no newlines), which is what keeps a constrained output
finite whatever the model's weights (free whitespace lets a weak model emit
blanks forever). `any_whitespace=True` restores free whitespace.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, fields
from typing import Any

from tokenspeed.errors import InvalidRequest

MAX_CHOICES = 1024  # `choice` entries; more is better served by a regex or a grammar
MAX_SPEC_CHARS = 1 << 20  # one MiB of schema / regex / grammar text


@dataclass(slots=True)
class StructuredOutputsParams:
    json: str | dict[str, Any] | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None
    structural_tag: str | None = None
    any_whitespace: bool = False

    def __post_init__(self) -> None:
        given = [name for name in _CONSTRAINTS if getattr(self, name) not in (None, False)]
        if len(given) != 1:
            raise InvalidRequest(
                "structured outputs take exactly one of json, regex, choice, grammar, json_object, "
                f"structural_tag; got {', '.join(given) if given else 'none'}."
            )
        if type(self.any_whitespace) is not bool:
            raise InvalidRequest("structured outputs: any_whitespace must be a boolean.")
        kind = given[0]
        value = getattr(self, kind)
        if kind == "json":
            if isinstance(value, str):
                _check_text("json", value)
                try:
                    value = json.loads(value)
                except ValueError as exc:
                    raise InvalidRequest(f"structured outputs: json is not valid JSON text: {exc}") from None
            if not isinstance(value, dict):
                raise InvalidRequest("structured outputs: json must be a JSON schema (an object).")
        elif kind == "choice":
            if not isinstance(value, list) or not value or len(value) > MAX_CHOICES:
                raise InvalidRequest(f"structured outputs: choice must be a list of 1 to {MAX_CHOICES} strings.")
            if any(not isinstance(c, str) for c in value):
                raise InvalidRequest("structured outputs: every choice must be a string.")
        elif kind == "json_object":
            if value is not True:
                raise InvalidRequest("structured outputs: json_object must be true.")
        else:
            _check_text(kind, value)

    @property
    def kind(self) -> str:
        """Which constraint is set: one of `json`, `regex`, `choice`, `grammar`, `json_object`, `structural_tag`."""
        return next(name for name in _CONSTRAINTS if getattr(self, name) not in (None, False))

    def schema(self) -> Any:
        """The JSON schema (decoded), for `kind == "json"`."""
        return json.loads(self.json) if isinstance(self.json, str) else self.json

    def cache_key(self) -> str:
        """One string per distinct grammar: compiled grammars are cached under it (equal schemas written
        with other key orders or spacing share one entry)."""
        kind = self.kind
        value: Any = self.schema() if kind == "json" else getattr(self, kind)
        return json.dumps([kind, value, self.any_whitespace], sort_keys=True, separators=(",", ":"))

    def to_dict(self) -> dict[str, Any]:
        """The set fields, as plain data (the wire between the front end and the engine core)."""
        out: dict[str, Any] = {self.kind: getattr(self, self.kind)}
        if self.any_whitespace:
            out["any_whitespace"] = True
        return out

    @classmethod
    def coerce(cls, value: object) -> StructuredOutputsParams:
        """`value` itself, or the params a dict of the same fields describes."""
        if isinstance(value, cls):
            return value
        if isinstance(value, dict):
            known = {f.name for f in fields(cls)}
            unknown = sorted(str(k) for k in value if k not in known)
            if unknown:
                raise InvalidRequest(f"structured outputs: unknown field(s) {', '.join(unknown)}.")
            return cls(**value)
        raise InvalidRequest(f"structured_outputs must be a StructuredOutputsParams or a dict, got {type(value).__name__}.")


# vLLM's older name for the same record.
GuidedDecodingParams = StructuredOutputsParams

_CONSTRAINTS = ("json", "regex", "choice", "grammar", "json_object", "structural_tag")


def _check_text(name: str, value: object) -> None:
    if not isinstance(value, str) or not value:
        raise InvalidRequest(f"structured outputs: {name} must be a non-empty string.")
    if len(value) > MAX_SPEC_CHARS:
        raise InvalidRequest(f"structured outputs: {name} is longer than {MAX_SPEC_CHARS} characters.")
