"""CUDA graphs for decode-only steps, and for speculative decoding's verify steps.

A decode step at batch size B launches a few hundred small kernels whose CPU
launch cost exceeds their GPU time at small B; replaying a captured graph
costs one launch. Graphs are captured once per bucket (1, 2, 4, 8, then
multiples of 16 up to `max_bs`), largest first, sharing one memory pool. A
step of n rows runs the smallest bucket >= n: the host batch is padded with
rows that decode one token at position 0 on a scratch page (a page the
scheduler never hands out), so padded rows write and read only that page and
any KV-write kernel works for them.

Decode attention splits long contexts over several programs (split-KV); the
split count is a launch constant, so each bucket is captured once per distinct
count over the context classes 2K/8K/32K/max_model_len (small buckets: up to
three graphs; large ones need one). A step replays the graph of its bucket and
of the class of its longest row; eager steps use the same counts.

Verify steps (speculative decoding: every row its last token and up to k
drafts) run the same way with k+1 tokens a row: the runner pads each row at
its head with filler tokens written to the scratch page (`RowSpec.padding`),
so one graph per (bucket, k+1) serves every draft length, and rows keep
their real positions at the row's end. They are captured for the buckets
whose tokens stay within `VERIFY_MAX_TOKENS`; larger verify steps run eagerly.

Inputs live in static buffers that every step overwrites (the staging
kernel writes them, `step_inputs`, or replay copies them in); the graph computes
hidden states and fp32 logits for every row, and sampling runs after the
replay, outside the graph, so any sampling parameters work.

Capturability is checked, not assumed: before capturing, the model runs once
with metadata whose host lists refuse element access (`GraphGuardList`) and
with PyTorch's sync debug mode set to "error", so any read of a device value
on the host raises. The torch reference attention fails that probe and the
engine stays eager; a Triton decode kernel that reads only tensors passes.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass

import torch

from tokenspeed.batch.forward_batch import AttentionMetadata, ForwardBatch, GraphGuardList, NotCapturable
from tokenspeed.batch.kv_storage import PagedKVStorage
from tokenspeed.kernels.staging.step_inputs import StepInputs
from tokenspeed.models.interface import CausalLM

logger = logging.getLogger("tokenspeed.executor")


# Context-length classes of decode steps: a step whose longest row fits a class uses the split-KV
# count chosen for that class (few splits for short contexts, many for long ones).
CONTEXT_CLASSES = (2048, 8192, 32768)
# Verify graphs (speculative decoding, k+1 tokens a row) are captured for buckets up to this many tokens:
# a verify step is worth a graph at small batches, where launches dominate; logits buffers grow with it.
VERIFY_MAX_TOKENS = 512


def context_class(max_seq_len: int, max_model_len: int) -> int:
    return next((c for c in CONTEXT_CLASSES if max_seq_len <= c < max_model_len), max_model_len)


def decode_kv_splits(
    rows: int, num_kv_heads: int, max_model_len: int, device: torch.device, *, mla_heads: int | None = None,
    q_len: int = 1,
) -> int | None:
    """Split-KV partitions for a decode batch of `rows` (its graph bucket) whose contexts are at
    most `max_model_len` (a context class), `q_len` tokens a row (> 1: verify batches). Eager and
    graph steps of one bucket and class use the same count, so their attention reductions run in
    the same order and CUDA graphs on/off give identical tokens. `mla_heads`: the model's query
    heads when it attends over a latent (MLA) cache, whose decode kernel tiles heads rather than kv
    heads and sizes its splits itself."""
    if device.type != "cuda":
        return None
    try:
        if mla_heads is not None:
            from tokenspeed.kernels.mla.decode_triton import choose_num_splits as mla_splits

            return int(mla_splits(rows, mla_heads, q_len, max_model_len, device=device))
        from tokenspeed.kernels.attention.decode_triton import choose_num_splits
    except ImportError:  # no Triton decode kernel: the kernel in use chooses
        return None
    return int(choose_num_splits(rows * q_len, num_kv_heads, max_model_len, device))


def mla_query_heads(model: torch.nn.Module) -> int | None:
    """Query heads of an MLA model (see `decode_kv_splits`), None for any other model."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "mla", None) is None:
        return None
    return int(config.num_heads)


def graph_batch_sizes(max_bs: int) -> list[int]:
    sizes = [b for b in (1, 2, 4, 8) if b <= max_bs]
    sizes += list(range(16, max_bs + 1, 16))
    if max_bs not in sizes:
        sizes.append(max_bs)
    return sorted(sizes)


