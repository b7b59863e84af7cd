"""The JSON every CPU micro-benchmark writes: {"command", "date", "load_average", "results"}.

The load average is part of the result on purpose: the CPU machines are shared,
and a figure taken under another job's load is not comparable to a quiet one.
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any


def write_result(path: Path, results: Any) -> None:
    """Write `results` with the command line that produced them (run from the repository root)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({
        "command": " ".join(["python", f"benchmarks/{Path(sys.argv[0]).name}", *sys.argv[1:]]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S+00:00", time.gmtime()),
        "load_average": list(os.getloadavg()),
        "results": results,
    }, indent=1) + "\n")  # fmt: skip
