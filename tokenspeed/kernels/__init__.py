"""Kernel layer: every hot op is resolved through the registry (see `registry.py`).

Families and modes: `attention.{decode,extend}`, `kvstore.write`,
`kvstore.rope_write` (q/k norm, RoPE and the store as one kernel),
`norm.rms`, `rope.apply`, `activation.silu_and_mul`, `sampling.sample`,
`sampling.bitmask` (grammar masks, structured output). Each has
a torch REFERENCE (cpu and cuda) and a Triton PORTABLE kernel (cuda only; the
CPU keeps the reference, except `attention.decode`, whose PORTABLE CPU kernel
`torch_batched` attends the whole batch in a few torch ops). Triton kernels
also run on CPU tensors under `TRITON_INTERPRET=1` (tests), and
`python -m tokenspeed.kernels.compile_check` compiles them all for a GPU
target on a machine without one.

Mixture of experts (`moe/`): `moe.route` (router logits -> top-k weights and
expert ids; REFERENCE and Triton) and `moe.experts` (the routed SwiGLU
experts: REFERENCE, a Triton fused grouped GEMM (PERFORMANT, fastest at every
measured size), and torch's grouped GEMM (PORTABLE) for batches of at least
`GROUPED_MM_MIN_TOKENS` tokens when the caller states `workload={"num_tokens": ...}`;
`moe.experts_dispatch` picks between them per batch).

Multi-head latent attention (`mla/`, DeepSeek-V2/V3, weight-absorbed form over
a paged cache of latent + rope rows): `mla.write`, `mla.decode` (q_len tokens
per row; the Triton kernel folds speculative tokens into the head axis and
splits long contexts) and `mla.extend`; REFERENCE on cpu and cuda, Triton
PORTABLE on cuda.

Decode GEMMs (`gemm/`): `gemm.decode` (one-token GEMV with optional RMSNorm
prologue, residual epilogue and fp32 output) and `gemm.decode_silu_mul` (the
gate/up projection with SiLU-and-mul fused); REFERENCE (cpu, cuda: the off
switch) and Triton PORTABLE (cuda), picked for `workload={"num_tokens": ...}`
up to `gemm.DECODE_MAX_TOKENS`. `pdl.py`: programmatic dependent launch for the
decode-step kernels (`TOKENSPEED_PDL=0` turns it off). `autotune.py`: kernels
with several launch shapes time them per shape on the device on first use,
never inside a CUDA graph capture (`TOKENSPEED_AUTOTUNE=0`: defaults only).

FP8 (e4m3; formats and rounding in `quant/fp8.py`): `quant.per_token_group`
and `quant.per_token` (dynamic 1 x 128 and rowwise activation quantisation;
REFERENCE and Triton); `gemm.fp8` (linear with fp8 weights and block /
per-channel / per-tensor scales: REFERENCE dequantises on the fly, Triton
`triton_gemv` PERFORMANT streams weights for 1-16 tokens (one token in
registers, more on tensor cores: `gemm.FP8_GEMV_MAX_TOKENS`), cuBLAS `scaled_mm` PERFORMANT (`torch._scaled_mm`,
bf16) runs the block and rowwise formats above, Triton `triton` PORTABLE
runs fp8 x fp8 tensor cores for any layout; `gemm.fp8_dispatch` picks per batch);
`moe.experts_fp8` (fp8 experts; REFERENCE and Triton). The KV kernels
(`kvstore.write`, `attention.*`, `mla.*`) also take an fp8 cache with static
per-head scales (`k_scale`/`v_scale`, `kv_scale` for MLA).
"""

from tokenspeed.kernels.registry import (
    Band,
    KernelSelectionError,
    KernelSpec,
    SelectionReport,
    check_kernel_override,
    check_override_environment,
    clear_kernel_overrides,
    describe_selection,
    list_kernels,
    platform_of,
    register_kernel,
    scoped_kernel_overrides,
    select_kernel,
    set_kernel_override,
    unregister_kernel,
)

__all__ = [
    "Band",
    "KernelSelectionError",
    "KernelSpec",
    "SelectionReport",
    "check_kernel_override",
    "check_override_environment",
    "clear_kernel_overrides",
    "describe_selection",
    "list_kernels",
    "platform_of",
    "register_kernel",
    "scoped_kernel_overrides",
    "select_kernel",
    "set_kernel_override",
    "unregister_kernel",
]
