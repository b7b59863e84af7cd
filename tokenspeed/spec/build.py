"""Speculative decoding on an `Executor`: the verifier, and the device drafter `speculative_config` names.

`enable_speculation(executor, config)` is called by the engine core once the
executor is built (the drafter reads the target's weights, device, dtype and
KV layout): host methods (`ngram`, `suffix`) only need the verifier; `eagle`
loads an EAGLE-1/2 head (`spec/eagle.py`), `mtp` runs the target's own
multi-token-prediction layers (`spec/mtp.py`), `draft_model` loads a smaller
model of the same vocabulary (`spec/draft_model.py`). Each device drafter
keeps its K/V in paged storage of its own with the target's page count and
page size, addressed by the very page ids the scheduler hands out, so the
scheduler's accounting and rollbacks cover it with no extra bookkeeping.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from tokenspeed.errors import InvalidRequest
from tokenspeed.spec.speculator import DeviceDrafter, SpeculativeDecoder

if TYPE_CHECKING:
    from tokenspeed.executor.executor import Executor
    from tokenspeed.spec.config import SpeculativeConfig

logger = logging.getLogger("tokenspeed.spec")


def enable_speculation(executor: Executor, config: SpeculativeConfig, *, progress: bool = False) -> None:
    drafter = build_device_drafter(executor, config, progress=progress) if config.drafts_on_device else None
    executor.runner.speculation = SpeculativeDecoder(drafter)
    logger.info("speculative decoding: %s, up to %d drafts per row", config.method, config.num_speculative_tokens)


def build_device_drafter(executor: Executor, config: SpeculativeConfig, *, progress: bool = False) -> DeviceDrafter:
    raise InvalidRequest(f"speculative_config: method {config.method!r} is not available yet")