def verify_graph_sizes(max_bs: int, verify_query_len: int | None) -> list[int]:
    """The batch sizes verify graphs are captured for: those whose rows of `verify_query_len` tokens stay
    within VERIFY_MAX_TOKENS."""
    if not verify_query_len:
        return []
    return [b for b in graph_batch_sizes(max_bs) if b * verify_query_len <= VERIFY_MAX_TOKENS]


@dataclass(slots=True)
class _Graph:
    graph: torch.cuda.CUDAGraph
    hidden: torch.Tensor  # [bs * q_len, hidden_size], written by every replay (a device drafter reads it)
    logits: torch.Tensor  # [bs * q_len, vocab] fp32, written by every replay
    num_kv_splits: int | None


class DecodeGraphs:
    def __init__(
        self,
        model: CausalLM,
        kv: PagedKVStorage,
        *,
        max_bs: int,
        max_pages_per_seq: int,
        max_model_len: int,
        scratch_page: int,
        verify_query_len: int | None = None,
    ) -> None:
        """`verify_query_len` (speculative decoding: k+1): also capture verify batches of that many
        tokens a row, for the buckets whose tokens stay within `VERIFY_MAX_TOKENS`."""
        self.model = model
        self.kv = kv
        self.device = kv.k[0].device
        self.page_size = kv.page_size
        self.max_model_len = max_model_len
        self.scratch_page = scratch_page
        self.sizes = graph_batch_sizes(max_bs)
        self.max_bs = self.sizes[-1]
        self.verify_query_len = verify_query_len
        self.verify_sizes = verify_graph_sizes(max_bs, verify_query_len)
        tokens = max([self.max_bs] + [b * (verify_query_len or 1) for b in self.verify_sizes])
        b, d = self.max_bs, self.device
        self.input_ids = torch.zeros(tokens, dtype=torch.int64, device=d)
        self.positions = torch.zeros(tokens, dtype=torch.int64, device=d)
        self.slot_mapping = torch.full((tokens,), scratch_page * self.page_size, dtype=torch.int64, device=d)
        self.seq_lens = torch.ones(b, dtype=torch.int32, device=d)
        self.query_starts = {q: torch.arange(0, (b + 1) * q, q, dtype=torch.int32, device=d)
                             for q in {1, verify_query_len or 1}}
        self.logits_indices = torch.arange(tokens, dtype=torch.int64, device=d)
        self.step_query_start = torch.empty(b + 1, dtype=torch.int32, device=d)  # a step's own (`step_inputs`)
        self.page_table = torch.full((b, max_pages_per_seq), scratch_page, dtype=torch.int32, device=d)
        self.num_kv_heads = kv.k[0].shape[2]
        self.mla_heads = mla_query_heads(model)
        self._graphs: dict[tuple[int, int, int | None], _Graph] = {}
        self.pool: object | None = None

    def _split_variants(self, bs: int, q_len: int) -> list[int | None]:
        bounds = [c for c in CONTEXT_CLASSES if c < self.max_model_len] + [self.max_model_len]
        return list(
            dict.fromkeys(
                decode_kv_splits(bs, self.num_kv_heads, b, self.device, mla_heads=self.mla_heads, q_len=q_len)
                for b in bounds
            )
        )

    def _batch(self, bs: int, q_len: int, splits: int | None) -> ForwardBatch:
        tokens = bs * q_len
        attn = AttentionMetadata(
            page_size=self.page_size,
            query_start=GraphGuardList([0] * (bs + 1)),
            seq_lens=GraphGuardList([0] * bs),
            page_table=self.page_table[:bs],
            slot_mapping=self.slot_mapping[:tokens],
            max_query_len=q_len,
            max_seq_len=self.max_model_len,
            seq_lens_tensor=self.seq_lens[:bs],
            query_start_tensor=self.query_starts[q_len][: bs + 1],
            num_kv_splits=splits,
        )
        return ForwardBatch(
            input_ids=self.input_ids[:tokens],
            positions=self.positions[:tokens],
            attn=attn,
            logits_indices=self.logits_indices[:tokens],
        )

    def _forward(self, bs: int, q_len: int, splits: int | None) -> tuple[torch.Tensor, torch.Tensor]:
        hidden = self.model(self._batch(bs, q_len, splits), self.kv)
        return hidden, self.model.compute_logits(hidden)

    def _shapes(self) -> list[tuple[int, int]]:
        """(bucket, q_len) of every graph, largest first (they share one memory pool)."""
        shapes = [(bs, 1) for bs in self.sizes]
        if self.verify_query_len:
            shapes += [(bs, self.verify_query_len) for bs in self.verify_sizes]
        return sorted(shapes, key=lambda s: s[0] * s[1], reverse=True)

    def _capturable(self, bs: int, q_len: int) -> bool:
        """Probe: host-list reads raise NotCapturable, host synchronisations raise RuntimeError (sync
        debug mode); it also compiles the Triton kernels outside the capture."""
        previous_mode = torch.cuda.get_sync_debug_mode()
        try:
            torch.cuda.set_sync_debug_mode("error")
            for splits in self._split_variants(bs, q_len):
                self._forward(bs, q_len, splits)
        except (NotCapturable, RuntimeError) as exc:
            logger.warning("CUDA graphs of %d-token rows off: the model cannot run inside a graph (%s)", q_len, exc)
            return False
        finally:
            torch.cuda.set_sync_debug_mode(previous_mode)
            torch.cuda.synchronize(self.device)
        return True

    @torch.inference_mode()
    def capture(self) -> bool:
        """Capture every bucket; False (and eager decoding) when the model is not capturable. Verify
        graphs that fail their probe are left out (verify steps then run eagerly)."""
        torch.cuda.synchronize(self.device)
        if not self._capturable(self.max_bs, 1):
            return False
        if self.verify_sizes and not self._capturable(self.verify_sizes[-1], self.verify_query_len or 1):
            self.verify_sizes = []
        self.pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream(self.device)
        for bs, q_len in self._shapes():
            if q_len > 1 and bs not in self.verify_sizes:
                continue
            for splits in self._split_variants(bs, q_len):
                stream.wait_stream(torch.cuda.current_stream(self.device))
                with torch.cuda.stream(stream):
                    self._forward(bs, q_len, splits)  # warm-up on the capture stream (cuBLAS, Triton compiles)
                torch.cuda.current_stream(self.device).wait_stream(stream)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                    hidden, logits = self._forward(bs, q_len, splits)
                self._graphs[(bs, q_len, splits)] = _Graph(graph, hidden, logits, splits)
        torch.cuda.synchronize(self.device)
        logger.info("captured %d CUDA graphs: decode batch sizes %s, verify (%s tokens a row) %s", len(self._graphs),
                    self.sizes, self.verify_query_len, self.verify_sizes)
        return True

    def release(self) -> None:
        """Destroy the captured graphs, which returns their private memory pool to the allocator."""
        for entry in self._graphs.values():
            entry.graph.reset()
        self._graphs.clear()
        self.pool = None

    def bucket(self, num_rows: int, q_len: int = 1) -> int | None:
        """The captured batch size that runs `num_rows` rows of `q_len` tokens (None: run eagerly)."""
        if not self._graphs:
            return None
        if q_len > 1:
            if q_len != self.verify_query_len:
                return None
            return next((b for b in self.verify_sizes if b >= num_rows), None)
        return self.size_for(num_rows)

    def size_for(self, num_rows: int) -> int | None:
        """The bucket of `num_rows`, captured or not (None: larger than any bucket)."""
        if num_rows > self.max_bs:
            return None
        return next(b for b in self.sizes if b >= num_rows)

    def step_inputs(self, bs: int, q_len: int, width: int) -> StepInputs:
        """Where a step this graph runs puts its inputs (`staging.step_inputs`): the static buffers the graph
        reads, so `replay` copies nothing; query starts, constant in the graph, go to a buffer of their own."""
        tokens = bs * q_len
        return StepInputs(
            self.input_ids[:tokens], self.positions[:tokens], self.slot_mapping[:tokens], self.seq_lens[:bs],
            self.step_query_start[: bs + 1], self.page_table[:bs, :width],
        )  # fmt: skip

    def replay(self, batch: ForwardBatch, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Run the graph of `batch` (already padded to `bs` rows of the same token count) and its split
        count; (hidden states `[bs * q_len, hidden]`, fp32 logits `[bs * q_len, vocab]`)."""
        attn = batch.attn
        tokens = batch.num_tokens
        entry = self._graphs[(bs, tokens // bs, attn.num_kv_splits)]
        assert attn.seq_lens_tensor is not None
        pages = attn.page_table.shape[1]
        for static, given in (
            (self.input_ids[:tokens], batch.input_ids),
            (self.positions[:tokens], batch.positions),
            (self.slot_mapping[:tokens], attn.slot_mapping),
            (self.seq_lens[:bs], attn.seq_lens_tensor),
            (self.page_table[:bs, :pages], attn.page_table),
        ):
            if given.data_ptr() != static.data_ptr():  # not written in place by `step_inputs`
                static.copy_(given, non_blocking=True)
        entry.graph.replay()
        return entry.hidden, entry.logits
