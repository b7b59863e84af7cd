"""Train the embedded models and their draft heads; see tokenspeed/models/embedded/training/run.py.

    python3 scripts/train_embedded.py --out OUT            # the H200 run (<= --time-budget seconds)
    python3 scripts/train_embedded.py --out OUT --smoke    # seconds on a CPU
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))  # run from a checkout without installing

from tokenspeed.models.embedded.training.run import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main())
