"""Train the embedded models and their draft heads; see tokenspeed/models/embedded/training/run.py.

    python3 scripts/train_embedded.py --out OUT            # the H200 run (<= --time-budget seconds)
    python3 scripts/train_embedded.py --out OUT --smoke    # seconds on a CPU
    python3 scripts/train_embedded.py --models eagle --out OUT --time-budget 240   # only the EAGLE head

`--models eagle` trains only the draft head, on the shipped (frozen, unchanged)
`embedded` weights, and writes under OUT/package/ the head's eagle/ files and
benchmarks/results/h200/train_embedded.json with the head's results merged into
the committed record. To commit them, from the repository root:

    cp -r OUT/package/. . && git status --short   # eagle/ files and the record only
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from tokenspeed.models.embedded.training.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
