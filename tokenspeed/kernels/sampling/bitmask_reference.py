"""`sampling.bitmask` reference: keep only the tokens a grammar allows, on chosen rows of logits.

A grammar engine (xgrammar) describes the tokens allowed next as a bitmask,
32 tokens per int32 word: bit b of word w allows token `32 * w + b`. Rows
`indices[i]` of the logits keep their values where `bitmask[i]` allows the
token and become -inf elsewhere, in place; a token past the mask's last word
is not allowed. Several entries may name one logits row only if they agree
(the verifier names each drafted position's own row).
"""

from __future__ import annotations

import torch

from tokenspeed.kernels.registry import Band, register_kernel


def allowed_tokens(bitmask: torch.Tensor, vocab: int) -> torch.Tensor:
    """`[n, words]` int32 bitmask -> `[n, vocab]` bool (True: allowed)."""
    shifts = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    bits = ((bitmask.to(torch.int32).unsqueeze(-1) >> shifts) & 1).bool().flatten(1)
    if bits.shape[1] >= vocab:
        return bits[:, :vocab]
    return torch.nn.functional.pad(bits, (0, vocab - bits.shape[1]), value=False)


@register_kernel("sampling", "bitmask", name="reference", band=Band.REFERENCE, platforms=("cpu", "cuda"))
def apply_bitmask_reference(logits: torch.Tensor, bitmask: torch.Tensor, indices: torch.Tensor) -> None:
    """In place: logits rows `indices` `[n]` (int64) masked by `bitmask` `[n, words]` (int32)."""
    if not indices.numel():
        return
    rows = logits.index_select(0, indices)
    rows.masked_fill_(~allowed_tokens(bitmask, logits.shape[1]), float("-inf"))
    logits.index_copy_(0, indices, rows)
