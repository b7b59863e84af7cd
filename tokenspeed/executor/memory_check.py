"""Refuse to build an engine that cannot fit, before a byte of it is allocated.

An 8B model in fp32 on a 23 GB machine does not fail politely: the kernel's
OOM killer ends the process with a bare `Killed` after minutes of loading.
So the `Executor` first estimates what it will hold (the weights, counted
from the config's checkpoint inventory at the engine's dtype, plus the
smallest KV pool it would accept) and compares that with the memory free on
the device:

- GPU: `torch.cuda.mem_get_info` plus what PyTorch's allocator holds cached
  but unused (an engine shut down earlier in the process leaves it there);
  when `gpu_memory_utilization` sizes the KV pool, less the share it keeps
  back (the same arithmetic that sizes the pool). An explicit pool size
  (`num_kv_pages`, `kv_cache_memory_bytes`) is checked against all of it;
- CPU: the kernel's `MemAvailable`, capped by the cgroup's limit when the
  process runs in a container (usage minus reclaimable page cache, as
  container runtimes count it). Where neither can be read (not Linux), the
  check is skipped.

The estimate leaves out activations, the CUDA context and the rope tables
(a few percent), so it refuses only what certainly cannot fit.
`TOKENSPEED_SKIP_MEMORY_CHECK=1` turns it off, for a probe that reads wrong.
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

from tokenspeed.errors import NotEnoughMemory
from tokenspeed.models import ModelConfig
from tokenspeed.models.parallel.weight_inventory import checkpoint_tensors
from tokenspeed.models.quant_config import Fp8Config

_NO_LIMIT = 1 << 60  # cgroup v1 writes "no limit" as a huge number


def weight_bytes(model_config: ModelConfig, dtype: torch.dtype, *, fp8: Fp8Config | None = None) -> int:
    """Bytes of the model's weights at `dtype` (MTP layers included, a tied LM head counted once).

    A serialized FP8 checkpoint's projection weights count one byte each (their block scales are
    1/4096 of that and left out); online quantisation loads every weight at `dtype` first, so its
    peak is the unquantised model's.
    """
    element = torch.empty((), dtype=dtype).element_size()
    total = 0
    for t in checkpoint_tensors(model_config):
        total += t.numel * (1 if fp8 is not None and fp8.keeps_fp8(t.name) else element)
    return total


def free_memory_bytes(device: torch.device) -> int | None:
    """Bytes free for this process on `device` right now; None where it cannot be known."""
    if device.type == "cuda":
        cached = torch.cuda.memory_reserved(device) - torch.cuda.memory_allocated(device)
        return int(torch.cuda.mem_get_info(device)[0]) + cached
    if device.type != "cpu":
        return None
    free = _meminfo_available()
    limited = _cgroup_headroom()
    if free is None or limited is None:
        return free if limited is None else limited
    return min(free, limited)


def _meminfo_available() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def _cgroup_headroom() -> int | None:
    """Limit minus non-reclaimable usage of this process's memory cgroup (v2, else v1); None: no limit."""
    layouts = (
        ("/sys/fs/cgroup/memory.max", "/sys/fs/cgroup/memory.current", "inactive_file"),
        ("/sys/fs/cgroup/memory/memory.limit_in_bytes", "/sys/fs/cgroup/memory/memory.usage_in_bytes",
         "total_inactive_file"),
    )
    for limit_file, usage_file, reclaimable_key in layouts:
        try:
            limit_text = Path(limit_file).read_text().strip()
            usage = int(Path(usage_file).read_text())
            stat = Path(limit_file).with_name("memory.stat").read_text().split("\n")
        except (OSError, ValueError):
            continue
        if limit_text == "max" or int(limit_text) >= _NO_LIMIT:
            return None
        reclaimable = next((int(line.split()[1]) for line in stat if line.startswith(reclaimable_key + " ")), 0)
        return max(0, int(limit_text) - usage + reclaimable)
    return None


def _gb(n: float) -> str:
    return f"{n / 1e9:.1f} GB"


def check_fits(
    *, weights: int, kv_cache: int, kv_what: str, device: torch.device, dtype: torch.dtype,
    gpu_memory_utilization: float | None,
) -> None:
    """Raise `NotEnoughMemory` when `weights + kv_cache` bytes exceed what `device` has free.

    `kv_what` says which KV pool `kv_cache` is, so the user knows what to shrink;
    `gpu_memory_utilization` is the share of a GPU the engine may fill when that share sizes
    the pool (None: the pool's size was given).
    """
    if os.environ.get("TOKENSPEED_SKIP_MEMORY_CHECK") == "1":
        return
    free = free_memory_bytes(device)
    if free is None:
        return
    usable, free_text = free, f"{_gb(free)} free"
    if device.type == "cuda" and gpu_memory_utilization is not None:
        total = torch.cuda.mem_get_info(device)[1]
        usable = max(0, int(free - total * (1.0 - gpu_memory_utilization)))
        free_text += f" ({_gb(usable)} of it within --gpu-memory-utilization {gpu_memory_utilization})"
    if weights + kv_cache <= usable:
        return
    half = ", --dtype bfloat16 (half the bytes of float32)" if dtype == torch.float32 else ""
    raise NotEnoughMemory(
        f"not enough memory on {device}: needs ~{_gb(weights)} for weights + {_gb(kv_cache)} for {kv_what}, "
        f"{free_text}. Try a smaller model{half}, or a smaller --max-model-len; "
        f"TOKENSPEED_SKIP_MEMORY_CHECK=1 skips this check."
    )
