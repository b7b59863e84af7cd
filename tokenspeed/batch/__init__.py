"""Records of one model step, shared by kernels, layers, models and the executor (see `forward_batch.py`)."""

from tokenspeed.batch.forward_batch import (
    AttentionMetadata,
    ForwardBatch,
    GraphGuardList,
    HostBatch,
    NotCapturable,
)
from tokenspeed.batch.kv_storage import PagedKVStorage

__all__ = ["AttentionMetadata", "ForwardBatch", "GraphGuardList", "HostBatch", "NotCapturable", "PagedKVStorage"]
