"""`SchedulerConfig`: the knobs of admission, batching and the page pool.

Validated at construction so that a configuration in which even one
max-length request could never fit the pool fails at start-up, with the
numbers, rather than as a request that waits forever.
"""

from __future__ import annotations

from dataclasses import dataclass

from tokenspeed.kvcache import KVTierConfig
from tokenspeed.scheduler.admission import AdmissionLimits
from tokenspeed.scheduler.speculation import DraftPolicy


@dataclass(slots=True)
class SchedulerConfig:
    max_num_seqs: int  # running streams per step (decode batch size)
    max_num_batched_tokens: int  # per-step token budget (decode rows + prefill chunks)
    max_model_len: int  # prompt + output tokens of one stream
    page_size: int
    num_pages: int
    enable_prefix_caching: bool = True
    seed: int = 0  # draws the sampling seed of requests that do not give one
    vocab_size: int | None = None  # token ids are range-checked on submit when known
    speculation: DraftPolicy | None = None  # speculative decoding (`spec.config.SpeculativeConfig`), off if None
    kv_tiers: KVTierConfig | None = None  # host / disk tiers and session retention below the device pool
    # "retract" (save the victim's KV to the host, resume by copying it back) or "recompute" (drop it);
    # None: retract when there is a host tier, else recompute.
    preemption_mode: str | None = None
    # Device -> host write-back copies emitted per step, at most: enough that a burst of evictions (a long
    # prompt's prefill) finds the pages it evicts already on the host.
    writeback_pages_per_step: int = 256

    def __post_init__(self) -> None:
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "page_size", "num_pages"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}.")
        has_host = self.kv_tiers is not None and self.kv_tiers.host_kv_cache_bytes > 0
        if self.preemption_mode is None:
            self.preemption_mode = "retract" if has_host else "recompute"
        if self.preemption_mode not in ("retract", "recompute"):
            raise ValueError(f"preemption_mode must be 'retract' or 'recompute', got {self.preemption_mode!r}.")
        if self.preemption_mode == "retract" and not has_host:
            raise ValueError("preemption_mode='retract' saves KV to the host tier: set host_kv_cache_bytes > 0.")
        if self.writeback_pages_per_step < 0:
            raise ValueError(f"writeback_pages_per_step must be >= 0, got {self.writeback_pages_per_step}.")
        pages_per_request = -(-self.max_model_len // self.page_size)
        if pages_per_request > self.num_pages:
            raise ValueError(
                f"num_pages={self.num_pages} cannot hold one request of max_model_len={self.max_model_len}: "
                f"that needs ceil({self.max_model_len}/{self.page_size}) = {pages_per_request} pages "
                f"of {self.page_size} tokens."
            )

    @property
    def limits(self) -> AdmissionLimits:
        return AdmissionLimits(
            max_model_len=self.max_model_len,
            max_num_seqs=self.max_num_seqs,
            page_size=self.page_size,
            num_kv_pages=self.num_pages,
            vocab_size=self.vocab_size,
            refuse_overlong_max_tokens=False,
        )
