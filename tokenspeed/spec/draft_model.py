"""Draft-model drafting (`speculative_config={"method": "draft_model", "model": PATH, "num_speculative_tokens": k}`).

Any smaller causal LM the engine can load, with the target's tokenizer (its
vocabulary may be shorter than the target's padded one: the missing ids get
no probability). It is an ordinary model with an ordinary paged KV storage
of its own, on the target's page ids.

Catching up (`observe`): the draft model runs on the step's very batch (same
tokens, positions, pages), so its K/V follows the target's position for
position; rejected draft positions are rewritten later, as the target's are.
Proposing (`propose`): k one-token steps from the row's input token (the
last emitted one) at positions p .. p+k-1, each step's draft the next
step's input.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import torch

from tokenspeed.batch.kv_storage import PagedKVStorage
from tokenspeed.errors import InvalidRequest
from tokenspeed.executor.executor import load_model
from tokenspeed.executor.speculator import DraftRows, ProposedDrafts, StepTail
from tokenspeed.models import ModelConfig
from tokenspeed.models.quant_config import resolve_quantization
from tokenspeed.spec.draft_chain import DraftChain, draw_drafts, stack_drafts

if TYPE_CHECKING:
    from tokenspeed.batch.forward_batch import ForwardBatch
    from tokenspeed.executor.executor import Executor


class DraftModelDrafter:
    def __init__(self, executor: Executor, folder: str, *, progress: bool = False) -> None:
        path = Path(folder)
        if not (path / "config.json").is_file():
            raise InvalidRequest(f"speculative_config['model']: {folder} has no config.json (a draft model folder)")
        self.config = ModelConfig.from_pretrained(path)
        self.vocab_size = executor.model_config.vocab_size
        if self.config.vocab_size > self.vocab_size:
            raise InvalidRequest(f"draft model {folder} has a vocabulary of {self.config.vocab_size}, larger than the "
                                 f"target's {self.vocab_size}: it cannot share the target's tokenizer")
        if self.config.max_position_embeddings < executor.max_model_len:
            raise InvalidRequest(f"draft model {folder} reaches {self.config.max_position_embeddings} positions, "
                                 f"fewer than max_model_len {executor.max_model_len}")
        # An FP8 draft checkpoint loads as one (its quantization_config); the target's option is its own.
        self.model = load_model(self.config, path, load_format=executor.config.load_format, dtype=executor.dtype,
                                device=executor.device, seed=executor.config.seed, progress=progress,
                                fp8=resolve_quantization(self.config.raw, None))
        self.page_size = executor.config.page_size
        self.dtype, self.device = executor.kv_dtype, executor.device  # `dtype`: of the draft's KV pages
        self.kv: PagedKVStorage | None = None
        self.scratch_page = -1

    def _kv_args(self) -> dict[str, int]:
        heads, k_dim, v_dim = self.config.kv_cache_layout
        return dict(num_layers=self.config.num_hidden_layers, page_size=self.page_size, num_kv_heads=heads,
                    head_dim=k_dim, v_head_dim=v_dim)

    def kv_bytes_per_page(self) -> int:
        return PagedKVStorage.bytes_per_page(dtype=self.dtype, **self._kv_args())

    def allocate(self, num_pages: int) -> None:
        self.scratch_page = num_pages - 1
        self.kv = PagedKVStorage(num_pages=num_pages, dtype=self.dtype, device=self.device, **self._kv_args())

    def observe(self, batch: ForwardBatch, hidden: torch.Tensor, tail: StepTail) -> None:
        assert self.kv is not None, "allocate() first"
        self.model(batch, self.kv)

    def propose(self, batch: ForwardBatch, rows: DraftRows) -> ProposedDrafts:
        assert self.kv is not None, "allocate() first"
        chain = DraftChain.of_rows(batch, rows, self.scratch_page)
        token = batch.input_ids.index_select(0, rows.token_index)
        tokens: list[torch.Tensor] = []
        probs: list[torch.Tensor | None] = []
        for j in range(max(rows.num_draft_tokens)):
            step = chain.step(token, j, active_below=j)  # draft j + 1 from the token at position p + j
            logits = self.model.compute_logits(self.model(step, self.kv))
            if logits.shape[-1] < self.vocab_size:
                logits = torch.nn.functional.pad(logits, (0, self.vocab_size - logits.shape[-1]), value=float("-inf"))
            token, q = draw_drafts(logits, rows.specs, j)
            tokens.append(token)
            probs.append(q)
        token_ids, draft_probs = stack_drafts(tokens, probs)
        return ProposedDrafts(token_ids, draft_probs)
