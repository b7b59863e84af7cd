"""CUDA-graph plumbing that can be checked without a GPU: buckets, padding rows, the capture guard."""

from __future__ import annotations

import pytest
import torch

from tokenspeed.batch.forward_batch import GraphGuardList, NotCapturable
from tokenspeed.batch.kv_storage import PagedKVStorage
from tokenspeed.executor.batch_builder import RowSpec, StagingRing, build_host_batch, to_forward_batch
from tokenspeed.executor.cuda_graphs import VERIFY_MAX_TOKENS, graph_batch_sizes, verify_graph_sizes
from tokenspeed.models import ModelConfig, build_model, load_weights
from tokenspeed.scheduler.plan import PLACEHOLDER_TOKEN_ID


def test_bucket_sizes():
    assert graph_batch_sizes(1) == [1]
    assert graph_batch_sizes(20) == [1, 2, 4, 8, 16, 20]
    assert graph_batch_sizes(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    # verify graphs: the decode buckets whose k+1 tokens a row fit VERIFY_MAX_TOKENS (512)
    assert verify_graph_sizes(64, 5) == graph_batch_sizes(64)
    assert verify_graph_sizes(512, 16) == [1, 2, 4, 8, 16, 32]
    assert max(verify_graph_sizes(512, 9)) * 9 <= VERIFY_MAX_TOKENS < (max(verify_graph_sizes(512, 9)) + 16) * 9
    assert verify_graph_sizes(64, None) == []


def test_guard_list_knows_its_length_but_refuses_elements():
    guard = GraphGuardList([0, 0, 0])
    assert len(guard) == 3
    with pytest.raises(NotCapturable):
        guard[0]
    with pytest.raises(NotCapturable):
        list(guard)


def test_padding_rows_leave_real_rows_unchanged(checkpoints):
    """A decode batch padded with scratch-page rows gives the real rows the same logits."""
    config = ModelConfig.from_pretrained(checkpoints["llama"])
    model = build_model(config, dtype=torch.float32, device=torch.device("cpu"))
    load_weights(model, checkpoints["llama"])
    page_size, scratch = 4, 31
    kv = PagedKVStorage(num_layers=config.num_hidden_layers, num_pages=32, page_size=page_size,
                        num_kv_heads=config.num_key_value_heads, head_dim=config.head_dim,
                        dtype=torch.float32, device="cpu")
    for cache in (*kv.k, *kv.v):
        cache.normal_()
    rows = [RowSpec([5], 6, [0, 1]), RowSpec([9], 10, [2, 3, 4])]
    staging = StagingRing(torch.device("cpu"))

    def logits(pad: int) -> torch.Tensor:
        host = build_host_batch(rows, page_size, [0, 1], pad_rows_to=pad, scratch_page=scratch)
        batch = to_forward_batch(host, staging, page_size)
        with torch.inference_mode():
            return model.compute_logits(model(batch, kv))[:2]

    plain = logits(0)
    padded = logits(4)
    torch.testing.assert_close(padded, plain)
    host = build_host_batch(rows, page_size, [0, 1], pad_rows_to=4, scratch_page=scratch)
    assert host.slot_mapping[2:].tolist() == [scratch * page_size] * 2
    assert host.seq_lens.tolist() == [7, 11, 1, 1]


def test_placeholders_resolve_from_previous_samples():
    rows = [RowSpec([PLACEHOLDER_TOKEN_ID], 3, [0]), RowSpec([7, 8], 0, [1]), RowSpec([PLACEHOLDER_TOKEN_ID], 2, [2])]
    host = build_host_batch(rows, 4, [0, 2, 3], placeholder_source={"a": 1, "c": 0}, row_ids=["a", "b", "c"])
    batch = to_forward_batch(host, StagingRing(torch.device("cpu")), 4, torch.tensor([40, 41]))
    assert batch.input_ids.tolist() == [41, 7, 8, 40]
    assert batch.positions.tolist() == [3, 0, 1, 2]
    assert batch.attn.slot_mapping.tolist() == [3, 4, 5, 10]
    with pytest.raises(RuntimeError):
        build_host_batch(rows, 4, [0], placeholder_source={"a": 0}, row_ids=["a", "b", "c"])
