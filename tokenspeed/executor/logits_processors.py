"""What the sampler does to logits between penalties and the draw: logit bias and grammar masks.

Both run on the device, with no host synchronisation, so they fit steps that
overlap the host's work (`engine/core.py`):

* `logit_bias` (OpenAI: token id -> bias in [-100, 100]): one indexed
  accumulate of the step's (row, token, bias) triples, uploaded together;
* grammar masks (structured output): the engine core computes, per
  constrained sample, a bitmask of the tokens its grammar allows next
  (`ExecutionPlan.grammar_masks`); `DeviceGrammarMasks.of` uploads them and
  `apply_grammar_masks` runs the registry's `sampling.bitmask` kernel (Triton
  on GPUs, torch on the CPU), which writes -inf over every other token.

Masks come after the bias, so a bias can never bring back a token the grammar
forbids. The masks are addressed per *logits row*, not per request, so the
same two calls serve the speculative verifier: a verify row with k drafts has
k+1 logits rows, and its grammar entry for sample position i masks row
`first + i` (`GrammarMasks.positions` carries (plan row, position); the
caller says where each plan row's first logits row is).
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

import torch

from tokenspeed.kernels import platform_of, select_kernel
from tokenspeed.scheduler.plan import GrammarMasks
from tokenspeed.scheduler.sampling_params import SamplingParams


class _HasSampling(Protocol):
    @property
    def sampling(self) -> SamplingParams: ...


def upload(values: Sequence[object], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A host list as a device tensor, copied without blocking the host (pinned) on a GPU."""
    tensor = torch.tensor(values, dtype=dtype)
    if device.type == "cuda":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor


def apply_logit_bias(logits: torch.Tensor, specs: Sequence[_HasSampling]) -> None:
    """Add each row's `logit_bias` to its logits, in place (rows align with `specs`)."""
    rows: list[int] = []
    cols: list[int] = []
    values: list[float] = []
    for i, spec in enumerate(specs):
        for token, bias in (spec.sampling.logit_bias or {}).items():
            rows.append(i)
            cols.append(token)
            values.append(bias)
    if not rows:
        return
    index = upload([rows, cols], torch.int64, logits.device)
    logits.index_put_((index[0], index[1]), upload(values, logits.dtype, logits.device), accumulate=True)


@dataclass(slots=True)
class DeviceGrammarMasks:
    """One step's grammar masks on the device: `bitmask[i]` masks logits row `indices[i]`."""

    bitmask: torch.Tensor  # [n, words] int32
    indices: torch.Tensor  # [n] int64

    @classmethod
    def of(
        cls, masks: GrammarMasks, first_logits_row: Mapping[int, int], device: torch.device
    ) -> DeviceGrammarMasks | None:
        """Upload the entries of `masks` whose plan row is in `first_logits_row` (None if there are none);
        `first_logits_row[plan row]` is the logits row of that plan row's sample position 0 (position i
        is `first + i`, the verifier's layout). The sampler and the verifier each pass their own rows."""
        kept = [i for i, (row, _) in enumerate(masks.positions) if row in first_logits_row]
        if not kept:
            return None
        host = torch.frombuffer(bytearray(masks.bits), dtype=torch.int32).view(len(masks.positions), masks.num_words)
        if len(kept) < len(masks.positions):
            host = host[kept]
        bitmask = host.pin_memory().to(device, non_blocking=True) if device.type == "cuda" else host
        rows = [first_logits_row[masks.positions[i][0]] + masks.positions[i][1] for i in kept]
        return cls(bitmask, upload(rows, torch.int64, device))


BitmaskKernel = Callable[[torch.Tensor, torch.Tensor, torch.Tensor], None]
_kernels: dict[str, BitmaskKernel] = {}  # per platform, chosen once


def apply_grammar_masks(logits: torch.Tensor, masks: DeviceGrammarMasks) -> None:
    """-inf, in place, over every token the grammar of a masked row does not allow next."""
    platform = platform_of(logits.device)
    kernel = _kernels.get(platform)
    if kernel is None:
        kernel = _kernels[platform] = select_kernel("sampling", "bitmask", platform=platform).impl
    kernel(logits, masks.bitmask, masks.indices)
