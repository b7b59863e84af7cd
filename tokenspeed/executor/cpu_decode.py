"""The CPU decode forward: a decode-only step of a dense decoder in few torch ops.

On the CPU a small model's decode step is dispatch-bound: the eager layers
issue ~120 aten calls per layer (measured on the embedded model: 494 per step,
~5 us each against ~0.4 ms of weight streaming), most of them rebuilding, in
every layer, things that depend only on the step: the RoPE rows of each
position, each row's page index and visibility mask, the checks on the
slots. `CPUDecodeForward` is to the CPU what `DecodeGraphs` is to a GPU: the
runner hands it decode-only steps, and it runs them on the model's own
weights and KV pool as

- once per step (`DecodeStep`): cos/sin rows of the positions laid out for a
  rotate-half without slicing, the flat page index of every row's visible
  pages, and the additive mask of its positions (SDPA would rebuild it from a
  boolean one in every layer);
- per layer ~40 ops: residual add + RMSNorm, QKV GEMM, q/k RMSNorm as one
  norm over all heads (one weight row per head), RoPE over q and k at once
  (`x * cos + flip(x) * sin`), K/V written with `index_copy_` into flat views
  of the caches made once, the pages gathered with `index_select` and one
  fused SDPA call with GQA folded into the query length (as
  `attention.decode=torch_batched`), o_proj, the MLP.

Decode rows' attention by default reads the pages in place instead
(`kernels/attention/decode_paged_cpu.py`, a C kernel built on first use): at
4-16 rows of ~500 positions the gather copy was ~23% of the step and SDPA
~20%. It sums in another order than SDPA, so with it the hidden states equal
the layers' within fp32 rounding (tested to 1e-5; greedy tokens identical),
not bit for bit; the bit-equality statements below are of the gather + SDPA
path. Off switch: `--disable-cpu-paged-attention`
(`EngineConfig.disable_cpu_paged_attention`, or
`TOKENSPEED_CPU_ATTENTION_NATIVE=0`); without a C compiler it is off. On the
embedded model it took the decode step 1.48 / 2.86 / 5.81 -> 1.31 / 2.38 / 4.99 ms
at 1 / 4 / 16 rows (`benchmarks/results/cpu/cpu_decode_paged_attention.md`).

The arithmetic is that of the eager layers with the CPU kernels they select
(`norm.rms=torch_fp32`, `rope.apply=reference`, `attention.decode=torch_batched`,
`kvstore.write=reference`, `activation.silu_and_mul=reference`, plain GEMMs):
the same ops on the same operands in the same order, so (GEMM prepacking off,
below) the hidden states are equal bit for bit (tested); the rotation's `x1*cos - x2*sin` becomes
`x1*cos + x2*(-sin)`, which IEEE arithmetic rounds identically. A model that
those kernels do not serve (another dtype, fp8 weights or KV, sliding
windows, partial rotary, biases, MoE layers, a kernel override) gets no
`CPUDecodeForward` and runs eagerly through its layers. Off switch:
`--disable-cpu-decode-forward` (`EngineConfig.disable_cpu_decode_forward`).

The GEMMs (and the LM head, `logits`) of 2 rows or more run on weights pre-packed once for oneDNN
where that is faster (`cpu_linear.py`: the LM head 1.4-2.7x and gate_up 1.3-1.7x at 2-16 rows, ~1.1x
on every GEMM of prefill-sized steps; the embedded model's decode step -9% / -10% at B=4 / 16, B=1
unchanged: `benchmarks/results/cpu/cpu_gemm_prepack.md`); that changes their fp32 rounding, so with
it on the hidden states equal the layers' within ~1e-6 relative, not bit for bit (tested, same greedy
tokens). Off switch:
`--disable-cpu-gemm-prepack` (`EngineConfig.disable_cpu_gemm_prepack`, env
`TOKENSPEED_CPU_GEMM_PREPACK=0`): `F.linear` on the layers' own weights, bit for bit.

Steps with prompt chunks (a prefill alone, or mixed with the running
requests' decodes: the usual step of a server under load) run the same layer
sequence (`serves`); only attention differs, and it is the layers' extend
kernel (`attention.extend=torch_sdpa`) op for op: the decode rows batched as
above (their pages and mask made once a step), each prompt chunk in one SDPA
call, causal (`is_causal`) on this step's own K/V when it has no cached
prefix (the layers gather them back from the pages they were just written
to: the same values), else on its gathered pages with a visibility mask
made once a step; rows of ~100-1000 positions in causal query blocks whose
masks are made once a step (`extend_torch_sdpa.causal_blocks`). Bit-equal to
the layers too (tested). Steps whose rows all
have one length of 2..16 tokens go to the verify kernel in the layers, and
stay there. The runner asks for the logits rows only (`run(logits_rows=True)`):
on a step with prompt chunks the last layer then runs attention, o_proj and
the MLP for those rows alone (each as a one-token row over its own prefix),
which is equal to the layers within fp32 rounding, not bit for bit (tested:
same argmax, logits within 1e-4). On the embedded model a 512-token prefill
went 48 -> 34 ms (`benchmarks/results/cpu/cpu_prefill_step.md`). Off switch
for all of this: `--disable-cpu-prefill-forward`
(`EngineConfig.disable_cpu_prefill_forward`).

Between the GEMMs, residual add + RMSNorm, q/k RMSNorm + RoPE + the K/V writes, and SiLU x up run as
one C call each where a C compiler works (`kernels/cpu_fused.py`; ~12 calls a layer instead of ~30 torch
ops): the embedded model's decode step 1.30 / 2.17 / 4.09 -> 1.09 / 1.79 / 3.64 ms at 1 / 4 / 16 rows,
a 512-token prefill 30.5 -> 28.9 ms (`benchmarks/results/cpu/cpu_fused_ops.md`). Within fp32 rounding
of the torch ops (tested; greedy tokens identical). Off switch: `--disable-cpu-fused-ops`
(`EngineConfig.disable_cpu_fused_ops`, env `TOKENSPEED_CPU_FUSED_OPS=0`). With the native paged kernel
on, prompt chunks attend their pages in place too, through a causal C kernel of their own
(`kernels/attention/prefill_paged_cpu.py`: no masks, gathers or repeated K/V; 1.75 against 2.70 ms a
layer on a 512-token prompt); its off switch is the paged kernel's.

Why not torch.compile (measured on the 2-vCPU dev host, torch 2.13, this op
sequence with K/V write + attention as one custom op, inductor C++ codegen):
dynamic shapes compiled in 9-21 s (static ones in 48 s, and a static graph
would recompile every 16 tokens as the page span grows); the compiled stack
ran 0.82-0.85 ms against 0.88-0.90 ms for this eager sequence at one row
(512-token context), and 5.2 ms against 5.0-5.4 ms at 16 rows. What is left
is GEMMs, page gathers and SDPA, which inductor calls as the same extern
kernels, so a few percent does not pay for the compile; CPU decode stays eager
(`enforce_eager` keeps its meaning: CUDA graphs off).
"""

