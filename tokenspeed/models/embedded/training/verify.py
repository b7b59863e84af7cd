"""Check an exported folder against transformers: the same logits as the network that was trained."""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

logger = logging.getLogger("tokenspeed.models")


@torch.no_grad()
def transformers_logit_difference(folder: Path, net: nn.Module, windows: np.ndarray) -> float | None:
    """Max |logit difference| between `net` and transformers loading `folder`, in fp32 (None without transformers)."""
    try:
        import transformers
    except ImportError:
        logger.warning("transformers is not installed: the export was not checked against it")
        return None
    device = next(net.parameters()).device
    model = transformers.AutoModelForCausalLM.from_pretrained(
        folder, dtype=torch.float32, attn_implementation="eager"
    ).to(device).eval()  # type: ignore[arg-type]
    ids = torch.from_numpy(windows).to(device)
    ours = F.linear(net(ids), net.head_weight)  # type: ignore[operator, arg-type]
    theirs = model(ids).logits.float()
    return float((ours - theirs).abs().max())
