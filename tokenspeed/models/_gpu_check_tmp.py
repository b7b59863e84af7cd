import sys, torch, tempfile, pathlib
sys.path.insert(0, ".")
print("torch", torch.__version__, "cuda", torch.cuda.is_available())
from tokenspeed.models import ModelConfig, build_model, load_weights
from tokenspeed.executor.forward_batch import RowSpec, build_forward_batch
from tokenspeed.executor.kv_storage import PagedKVStorage
from tokenspeed.kernels import describe_selection
print(describe_selection("attention", "paged", platform="cuda", dtype=torch.bfloat16))
raw = {"architectures": ["Qwen3ForCausalLM"], "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
       "num_attention_heads": 8, "num_key_value_heads": 2, "head_dim": 32, "vocab_size": 500,
       "max_position_embeddings": 256, "use_sliding_window": True, "sliding_window": 7, "max_window_layers": 1}
c = ModelConfig.from_dict(raw)
rows = [RowSpec(list(range(3, 3 + n)), 0, pages) for n, pages in ((17, [5, 2, 9, 0, 11]), (1, [4]), (30, [1, 3, 6, 7, 8, 10, 12, 13]))]
out = {}
for dev, dtype in (("cpu", torch.float32), ("cuda", torch.float32), ("cuda", torch.bfloat16)):
    m = build_model(c, dtype=dtype, device=dev)
    load_weights(m, None, "dummy", seed=0)
    # same weights on every device: copy from the cpu fp32 model
    if ("cpu", torch.float32) in out:
        with torch.no_grad():
            for (n, p), (_, q) in zip(m.named_parameters(), ref_model.named_parameters()):
                p.copy_(q)
    else:
        ref_model = m
    kv = PagedKVStorage(num_layers=2, num_pages=16, page_size=4, num_kv_heads=2, head_dim=32, dtype=dtype, device=dev)
    b = build_forward_batch(rows, 4, [16, 17, 47], device=dev)
    with torch.inference_mode():
        logits = m.compute_logits(m(b, kv)[b.logits_indices]).cpu()
    out[(dev, dtype)] = logits
    print(dev, dtype, logits.shape, logits.dtype)
base = out[("cpu", torch.float32)]
print("cuda fp32 max diff", (out[("cuda", torch.float32)] - base).abs().max().item(), "scale", base.abs().max().item())
print("cuda bf16 max diff", (out[("cuda", torch.bfloat16)] - base).abs().max().item())
g = build_model(c, dtype=torch.bfloat16, device="cuda"); load_weights(g, None, "dummy", seed=3)
h = build_model(c, dtype=torch.bfloat16, device="cuda"); load_weights(h, None, "dummy", seed=3)
print("cuda dummy deterministic", all(torch.equal(a, b) for a, b in zip(g.parameters(), h.parameters())))
