"""`EngineConfig`: the one set of engine knobs shared by `LLM`, the CLI and the server.

Names follow vLLM's engine arguments where they exist, so flags carry over.
`None` means "derive it": the `Executor` (`executor/executor.py`) derives
max_model_len, dtype, device and the KV page count from the model and the
device once, and reports them to the core as its `limits`.
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass
from typing import Any

import torch

from tokenspeed.errors import InvalidRequest
from tokenspeed.models.quant_config import KV_CACHE_DTYPES, QUANTIZATION_METHODS
from tokenspeed.placement.parallel_config import ParallelConfig, ParallelConfigError

_CPU_KV_CACHE_BYTES = 512 * 1024 * 1024  # vLLM's CPU backend also reserves a fixed KV space
_DTYPES = {
    "float32": torch.float32,
    "fp32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "bf16": torch.bfloat16,
    "float16": torch.float16,
    "fp16": torch.float16,
    "half": torch.float16,
}


@dataclass(slots=True)
class EngineConfig:
    model: str | None = None  # None: the embedded tiny model
    tokenizer: str | None = None
    dtype: str = "auto"
    device: str = "auto"
    max_model_len: int | None = None
    max_num_seqs: int = 256
    max_num_batched_tokens: int | None = None
    page_size: int = 16
    enable_prefix_caching: bool = True
    load_format: str = "auto"
    seed: int = 0
    num_kv_pages: int | None = None  # overrides the memory-derived pool size
    kv_cache_memory_bytes: int | None = None
    gpu_memory_utilization: float = 0.9
    skip_tokenizer_init: bool = False
    # Run the checkpoint's own tokenizer code (tokenizer_config.json's auto_map, e.g. Kimi-K2's tiktoken
    # tokenizer). The model itself is always ours: config.json is only read.
    trust_remote_code: bool = False
    # CUDA graphs for decode-only steps (off: every step runs eagerly).
    enforce_eager: bool = False
    # Largest decode batch captured in a CUDA graph (None: min(max_num_seqs, 512)).
    cuda_graph_max_bs: int | None = None
    # Overlap scheduling: plan step N+1 on the host while the device runs step N.
    disable_overlap: bool = False
    # CPU: decode-only steps of a dense fp32 decoder run the step-shared, few-op forward
    # (executor/cpu_decode.py) instead of the layers' eager one; set: the layers run every step.
    disable_cpu_decode_forward: bool = False
    # CPU: steps with prompt chunks (prefill alone or mixed with decodes) run the same step-shared forward
    # (attention of a chunk with no cached prefix on its own new K/V); set: those steps run the layers.
    disable_cpu_prefill_forward: bool = False
    # CPU: that forward's GEMMs and LM head run on weights pre-packed once for oneDNN where faster
    # (executor/cpu_linear.py; fp32 rounding differs from F.linear); set (or env
    # TOKENSPEED_CPU_GEMM_PREPACK=0): F.linear on the layers' weights, bit-equal to the layers.
    disable_cpu_gemm_prepack: bool = False
    # CPU: that forward's decode rows attend their pages in place through a C kernel built on first use
    # (kernels/attention/decode_paged_cpu.py; within fp32 rounding of SDPA); set: pages gathered for SDPA.
    disable_cpu_paged_attention: bool = False
    # CPU: that forward's residual add + RMSNorm, q/k norm + RoPE + K/V write and SiLU x up run as one C
    # call each (kernels/cpu_fused.py; within fp32 rounding of the torch ops); set (or env
    # TOKENSPEED_CPU_FUSED_OPS=0): the torch ops.
    disable_cpu_fused_ops: bool = False
    # Kernel overrides "family.mode=name", applied before the model is built (`--kernel`).
    kernel_overrides: tuple[str, ...] = ()
    # torch intra-op threads on the CPU (None: torch's default in-process; the server's engine
    # process takes all cores but one, leaving that one to the API process: see default_cpu_threads).
    cpu_threads: int | None = None
    # Forward the prefix cache's stored/evicted page records to the front end (a cache-aware
    # router subscribes to them through the gRPC service: tokenspeed/grpc/kv_events.py).
    enable_kv_cache_events: bool = False
    # Speculative decoding, vLLM's option: {"method": "suffix" | "ngram" | "eagle" | "mtp" | "draft_model",
    # "num_speculative_tokens": k, "model": ...} (`spec.config.SpeculativeConfig`); None: off.
    speculative_config: dict[str, Any] | None = None
    # FP8 weights, vLLM's option: "fp8" quantises a bf16/fp32 checkpoint at load (per output channel);
    # a checkpoint's own quantization_config (FP8 with block, per-tensor or per-channel scales; vLLM's fp8
    # or compressed-tensors float8) is always honoured (`models/quant_config.py`).
    quantization: str | None = None
    # KV cache storage, vLLM's option: "auto" (the model dtype) | "fp8" | "fp8_e4m3" (half the bytes of
    # bf16; static scales: the checkpoint's `self_attn.k_scale` / `v_scale`, per tensor or per KV head, else 1.0;
    # `layers/kv_scales.py`).
    kv_cache_dtype: str = "auto"
    # vLLM's option: measure each layer's fp8 KV scales (per KV head) on one prompt of random tokens at start-up
    # (`executor/kv_scale_calibration.py`), for models whose K/V pass e4m3's +-448 and whose checkpoint has
    # no scales.
    calculate_kv_scales: bool = False
    # KV tiers below the device pool (kvcache/, executor/kv_tiers.py). Host tier bytes (None: a quarter of
    # the host's available memory on a GPU, 0 on the CPU); a disk tier under kv_cache_dir (None: off)
    # bounded by kv_cache_dir_bytes; retention of a session's pages for session_ttl seconds after a turn;
    # preemption "retract" (to the host) or "recompute" (None: retract when there is a host tier).
    host_kv_cache_bytes: int | None = None
    kv_cache_dir: str | None = None
    kv_cache_dir_bytes: int = 64 * 1024**3
    session_ttl: float = 300.0
    preemption_mode: str | None = None
    # Multi-rank execution (vLLM's names; `placement/`, `executor/multi_rank.py`): ranks (one device each,
    # CPU ranks are processes), routed experts split by expert instead of by intermediate size, and
    # SGLang's data-parallel attention (for MLA, whose one latent head cannot be split).
    tensor_parallel_size: int = 1
    enable_expert_parallel: bool = False
    enable_dp_attention: bool = False

    def replace(self, **changes: object) -> EngineConfig:
        return dataclasses.replace(self, **changes)  # type: ignore[arg-type]

    def validate(self) -> None:
        if self.page_size < 1:
            raise InvalidRequest(f"page_size must be at least 1, got {self.page_size}.")
        if self.cpu_threads is not None and self.cpu_threads < 1:
            raise InvalidRequest(f"cpu_threads must be at least 1, got {self.cpu_threads}.")
        if self.max_num_seqs < 1:
            raise InvalidRequest(f"max_num_seqs must be at least 1, got {self.max_num_seqs}.")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise InvalidRequest(
                f"max_num_batched_tokens must be at least 1, got {self.max_num_batched_tokens}."
            )
        if self.max_model_len is not None and self.max_model_len < 2:
            raise InvalidRequest(f"max_model_len must be at least 2, got {self.max_model_len}.")
        if self.load_format not in ("auto", "safetensors", "dummy"):
            raise InvalidRequest(f"load_format must be auto, safetensors or dummy, got {self.load_format!r}.")
        if self.dtype != "auto" and self.dtype not in _DTYPES:
            raise InvalidRequest(f"dtype must be auto or one of {sorted(_DTYPES)}, got {self.dtype!r}.")
        if not 0.0 < self.gpu_memory_utilization <= 1.0:
            raise InvalidRequest(
                f"gpu_memory_utilization must be in (0, 1], got {self.gpu_memory_utilization}."
            )
        if self.cuda_graph_max_bs is not None and self.cuda_graph_max_bs < 1:
            raise InvalidRequest(f"cuda_graph_max_bs must be at least 1, got {self.cuda_graph_max_bs}.")
        for item in self.kernel_overrides:
            parse_kernel_override(item)
        if self.quantization is not None and self.quantization not in QUANTIZATION_METHODS:
            raise InvalidRequest(
                f"quantization must be one of {', '.join(QUANTIZATION_METHODS)}, got {self.quantization!r}."
            )
        if self.kv_cache_dtype not in KV_CACHE_DTYPES:
            raise InvalidRequest(
                f"kv_cache_dtype must be one of {', '.join(KV_CACHE_DTYPES)}, got {self.kv_cache_dtype!r}."
            )
        if self.calculate_kv_scales and self.kv_cache_dtype == "auto":
            raise InvalidRequest("calculate_kv_scales measures the scales of an fp8 KV cache: set kv_cache_dtype "
                                 "to fp8 (--kv-cache-dtype fp8) too.")
        if self.calculate_kv_scales and self.enable_dp_attention:
            raise InvalidRequest("calculate_kv_scales is not supported with enable_dp_attention (one attention "
                                 "rank would see the calibration prompt).")
        self.parallel_config()  # refuses bad option combinations (the model's own splits: at build)
        if self.tensor_parallel_size > 1 and self.speculative_config is not None:
            raise InvalidRequest(
                "speculative decoding (speculative_config) runs on one rank only; "
                f"it cannot be combined with tensor_parallel_size={self.tensor_parallel_size}."
            )
        if self.tensor_parallel_size > 1 and self.host_kv_cache_bytes:
            raise InvalidRequest(
                "the KV host tier (host_kv_cache_bytes) runs on one rank only for now; it cannot be "
                f"combined with tensor_parallel_size={self.tensor_parallel_size}."
            )
        self._validate_kv_tiers()

    def _validate_kv_tiers(self) -> None:
        if self.host_kv_cache_bytes is not None and self.host_kv_cache_bytes < 0:
            raise InvalidRequest(f"host_kv_cache_bytes must be >= 0, got {self.host_kv_cache_bytes}.")
        if self.kv_cache_dir_bytes < 1:
            raise InvalidRequest(f"kv_cache_dir_bytes must be positive, got {self.kv_cache_dir_bytes}.")
        if not 0.0 <= self.session_ttl <= 86400.0:
            raise InvalidRequest(f"session_ttl must be in [0, 86400] seconds, got {self.session_ttl}.")
        if self.preemption_mode not in (None, "retract", "recompute"):
            raise InvalidRequest(f"preemption_mode must be retract or recompute, got {self.preemption_mode!r}.")
        if self.kv_cache_dir is not None and self.host_kv_cache_bytes == 0:
            raise InvalidRequest("kv_cache_dir (the disk tier) is filled from the host tier: set host_kv_cache_bytes.")

    def parallel_config(self) -> ParallelConfig:
        """The placement options of this config (`placement.parallel_config`); raises on a bad combination."""
        tp = self.tensor_parallel_size
        if isinstance(tp, bool) or not isinstance(tp, int) or tp < 1:
            raise InvalidRequest(f"tensor_parallel_size must be an integer >= 1, got {tp!r}.")
        try:
            return ParallelConfig(
                tensor_parallel_size=tp,
                enable_expert_parallel=self.enable_expert_parallel,
                enable_dp_attention=self.enable_dp_attention,
                data_parallel_size=tp if self.enable_dp_attention else 1,
            )
        except ParallelConfigError as error:
            raise InvalidRequest(str(error)) from None


def parse_kernel_override(item: str) -> tuple[str, str, str]:
    """`"family.mode=name"` -> (family, mode, name); raises InvalidRequest on anything else."""
    key, sep, name = item.partition("=")
    family, dot, mode = key.strip().partition(".")
    if not (sep and dot and family and mode and name.strip()):
        raise InvalidRequest(f"--kernel expects family.mode=name (e.g. attention.decode=reference), got {item!r}.")
    return family.strip(), mode.strip(), name.strip()


def default_cpu_threads() -> int:
    """Cores for the engine process of `tokenspeed serve` on the CPU: all this process may use but one.

    The API process (HTTP, tokenizer, detokenizer) shares the machine; with
    torch's default of one thread per core the two oversubscribe it and every
    OpenMP barrier waits for a descheduled thread (measured on 2 vCPUs under
    load: 30 -> 100 output tok/s with one engine thread).
    """
    return max(1, len(os.sched_getaffinity(0)) - 1)


def resolve_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def resolve_dtype(dtype: str, device: torch.device, checkpoint_dtype: str | None) -> torch.dtype:
    """fp32 on the CPU, the checkpoint's half type on GPUs.

    fp32 even on CPUs with AVX512-BF16: the CPU fast paths (fused C ops, few-row GEMMs, paged
    attention) are fp32, and `--dtype bfloat16` measured slower there (512-token prefill 32.4 vs
    26.7 ms, 4-row decode step 3.67 vs 1.03 ms: `benchmarks/results/cpu/cpu_dtype_ab.json`).
    """
    if dtype != "auto":
        return _DTYPES[dtype]
    if device.type == "cpu":
        return torch.float32
    if checkpoint_dtype in ("float16", "bfloat16"):
        return _DTYPES[checkpoint_dtype]
    return torch.bfloat16


def resolve_kv_cache_dtype(kv_cache_dtype: str, dtype: torch.dtype) -> torch.dtype:
    """The KV pool's element type: the model's for "auto", e4m3 for "fp8" / "fp8_e4m3"."""
    return dtype if kv_cache_dtype == "auto" else torch.float8_e4m3fn


def kv_cache_budget_bytes(config: EngineConfig, device: torch.device) -> int:
    """Bytes to give the paged KV pool when no page count is forced."""
    if config.kv_cache_memory_bytes is not None:
        return config.kv_cache_memory_bytes
    if device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        reserve = total * (1.0 - config.gpu_memory_utilization)
        return max(0, int(free - reserve))
    env = os.environ.get("TOKENSPEED_CPU_KV_CACHE_BYTES")
    return int(env) if env else _CPU_KV_CACHE_BYTES
