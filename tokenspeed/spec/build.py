"""Speculative decoding on an `Executor`: the verifier, and the device drafter `speculative_config` names.

`speculator_factory(config)` is what the engine core hands the executor: it
is called once the target is loaded (a drafter reads the target's weights,
device, dtype and KV layout) and before the KV pool is sized (a drafter's
own weights take memory first, and its K/V shares every page). Host methods
(`ngram`, `suffix`) only need the verifier; `eagle` loads an EAGLE-1/2 head
(`spec/eagle.py`), `mtp` drafts with the target's own multi-token-prediction
layers (`spec/mtp.py`), `draft_model` loads a smaller model of the same
vocabulary (`spec/draft_model.py`). Each device drafter keeps its K/V in
paged storage of its own, pages as many and as large as the target's,
addressed by the very page ids the scheduler hands out, so the scheduler's
accounting and rollbacks cover it with no bookkeeping of its own.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING

from tokenspeed.errors import InvalidRequest
from tokenspeed.spec.speculator import DeviceDrafter, SpeculativeDecoder

if TYPE_CHECKING:
    from tokenspeed.executor.executor import Executor
    from tokenspeed.spec.config import SpeculativeConfig

logger = logging.getLogger("tokenspeed.spec")


_UNSUPPORTED = {
    "eagle3": "EAGLE-3 heads read the target's intermediate hidden states, which the models do not expose yet; "
              "use 'eagle' with an EAGLE-1/2 head",
}


def speculator_factory(config: SpeculativeConfig, *, progress: bool = False) -> Callable[[Executor], SpeculativeDecoder]:
    """The executor's speculator builder; a method this engine cannot run is refused now, before any model loads."""
    if config.method in _UNSUPPORTED:
        raise InvalidRequest(f"speculative_config: method {config.method!r} is not supported: "
                             f"{_UNSUPPORTED[config.method]}")

    def build(executor: Executor) -> SpeculativeDecoder:
        drafter = build_device_drafter(executor, config, progress=progress) if config.drafts_on_device else None
        logger.info("speculative decoding: %s, up to %d drafts per row", config.method,
                    config.num_speculative_tokens)
        return SpeculativeDecoder(config.num_speculative_tokens, drafter, draft_cuda_graphs=config.draft_cuda_graphs,
                                  fast_greedy_verify=config.fast_greedy_verify)

    return build


def build_device_drafter(executor: Executor, config: SpeculativeConfig, *, progress: bool = False) -> DeviceDrafter:
    method = config.method
    if method == "mtp":
        from tokenspeed.spec.mtp import MTPDrafter

        return MTPDrafter(executor)
    if method == "eagle":
        from tokenspeed.spec.eagle import EagleDrafter

        assert config.model is not None
        return EagleDrafter(executor, config.model)
    if method == "draft_model":
        from tokenspeed.spec.draft_model import DraftModelDrafter

        assert config.model is not None
        return DraftModelDrafter(executor, config.model, progress=progress)
    raise InvalidRequest(f"speculative_config: method {method!r} has no device drafter")
