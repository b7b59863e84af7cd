"""One serialisation of tool-call arguments, shared by our answers and our rendering of history.

Agents send our tool calls back on the next turn. We render them into the
prompt as JSON objects, which chat templates print with `tojson`
(`json.dumps`, `", "`/`": "` separators, UTF-8 kept, keys in their order);
we answer with the same serialisation. So the arguments we return, the bytes
we render next turn and the bytes a Hermes/Qwen model writes agree, however
the client re-formats the string in between, and turn k's prompt stays an
exact prefix of turn k+1's. Key order is preserved, not sorted: models are
sensitive to the argument order they chose.
"""

from __future__ import annotations

import json
from typing import Any


def canonical_json(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)


def arguments_for_template(arguments: str | dict[str, Any] | None) -> dict[str, Any] | str:
    """Arguments as a JSON object for the template; a string that is not an object stays verbatim."""
    if arguments is None:
        return {}
    if isinstance(arguments, dict):
        return arguments
    try:
        value = json.loads(arguments)
    except ValueError:
        return arguments
    return value if isinstance(value, dict) else arguments
