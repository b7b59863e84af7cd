"""Teacher-forced top-1 agreement of an FP8 KV cache with the model-dtype cache (shared by the CPU and GPU tests).

The reference decodes greedily with the model-dtype cache; the fp8 run is fed
the reference's tokens (teacher forcing) and its argmax is compared at every
step, so one flipped near-tie counts once instead of derailing every later
step. Rows of the batch are the prompts; every step is a decode step (the
decode kernel reading the cache), after one prefill (the extend kernel).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from tokenspeed.batch.kv_storage import PagedKVStorage
from tokenspeed.executor.batch_builder import RowSpec, build_forward_batch
from tokenspeed.executor.executor import load_model
from tokenspeed.models import ModelConfig

PAGE_SIZE = 16


def _decode(model: torch.nn.Module, config: ModelConfig, kv_dtype: torch.dtype, prompts: list[list[int]],
            forced: list[list[int]] | None, steps: int, device: torch.device) -> list[list[int]]:
    heads, k_dim, v_dim = config.kv_cache_layout
    pages_per_row = -(-(max(len(p) for p in prompts) + steps) // PAGE_SIZE)
    kv = PagedKVStorage(num_layers=config.num_layers, num_pages=pages_per_row * len(prompts), page_size=PAGE_SIZE,
                        num_kv_heads=heads, head_dim=k_dim, v_head_dim=v_dim, dtype=kv_dtype, device=device)
    pages = [list(range(i * pages_per_row, (i + 1) * pages_per_row)) for i in range(len(prompts))]
    lengths = [len(p) for p in prompts]
    rows = [RowSpec(p, 0, pg) for p, pg in zip(prompts, pages)]
    last = [sum(lengths[: i + 1]) - 1 for i in range(len(prompts))]
    chosen: list[list[int]] = [[] for _ in prompts]
    with torch.no_grad():
        for step in range(steps + 1):
            batch = build_forward_batch(rows, PAGE_SIZE, logits_indices=last, device=device)
            top = model.compute_logits(model(batch, kv).index_select(0, batch.logits_indices)).argmax(-1).tolist()
            if step == steps:
                break
            for i, token in enumerate(top):
                chosen[i].append(token)
            rows = [RowSpec([forced[i][step] if forced else top[i]], lengths[i] + step, pages[i])
                    for i in range(len(prompts))]
            last = list(range(len(prompts)))
    return chosen


KVScaleValues = tuple[tuple[float, ...], tuple[float, ...]]  # (k_scale, v_scale): one value, or one per KV head


def engine_kv_scales(llm: Any) -> list[KVScaleValues]:
    """The KV cache scales of every attention layer of `llm`'s model (rank 0's on several ranks)."""
    from tokenspeed.layers.kv_scales import KVScales

    executor = llm.core.executor
    model = getattr(executor, "local", executor).model
    return [(tuple(m.k_scale.tolist()), tuple(m.v_scale.tolist())) for m in model.modules() if isinstance(m, KVScales)]


def fp8_kv_agreement(folder: Path, prompts: list[list[int]], steps: int, *, dtype: torch.dtype = torch.float32,
                     device: str = "cpu", kv_scales: list[KVScaleValues] | None = None) -> float:
    """Fraction of `steps` greedy steps per prompt where the fp8 cache's argmax equals the reference's;
    `kv_scales`: (k_scale, v_scale) of each attention layer in model order, one value or one per KV head
    (None: the checkpoint's)."""
    from tokenspeed.layers.kv_scales import KVScales

    config = ModelConfig.from_pretrained(folder)
    where = torch.device(device)
    model = load_model(config, folder, load_format="auto", dtype=dtype, device=where)
    if kv_scales is not None:
        layers = [m for m in model.modules() if isinstance(m, KVScales)]
        for layer, (k_scale, v_scale) in zip(layers, kv_scales, strict=True):
            layer.load("k_scale", torch.tensor(k_scale))
            layer.load("v_scale", torch.tensor(v_scale))
    reference = _decode(model, config, dtype, prompts, None, steps, where)
    fp8 = _decode(model, config, torch.float8_e4m3fn, prompts, reference, steps, where)
    same = sum(a == b for ref, got in zip(reference, fp8) for a, b in zip(ref, got))
    return same / (steps * len(prompts))