from __future__ import annotations

import bisect
import logging
from dataclasses import dataclass
from typing import Any, cast

import torch
import torch.nn.functional as F

from tokenspeed.batch.forward_batch import ForwardBatch
from tokenspeed.batch.kv_storage import PagedKVStorage
from tokenspeed.executor.cpu_attention import CPUStepAttention
from tokenspeed.executor.cpu_linear import PREPACK_MAX_BYTES, CPULinear, pack, pack_lm_head, prepack_enabled
from tokenspeed.executor.cpu_step import DecodeRows, DecodeStep, PromptRow
from tokenspeed.kernels import cpu_fused
from tokenspeed.kernels.attention import decode_paged_cpu, prefill_paged_cpu
from tokenspeed.layers.attention_backend import VERIFY_MAX_QUERY_LEN

logger = logging.getLogger("tokenspeed.executor")

# The last layer runs for the logits rows alone (`CPUDecodeForward.run(logits_rows=True)`) while they are
# at most this fraction of a step's tokens (a step scoring every prompt position keeps the whole layer).
PRUNE_MAX_FRACTION = 0.25


@dataclass(slots=True)
class LayerWeights:
    input_norm: torch.Tensor  # [hidden]
    qkv: CPULinear  # weight [(heads + 2 kv_heads) * head_dim, hidden] (`cpu_linear`: maybe pre-packed)
    qk_norm: torch.Tensor | None  # [heads + kv_heads, head_dim]: q_norm's weight per q head, k_norm's per kv head
    o_proj: CPULinear
    post_norm: torch.Tensor
    gate_up: CPULinear
    down: CPULinear
    k_flat: torch.Tensor  # the layer's K cache as [pages * page_size, kv_heads, head_dim] (a view)
    v_flat: torch.Tensor
    k_pages: torch.Tensor  # as [pages, page_size * kv_heads * head_dim] (a view), for gathering whole pages
    v_pages: torch.Tensor
    k_cache: torch.Tensor  # the layer's caches as the pool holds them, for the native paged kernel
    v_cache: torch.Tensor


