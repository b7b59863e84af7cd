"""MLA (multi-head latent attention, DeepSeek-V2/V3) kernels over the paged latent cache.

The cache holds per token only the normalised latent c_kv (`kv_lora_rank`
values) followed by the rope key k_pe (`rope_dim` values), in one tensor
`[num_pages, page_size, 1, kv_lora_rank + rope_dim]`. Attention runs in the
weight-absorbed form: the layer has already projected q_nope through W_UK, so
every query head scores against the one shared latent "head" (MQA with key
width kv_lora_rank + rope_dim) and the value is the latent itself; the output
stays in the latent space (`kv_lora_rank` wide) for the layer's W_UV.

Modes: `mla.write` (store latent+rope rows at flat slots), `mla.decode`
(q_len query tokens per row, 1 for decode, 2..16 for speculative verification,
with q-head folding in the Triton kernel), `mla.extend` (variable-length rows:
prefill chunks after a cached prefix, mixed with decodes).

Modules: `reference` (torch oracle, cpu and cuda; the contract's signatures),
`tiles` (the Triton inner loop both attention kernels share), `decode_plan`
(fold, head tiling, split count and launch sizes, all from shapes only),
`decode_triton`, `extend_triton`, `write_triton`, and `compile_configs` (the
serving configurations `tokenspeed.kernels.compile_check` compiles for sm_90).
"""
