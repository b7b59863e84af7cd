"""Speculative decoding: drafters and the verification math.

Host drafters (`NgramDrafter`, `SuffixDrafter`) propose tokens from text the
request has seen; the scheduler owns them (`scheduler/speculation.py`) and
puts their drafts in the plan. Device drafters (`eagle.py`, `mtp.py`,
`draft_model.py`) run in the executor, behind its `Speculator` protocol,
which `speculator.py` implements (`build.py` makes one from the config). The
target model verifies every draft in one forward pass and `spec/verify.py`
decides what is emitted, exactly: greedy outputs are those of plain
decoding, sampled outputs have its distribution. `EXECUTOR_INTEGRATION.md`
maps the whole path.

This package's `__init__` imports no torch (the scheduler reads the drafter
protocol and the configuration); import `tokenspeed.spec.verify` for the math.
"""

from __future__ import annotations

from tokenspeed.scheduler.drafter import Drafter
from tokenspeed.spec.config import METHODS, SpeculativeConfig, parse_speculative_config
from tokenspeed.spec.ngram import NgramDrafter
from tokenspeed.spec.suffix import SuffixDrafter

__all__ = ["METHODS", "Drafter", "NgramDrafter", "SpeculativeConfig", "SuffixDrafter", "parse_speculative_config"]
