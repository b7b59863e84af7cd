"""Fold a py-spy raw profile (`stack;frames count` lines) into the share of samples under each frame.

usage: fold_profile.py PROFILE.raw [TOP]; prints the TOP (default 60) frames by inclusive share, then
the top frames by self share. Idle threads (tqdm's monitor) are left out.
"""

from __future__ import annotations

import collections
import sys
from pathlib import Path


def main(path: str, top: int) -> None:
    total = 0
    inclusive: collections.Counter[str] = collections.Counter()
    own: collections.Counter[str] = collections.Counter()
    for line in Path(path).read_text().splitlines():
        stack, _, count = line.rstrip().rpartition(" ")
        if not stack or "TMonitor" in stack:
            continue
        n = int(count)
        frames = stack.split(";")
        total += n
        own[frames[-1]] += n
        for frame in set(frames):
            inclusive[frame] += n
    print(f"{total} samples (py-spy, 200 Hz, engine core process)\n\ninclusive:")
    for frame, n in inclusive.most_common(top):
        print(f"{100 * n / total:5.1f}%  {frame}")
    print("\nself:")
    for frame, n in own.most_common(top // 2):
        print(f"{100 * n / total:5.1f}%  {frame}")


if __name__ == "__main__":
    main(sys.argv[1], int(sys.argv[2]) if len(sys.argv) > 2 else 60)