def _why_not(model: torch.nn.Module, kv: PagedKVStorage) -> str | None:
    """Why `CPUDecodeForward` cannot run `model` (None: it can)."""
    from tokenspeed.kernels.activation.reference import silu_and_mul_reference
    from tokenspeed.kernels.norm.rms_cpu import rms_norm_torch_fp32
    from tokenspeed.kernels.rope.reference import apply_rope_reference
    from tokenspeed.layers.mlp import GatedMLP
    from tokenspeed.models.llama import DecoderLayer, DecoderModel, DenseDecoderForCausalLM

    if not isinstance(model, DenseDecoderForCausalLM):
        return f"{type(model).__name__} is not a dense decoder"
    if getattr(model, "dp_rows", None) is not None or getattr(model, "placement", None) is not None:
        return "the model is split over ranks"
    if model.dtype != torch.float32 or any(p.device.type != "cpu" for p in model.parameters()):
        return "only fp32 weights on the CPU"
    inner = model.model
    if type(inner) is not DecoderModel or not inner.layers:
        return "a custom decoder stack"
    if model.lm_head.weight.dtype != torch.float32:
        return "the LM head is not fp32"
    rotary = inner.rotary_emb
    if rotary.rotary_dim != rotary.head_dim or rotary._kernel is not apply_rope_reference:
        return "partial rotary or a RoPE kernel override"
    if not kv.v or any(t.dtype != torch.float32 for t in (*kv.k, *kv.v)):
        return "the KV cache is not fp32 K and V"
    norms = [inner.norm]
    for layer in inner.layers:
        if type(layer) is not DecoderLayer or not isinstance(layer.mlp, GatedMLP):
            return "a layer other than attention + gated MLP"
        attn, mlp = layer.self_attn, layer.mlp
        if attn.sliding_window is not None:
            return "sliding-window attention"
        backend = attn.attention_backend
        if backend.decode.name != "torch_batched" or backend.write.name != "reference":
            return "an attention kernel override"
        if mlp._act is not silu_and_mul_reference or mlp._fused_max_tokens >= 0:
            return "an activation kernel override"
        for linear in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj):
            if linear.bias is not None or linear._fp8_gemm is not None or linear.decode_max_tokens >= 0:
                return "biases, fp8 weights or a decode GEMM kernel"
        norms += [layer.input_layernorm, layer.post_attention_layernorm]
        if attn.q_norm is not None and attn.k_norm is not None:
            norms += [attn.q_norm, attn.k_norm]
            if attn.q_norm.eps != attn.k_norm.eps:
                return "q and k norms with different eps"
    if any(norm._kernel is not rms_norm_torch_fp32 for norm in norms):
        return "an RMSNorm kernel override"
    return None


