"""What every request body shares: strict types, bounded integers, finite floats, valid text.

Everything a request carries ends up in the engine process (through msgpack,
as int64 tensors, in the tokenizer), so the schema refuses up front what
would break there, with a 400 that names the field:

* strict types: `"10"` is not an integer and `true` is not a token id, as in
  OpenAI's API (pydantic's lax mode would coerce both);
* every integer is bounded (counts to int32, seeds to int64): an integer
  past 2**64 cannot be packed and used to fail after the request was registered;
* floats must be finite: NaN compares false with every bound, so
  `temperature: NaN` used to pass validation and sample garbage;
* no lone UTF-16 surrogate (`"\\ud800"` is valid JSON but not encodable text),
  anywhere in the body, keys included: the tokenizer and the templates would
  raise on it deep inside a route.

Value ranges that depend on meaning (temperature, top_p, ...) stay in
`SamplingParams`, the one place that checks them for every front end.
Unknown fields are tolerated: clients send new OpenAI fields by default.
"""

from __future__ import annotations

import re
from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

INT32_MAX = 2**31 - 1
INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1

Count = Annotated[int, Field(ge=0, le=INT32_MAX)]  # lengths, numbers of tokens or samples
PositiveCount = Annotated[int, Field(ge=1, le=INT32_MAX)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]  # the vocabulary bound is checked at admission
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX)]  # -1 and 0 both mean "off"
Seed = Annotated[int, Field(ge=INT64_MIN, le=INT64_MAX)]

_SURROGATE = re.compile("[\ud800-\udfff]")  # json.loads joins valid pairs, so any left here is lone


class Body(BaseModel):
    """Any object inside a request body."""

    model_config = ConfigDict(extra="allow", strict=True, allow_inf_nan=False)


def _lone_surrogate_at(value: Any, path: str) -> str | None:
    if isinstance(value, str):
        return path if _SURROGATE.search(value) else None
    if isinstance(value, dict):
        for key, item in value.items():
            where = f"{path}.{key}" if path else str(key)
            if isinstance(key, str) and _SURROGATE.search(key):
                return where
            found = _lone_surrogate_at(item, where)
            if found is not None:
                return found
    elif isinstance(value, list):
        for position, item in enumerate(value):
            found = _lone_surrogate_at(item, f"{path}[{position}]")
            if found is not None:
                return found
    return None


class RequestBody(Body):
    """A whole request body: checked once for text that cannot be encoded, before any field."""

    @model_validator(mode="before")
    @classmethod
    def _no_lone_surrogates(cls, data: Any) -> Any:
        where = _lone_surrogate_at(data, "")
        if where is not None:
            where = where.encode("utf-8", "backslashreplace").decode()  # the path may hold the surrogate
            raise ValueError(f"{where or 'body'} contains a lone UTF-16 surrogate, which is not valid text")
        return data