def _rms(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """`norm.rms=torch_fp32`'s arithmetic, op for op."""
    return weight * (x * torch.rsqrt((x * x).mean(-1, keepdim=True) + eps))


class CPUDecodeForward:
    """Decode-only steps of an eligible dense decoder on the CPU (see the module docstring)."""

    def __init__(
        self, model: torch.nn.Module, kv: PagedKVStorage, *, decode: bool = True, prefill: bool = True,
        prepack: bool | None = None, paged_attention: bool | None = None, fused_ops: bool | None = None,
    ) -> None:
        """`prepack`: the GEMM weights and the LM head pre-packed for oneDNN where that pays (`cpu_linear.py`;
        fp32 rounding, not bit for bit). `paged_attention`: the decode rows' attention through the native
        paged kernel where it builds and takes the heads (`decode_paged_cpu`; fp32 rounding). `fused_ops`:
        residual add + RMSNorm, q/k norm + RoPE + K/V write and SiLU x up each as one C call where it
        builds and takes the shapes (`kernels/cpu_fused.py`; fp32 rounding). None: on unless its env
        switch (`TOKENSPEED_CPU_GEMM_PREPACK=0`, `TOKENSPEED_CPU_ATTENTION_NATIVE=0`,
        `TOKENSPEED_CPU_FUSED_OPS=0`) is set; with all three False the forward equals the eager layers
        bit for bit."""
        inner: Any = model.model  # a DecoderModel (`_why_not`)
        self.decode = decode  # decode-only steps
        self.prefill = prefill  # steps with prompt chunks (prefill only or mixed with decodes)
        # `run(logits_rows=True)` on steps with prompt chunks: the last layer for the logits rows only.
        self.prune_last_layer = True
        first = inner.layers[0].self_attn
        self.model = model
        self.embedding = inner.embed_tokens.weight
        self.final_norm = inner.norm.weight
        self.eps = inner.norm.eps
        self.num_heads, self.num_kv_heads, self.head_dim = first.num_heads, first.num_kv_heads, first.head_dim
        self.scale = first.scale
        # The decode rows' attention reads the pages in place (`decode_paged_cpu`); off: gather + SDPA.
        self.paged_attention = (
            (decode_paged_cpu.native_enabled() if paged_attention is None else paged_attention)
            and decode_paged_cpu.supports(self.num_heads, self.num_kv_heads, self.head_dim)
            and decode_paged_cpu.load_library() is not None
        )
        # Prompt chunks attend their pages in place too (`prefill_paged_cpu`) under the same switch.
        self.prefill_kernel = (
            self.paged_attention and prefill_paged_cpu.supports(self.num_heads, self.num_kv_heads, self.head_dim)
            and prefill_paged_cpu.load_library() is not None
        )
        prepack = prepack_enabled() if prepack is None else prepack
        self.page_size = kv.page_size
        self.attention = CPUStepAttention(heads=self.num_heads, kv_heads=self.num_kv_heads, head_dim=self.head_dim,
                                          page_size=self.page_size, scale=self.scale, paged=self.paged_attention,
                                          prefill_kernel=self.prefill_kernel)
        self.cos_cache = inner.rotary_emb.cos_cache
        self.sin_cache = inner.rotary_emb.sin_cache
        self.layers: list[LayerWeights] = []
        self.layer_eps: list[tuple[float, float, float]] = []
        weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        if prepack and weight_bytes > PREPACK_MAX_BYTES:
            logger.info("CPU GEMM prepack off: %.1f GiB of weights would be copied", weight_bytes / 2**30)
            prepack = False
        for index, layer in enumerate(inner.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qk_norm = None
            qk_eps = 0.0
            if attn.q_norm is not None and attn.k_norm is not None:
                qk_norm = torch.cat([
                    attn.q_norm.weight.expand(self.num_heads, -1), attn.k_norm.weight.expand(self.num_kv_heads, -1)
                ])
                qk_eps = attn.q_norm.eps
            k_cache, v_cache = kv.k[index], kv.v[index]
            self.layers.append(LayerWeights(
                input_norm=layer.input_layernorm.weight,
                qkv=pack(attn.qkv_proj.weight, enabled=prepack),
                qk_norm=qk_norm,
                o_proj=pack(attn.o_proj.weight, enabled=prepack),
                post_norm=layer.post_attention_layernorm.weight,
                gate_up=pack(mlp.gate_up_proj.weight, enabled=prepack),
                down=pack(mlp.down_proj.weight, enabled=prepack),
                k_flat=k_cache.view(-1, *k_cache.shape[2:]),
                v_flat=v_cache.view(-1, *v_cache.shape[2:]),
                k_pages=k_cache.view(k_cache.shape[0], -1),
                v_pages=v_cache.view(v_cache.shape[0], -1),
                k_cache=k_cache,
                v_cache=v_cache,
            ))
            self.layer_eps.append((layer.input_layernorm.eps, qk_eps, layer.post_attention_layernorm.eps))
        self.lm_head = pack_lm_head(model) if prepack else None
        self.fused = self._fused_ops(cpu_fused.native_enabled() if fused_ops is None else fused_ops, model)
        linears = [lin for w in self.layers for lin in (w.qkv, w.o_proj, w.gate_up, w.down)]
        linears += [self.lm_head] if self.lm_head is not None else []
        packed_mib = sum(lin.packed_bytes for lin in linears) / 2**20
        if packed_mib:
            logger.info("CPU GEMM weights pre-packed for oneDNN: %.1f MiB", packed_mib)

    def _fused_ops(self, enabled: bool, model: torch.nn.Module) -> cpu_fused.CPUFusedOps | None:
        """The fused C ops for this model's shapes, with its weights, tables and pools checked once; None
        where off, unbuildable or not these shapes (logged)."""
        if not enabled:
            return None
        lib = cpu_fused.load_library()
        hidden, widths = self.embedding.shape[1], [w.gate_up.weight.shape[0] // 2 for w in self.layers]
        if lib is None or not cpu_fused.supports(hidden, self.head_dim // 2, *widths):
            if lib is not None:
                logger.info("CPU fused ops off: widths not a multiple of 8 (hidden %d, head_dim %d)", hidden,
                            self.head_dim)
            return None
        try:
            ops = cpu_fused.CPUFusedOps(lib, heads=self.num_heads, kv_heads=self.num_kv_heads,
                                        head_dim=self.head_dim, cos_cache=self.cos_cache, sin_cache=self.sin_cache)
            ops.check_norm(self.final_norm)
            for w in self.layers:
                ops.check_norm(w.input_norm), ops.check_norm(w.post_norm)
                if w.qk_norm is not None:
                    ops.check_norm(w.qk_norm, self.num_heads + self.num_kv_heads)
                ops.check_kv(w.k_flat, w.v_flat)
        except ValueError as err:
            logger.info("CPU fused ops off: %s", err)
            return None
        return ops

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's `compute_logits` of `run`'s rows, through the packed LM head where there is one."""
        if self.lm_head is None:
            return cast(torch.Tensor, self.model.compute_logits(hidden))  # type: ignore[operator]
        return self.lm_head(hidden)

    @classmethod
    def build(
        cls, model: torch.nn.Module, kv: PagedKVStorage, *, decode: bool = True, prefill: bool = True,
        prepack: bool | None = None, paged_attention: bool | None = None, fused_ops: bool | None = None,
    ) -> CPUDecodeForward | None:
        """The CPU forward of `model` for the step kinds asked for (`prepack`, `paged_attention`: as in
        `__init__`), or None (logged) where the eager layers must run every step."""
        if not (decode or prefill):
            return None
        reason = _why_not(model, kv)
        if reason is not None:
            logger.info("CPU decode forward off: %s", reason)
            return None
        return cls(model, kv, decode=decode, prefill=prefill, prepack=prepack, paged_attention=paged_attention,
                   fused_ops=fused_ops)

    def serves(self, batch: ForwardBatch) -> bool:
        """Whether `run` takes this step (unpadded, not speculative: the runner checks those): decode-only
        steps, and with `prefill` on the steps with prompt chunks that the eager layers send to the extend
        kernel (rows of one equal length up to `VERIFY_MAX_QUERY_LEN` take the verify kernel there)."""
        attn = batch.attn
        rows = len(attn.seq_lens)
        q_len = attn.max_query_len
        if q_len == 1 and batch.num_tokens == rows:
            return self.decode
        if not self.prefill or rows == 0:
            return False
        return not (batch.num_tokens == rows * q_len and q_len <= VERIFY_MAX_QUERY_LEN)

    def prepare(self, batch: ForwardBatch) -> DecodeStep:
        attn = batch.attn
        tokens = batch.num_tokens
        half = self.head_dim // 2
        cos = sin = None  # the fused ops read the RoPE tables at the positions themselves
        if self.fused is None:
            cos = self.cos_cache[batch.positions].view(tokens, 1, 1, half)
            sin = self.sin_cache[batch.positions].view(tokens, 1, 1, half)
            cos, sin = torch.cat((cos, cos), dim=2), torch.cat((-sin, sin), dim=2)
        if attn.max_query_len == 1 and tokens == len(attn.seq_lens):  # decode-only
            assert attn.seq_lens_tensor is not None
            rows = self.attention.decode_rows(attn.page_table, attn.seq_lens_tensor.long(), attn.max_seq_len)
            return DecodeStep(cos=cos, sin=sin, slots=attn.slot_mapping, decode=rows)
        starts, lens = attn.query_start, attn.seq_lens
        decode_rows: list[int] = []
        prompts: list[PromptRow] = []
        for row, seq_len in enumerate(lens):
            start, end = starts[row], starts[row + 1]
            if end - start == 1:
                decode_rows.append(row)
            elif end > start:
                prompts.append(self.attention.prompt_row(attn.page_table[row], start, end, seq_len))
        decode: DecodeRows | None = None
        decode_tokens: torch.Tensor | None = None
        if decode_rows:
            index = torch.tensor(decode_rows, dtype=torch.long)
            decode_tokens = torch.tensor([starts[row] for row in decode_rows], dtype=torch.long)
            decode = self.attention.decode_rows(
                attn.page_table.index_select(0, index), torch.tensor([lens[row] for row in decode_rows]),
                max(lens[row] for row in decode_rows),
            )
        return DecodeStep(cos=cos, sin=sin, slots=attn.slot_mapping, decode=decode,
                          decode_tokens=decode_tokens, prompts=tuple(prompts))

    def _kept_rows(self, batch: ForwardBatch, step: DecodeStep) -> tuple[torch.Tensor, DecodeStep] | None:
        """The tokens whose hidden states become logits, as one-token rows over their own prefixes (the
        last layer's attention for them alone); None where that would not pay (no prompt chunk in the
        step, or more logits rows than `PRUNE_MAX_FRACTION` of the tokens: prompt logprobs)."""
        if not step.prompts:
            return None
        kept = batch.logits_indices
        if kept.shape[0] > batch.num_tokens * PRUNE_MAX_FRACTION:
            return None
        starts = batch.attn.query_start
        rows = torch.tensor([bisect.bisect_right(starts, t) - 1 for t in kept.tolist()], dtype=torch.long)
        lens = batch.positions.index_select(0, kept).long() + 1
        max_len = int(lens.max()) if kept.shape[0] else 0
        decode = self.attention.decode_rows(batch.attn.page_table.index_select(0, rows), lens, max_len)
        return kept, DecodeStep(cos=step.cos, sin=step.sin, slots=step.slots, decode=decode)

    def run(self, batch: ForwardBatch, *, logits_rows: bool = False) -> torch.Tensor:
        """Hidden states after the final norm, `[tokens, hidden]`; this step's K/V land in the pool.

        `logits_rows`: only the rows of `batch.logits_indices`, in that order. On a step with prompt
        chunks the last layer then runs attention, o_proj and the MLP for those rows alone (its K/V
        still for every token): on a 4-layer model a quarter of a prefill's weight FLOPs. Their
        arithmetic differs from the full layer's in summation order only (GEMMs of fewer rows, the
        decode attention form), so this is equal to the layers within fp32 rounding, not bit for bit.
        """
        step = self.prepare(batch)
        kept = self._kept_rows(batch, step) if logits_rows and self.prune_last_layer else None
        tokens = batch.num_tokens
        heads, kv_heads, head_dim = self.num_heads, self.num_kv_heads, self.head_dim
        q_width, kv_width = heads * head_dim, kv_heads * head_dim
        fused = self.fused
        # this step's K/V as views of the QKV rows: only prompt rows that SDPA attends read them
        kv_views = fused is None or any(row.plan is None for row in step.prompts)
        k: torch.Tensor | None = None
        v: torch.Tensor | None = None
        stream = F.embedding(batch.input_ids, self.embedding)
        residual: torch.Tensor | None = None
        last = len(self.layers) - 1
        for index, (w, (eps_in, eps_qk, eps_post)) in enumerate(zip(self.layers, self.layer_eps)):
            if fused is not None:  # stream += residual in place (a fresh GEMM output), then the norm
                qkv = w.qkv(fused.add_rms_norm(stream, residual, w.input_norm, eps_in))
                fused.qk_norm_rope_store(qkv, w.qk_norm, eps_qk, batch.positions, step.slots, w.k_flat, w.v_flat)
                q = qkv[:, :q_width].view(tokens, heads, head_dim)
                if kv_views:
                    k = qkv[:, q_width : q_width + kv_width].view(tokens, kv_heads, head_dim)
                    v = qkv[:, q_width + kv_width :].view(tokens, kv_heads, head_dim)
            else:
                assert step.cos is not None and step.sin is not None
                if residual is not None:
                    stream = stream + residual
                qkv = w.qkv(_rms(stream, w.input_norm, eps_in))
                qk = qkv[:, : q_width + kv_width].view(tokens, heads + kv_heads, head_dim)
                if w.qk_norm is not None:
                    qk = _rms(qk, w.qk_norm, eps_qk)
                halves = qk.view(tokens, heads + kv_heads, 2, head_dim // 2)
                qk = (halves * step.cos + halves.flip(2) * step.sin).view(tokens, heads + kv_heads, head_dim)
                k = qk[:, heads:]
                v = qkv[:, q_width + kv_width :].view(tokens, kv_heads, head_dim)
                w.k_flat.index_copy_(0, step.slots, k)
                w.v_flat.index_copy_(0, step.slots, v)
                q = qk[:, :heads]
            if index == last and kept is not None:  # from here on, the logits rows only
                rows, kept_step = kept
                out = self.attention.attend_decode(w, kept_step, q.index_select(0, rows))
                stream = stream.index_select(0, rows)
            else:
                out = self.attention.attend(w, step, q, k, v)
            residual = stream
            if fused is not None:
                stream = w.o_proj(out.reshape(stream.shape[0], q_width))
                gate_up = w.gate_up(fused.add_rms_norm(stream, residual, w.post_norm, eps_post))
                residual = stream
                stream = w.down(fused.silu_mul(gate_up))
                continue
            stream = w.o_proj(out.reshape(stream.shape[0], q_width)) + residual
            gate_up = w.gate_up(_rms(stream, w.post_norm, eps_post))
            gate, up = gate_up.chunk(2, dim=-1)
            residual = stream
            stream = w.down(F.silu(gate) * up)
        if logits_rows and kept is None:
            stream = stream.index_select(0, batch.logits_indices)
            residual = None if residual is None else residual.index_select(0, batch.logits_indices)
        if fused is not None:
            return fused.add_rms_norm(stream, residual, self.final_norm, self.eps)
        if residual is not None:
            stream = stream + residual
        return _rms(stream, self.final_norm, self.eps)
