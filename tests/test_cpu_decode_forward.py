"""The CPU decode forward (`executor/cpu_decode.py`) equals the model's eager layers bit for bit, on
decode-only steps and on steps with prompt chunks (prefill, mixed), and the engine's greedy tokens are
the same with it on and off (`disable_cpu_decode_forward`, `disable_cpu_prefill_forward`).

Bit for bit with GEMM prepacking off, its decode rows on the gather + SDPA path
(`paged_attention=False`) and the torch elementwise ops (`fused_ops=False`; the fused C ops are
`test_cpu_fused.py`'s). Each fast path sums in another order: GEMM prepacking (`executor/cpu_linear.py`,
oneDNN kernels) is compared within 1e-5 relative, the native paged kernel (`decode_paged_cpu`, the
default where a C compiler works) within fp32 rounding (`test_paged_attention_*`), and the engine's
greedy tokens with each on and off (`disable_cpu_gemm_prepack`, `disable_cpu_paged_attention`)."""

from __future__ import annotations

import random

import pytest
import torch

from tests.checkpoints import prompts
from tests.native_helpers import without_a_compiler
from tokenspeed import LLM, SamplingParams
from tokenspeed.batch.kv_storage import PagedKVStorage
from tokenspeed.executor import cpu_linear
from tokenspeed.executor.batch_builder import RowSpec, build_forward_batch
from tokenspeed.executor.cpu_decode import CPUDecodeForward
from tokenspeed.kernels import cpu_small_gemm, scoped_kernel_overrides
from tokenspeed.kernels.attention import decode_paged_cpu
from tokenspeed.models import ModelConfig, build_model, load_weights

PAGE_SIZE = 16
native = decode_paged_cpu.load_library() is not None  # a C compiler for the native paged decode kernel


def _model(folder):
    config = ModelConfig.from_pretrained(folder)
    model = build_model(config, dtype=torch.float32, device=torch.device("cpu"))
    load_weights(model, folder, load_format="auto")
    return model.eval(), config


def _kv(config: ModelConfig, num_pages: int, seed: int) -> PagedKVStorage:
    kv = PagedKVStorage(num_layers=config.num_layers, num_pages=num_pages, page_size=PAGE_SIZE,
                        num_kv_heads=config.num_kv_heads, head_dim=config.head_dim, dtype=torch.float32, device="cpu")
    gen = torch.Generator().manual_seed(seed)
    for cache in (*kv.k, *kv.v):
        cache.copy_(torch.randn(cache.shape, generator=gen))
    return kv


def _pools_and_forward(model, config: ModelConfig, num_pages: int, seed: int, prepack: bool = False,
                       paged_attention: bool = False, fused_ops: bool = False):
    """Two K/V pools with the same random history (the eager layers', the CPU forward's) and the CPU forward
    built on the second (GEMM prepacking off unless `prepack`, decode rows gathered for SDPA unless
    `paged_attention`, torch elementwise ops unless `fused_ops`: bit-equal to the layers)."""
    eager_kv, fast_kv = _kv(config, num_pages, seed), _kv(config, num_pages, seed)
    fast = CPUDecodeForward.build(model, fast_kv, prepack=prepack, paged_attention=paged_attention,
                                  fused_ops=fused_ops)
    assert fast is not None and fast.paged_attention == bool(paged_attention)
    assert (fast.fused is not None) == bool(fused_ops)
    return eager_kv, fast_kv, fast


def _rows_batch(config: ModelConfig, rows: list[tuple[int, int]], seed: int):
    """A batch of rows (cached prefix, new tokens) of random tokens in scattered pages, and its page count."""
    num_pages = sum(-(-(a + b) // PAGE_SIZE) for a, b in rows) + 3
    pool = list(range(num_pages))
    random.Random(len(rows)).shuffle(pool)
    specs, used, logits, tokens = [], 0, [], 0
    rng = random.Random(seed)
    for prefix, new in rows:
        pages = pool[used : used + -(-(prefix + new) // PAGE_SIZE)]
        used += len(pages)
        specs.append(RowSpec([rng.randrange(config.vocab_size) for _ in range(new)], prefix, pages))
        tokens += new
        logits.append(tokens - 1)
    return build_forward_batch(specs, PAGE_SIZE, logits_indices=logits), num_pages


def _assert_same_kv(eager_kv: PagedKVStorage, fast_kv: PagedKVStorage, *, close: bool = False) -> None:
    """Equal pools (`close`: within fp32 rounding: a layer's K/V come from the last one's attention)."""
    for a, b in zip((*eager_kv.k, *eager_kv.v), (*fast_kv.k, *fast_kv.v)):
        if close:
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
        else:
            assert torch.equal(a, b)


def _assert_equals_layers_bitwise(model, config: ModelConfig, batch, num_pages: int) -> None:
    """The CPU forward takes `batch`, and its hidden states and written K/V are the eager layers', bit for bit;
    with the native paged kernel for its decode rows (where it builds), the same K/V and hidden states
    within fp32 rounding (the last layer's attention output feeds the states: 1e-5)."""
    eager_kv, fast_kv, fast = _pools_and_forward(model, config, num_pages, 1)
    assert fast.serves(batch)
    with torch.inference_mode():
        expected = model(batch, eager_kv)
        got = fast.run(batch)
    assert torch.equal(got, expected)
    _assert_same_kv(eager_kv, fast_kv)
    if not native:
        return
    _, paged_kv, paged = _pools_and_forward(model, config, num_pages, 1, paged_attention=True)
    with torch.inference_mode():
        got = paged.run(batch)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    _assert_same_kv(eager_kv, paged_kv, close=True)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("lengths", [[1], [37], [16, 5, 70, 33]])
def test_decode_forward_equals_layers_bitwise(checkpoints, family: str, lengths: list[int]) -> None:
    """Hidden states and every layer's written K/V are equal to the eager layers', bit for bit (random K/V
    history in scattered pages; lengths on and off page boundaries)."""
    model, config = _model(checkpoints[family])
    num_pages = sum(-(-n // PAGE_SIZE) for n in lengths) + 3
    pool = list(range(num_pages))
    random.Random(len(lengths)).shuffle(pool)
    rows, used = [], 0
    rng = random.Random(5)
    for n in lengths:
        pages = pool[used : used + -(-n // PAGE_SIZE)]
        used += len(pages)
        rows.append(RowSpec([rng.randrange(config.vocab_size)], n - 1, pages))
    batch = build_forward_batch(rows, PAGE_SIZE, logits_indices=range(len(rows)))
    _assert_equals_layers_bitwise(model, config, batch, num_pages)


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("rows", [
    [(0, 37)],  # a prompt from position 0: causal on its own K/V
    [(0, 130)],
    [(20, 30)],  # a chunk after a cached prefix (off a page boundary)
    [(32, 17)],
    [(40, 100)],  # causal query blocks after a cached prefix
    [(0, 40), (33, 1), (0, 1), (64, 17)],  # mixed: prompt chunks and decodes
    [(16, 1), (5, 1), (48, 64)],
])
def test_prompt_steps_equal_layers_bitwise(checkpoints, family: str, rows: list[tuple[int, int]]) -> None:
    """Steps with prompt chunks (rows of (cached prefix, new tokens)): hidden states and written K/V equal to
    the eager layers' (extend kernel, decodes batched), bit for bit."""
    model, config = _model(checkpoints[family])
    batch, num_pages = _rows_batch(config, rows, seed=5)
    _assert_equals_layers_bitwise(model, config, batch, num_pages)


@pytest.mark.parametrize("paged", [False, pytest.param(True, marks=pytest.mark.skipif(not native, reason="no cc"))])
@pytest.mark.parametrize("rows", [[(0, 130)], [(20, 30)], [(0, 40), (33, 1), (0, 1), (64, 17)]])
def test_logits_rows_close_to_layers(checkpoints, rows: list[tuple[int, int]], paged: bool) -> None:
    """`run(logits_rows=True)` (the last layer for the logits rows alone on prompt steps): K/V bit for bit,
    the rows' hidden states and logits within fp32 rounding of the layers', the same argmax; with every
    position scored (prompt logprobs) the whole layer runs and the rows are the layers' bit for bit
    (within fp32 rounding where the native paged kernel attends the decode rows: `paged`)."""
    model, config = _model(checkpoints["qwen3"])
    num_pages = sum(-(-(a + b) // PAGE_SIZE) for a, b in rows) + 3
    specs, used, last, tokens = [], 0, [], 0
    rng = random.Random(7)
    for prefix, new in rows:
        pages = list(range(used, used + -(-(prefix + new) // PAGE_SIZE)))
        used += len(pages)
        specs.append(RowSpec([rng.randrange(config.vocab_size) for _ in range(new)], prefix, pages))
        tokens += new
        last.append(tokens - 1)
    for logits_indices, pruned in ((last, True), (list(range(tokens)), False)):
        batch = build_forward_batch(specs, PAGE_SIZE, logits_indices=logits_indices)
        eager_kv, fast_kv, fast = _pools_and_forward(model, config, num_pages, 2, paged_attention=paged)
        with torch.inference_mode():
            expected = model(batch, eager_kv).index_select(0, batch.logits_indices)
            got = fast.run(batch, logits_rows=True)
            want_logits, got_logits = model.compute_logits(expected), model.compute_logits(got)
        _assert_same_kv(eager_kv, fast_kv, close=paged)
        if pruned or paged:
            torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-4)
            torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-4)
            assert torch.equal(got_logits.argmax(-1), want_logits.argmax(-1))
        else:
            assert torch.equal(got, expected)


@pytest.mark.parametrize("paged", [False, pytest.param(True, marks=pytest.mark.skipif(not native, reason="no cc"))])
def test_chunk_without_logits_rows(checkpoints, paged: bool) -> None:
    """A prompt chunk that samples nothing (chunked prefill): no rows back, the layers' K/V (within fp32
    rounding where the native paged kernel attends the prompt's tokens: `paged`)."""
    model, config = _model(checkpoints["qwen3"])
    batch = build_forward_batch([RowSpec(list(range(3, 43)), 0, [1, 2, 3])], PAGE_SIZE, logits_indices=[])
    eager_kv, fast_kv, fast = _pools_and_forward(model, config, 5, 3, paged_attention=paged)
    with torch.inference_mode():
        model(batch, eager_kv)
        assert fast.run(batch, logits_rows=True).shape == (0, config.hidden_size)
    _assert_same_kv(eager_kv, fast_kv, close=paged)


def test_serves_what_the_layers_send_to_extend_or_decode(checkpoints) -> None:
    """Rows of one equal length up to 16 tokens take the verify kernel in the layers: those run eagerly;
    each switch leaves its kind of step to the layers."""
    model, config = _model(checkpoints["qwen3"])
    kv = _kv(config, 8, 0)

    def batch(lengths):
        rows = [RowSpec(list(range(3, 3 + n)), 0, [2 * i, 2 * i + 1]) for i, n in enumerate(lengths)]
        return build_forward_batch(rows, PAGE_SIZE, logits_indices=[0])

    both = CPUDecodeForward.build(model, kv)
    assert both is not None
    assert both.serves(batch([1, 1])) and both.serves(batch([20])) and both.serves(batch([5, 1]))
    assert not both.serves(batch([5, 5])) and not both.serves(batch([3]))
    decode_only = CPUDecodeForward.build(model, kv, prefill=False)
    assert decode_only is not None and decode_only.serves(batch([1])) and not decode_only.serves(batch([20]))
    prefill_only = CPUDecodeForward.build(model, kv, decode=False)
    assert prefill_only is not None and not prefill_only.serves(batch([1])) and prefill_only.serves(batch([20]))
    assert CPUDecodeForward.build(model, kv, decode=False, prefill=False) is None


def test_weights_past_the_prepack_budget_stay_unpacked(checkpoints, monkeypatch) -> None:
    """The packed weights are a second copy: a model past `PREPACK_MAX_BYTES` runs on its own weights."""
    import tokenspeed.executor.cpu_decode as cpu_decode

    model, config = _model(checkpoints["qwen3"])
    packed = CPUDecodeForward.build(model, _kv(config, 8, 0))
    assert packed is not None and any(w.gate_up.packed is not None for w in packed.layers)
    monkeypatch.setattr(cpu_decode, "PREPACK_MAX_BYTES", 1024)
    unpacked = CPUDecodeForward.build(model, _kv(config, 8, 0))
    assert unpacked is not None and unpacked.lm_head is None
    assert all(lin.packed is None for w in unpacked.layers for lin in (w.qkv, w.o_proj, w.gate_up, w.down))


def test_not_built_where_its_kernels_do_not_run(checkpoints) -> None:
    """A kernel override (or biases: qwen2) keeps every step on the model's layers."""
    folder = checkpoints["llama"]
    with scoped_kernel_overrides([("attention", "decode", "reference")]):
        model, config = _model(folder)
    assert CPUDecodeForward.build(model, _kv(config, 4, 0)) is None
    model, config = _model(checkpoints["qwen2"])
    assert CPUDecodeForward.build(model, _kv(config, 4, 0)) is None


def _greedy(folder, **engine_args) -> tuple[list[list[int]], dict[str, int]]:
    llm = LLM(str(folder), skip_tokenizer_init=True, show_progress=False, **engine_args)
    runner = llm.core.executor.runner
    calls = {"decode": 0, "prompt": 0}
    if runner.cpu_decode is not None:
        run = runner.cpu_decode.run

        def counted(batch, **kwargs):
            calls["decode" if batch.attn.max_query_len == 1 else "prompt"] += 1
            return run(batch, **kwargs)

        runner.cpu_decode.run = counted
    work = [{"prompt_token_ids": p} for p in prompts(5, seed=11, min_len=3, max_len=60)]
    out = llm.generate(work, SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True), use_tqdm=False)
    llm.shutdown()
    return [list(o.outputs[0].token_ids) for o in out], calls


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engine_greedy_tokens_same_on_and_off(checkpoints, family: str) -> None:
    on, calls = _greedy(checkpoints[family])
    no_decode, no_decode_calls = _greedy(checkpoints[family], disable_cpu_decode_forward=True)
    no_prefill, no_prefill_calls = _greedy(checkpoints[family], disable_cpu_prefill_forward=True)
    off, off_calls = _greedy(checkpoints[family], disable_cpu_decode_forward=True, disable_cpu_prefill_forward=True)
    # both kinds of step did take it, and each switch turns its kind off
    assert calls["decode"] > 10 and calls["prompt"] >= 1
    assert no_decode_calls == {"decode": 0, "prompt": calls["prompt"]}
    assert no_prefill_calls == {"decode": calls["decode"], "prompt": 0}
    assert off_calls == {"decode": 0, "prompt": 0}
    assert on == no_decode == no_prefill == off


def test_engine_greedy_tokens_same_with_cached_prefixes_and_chunks(checkpoints) -> None:
    """Prompts sharing a prefix (cached chunks), chunked prefill mixed with running decodes: same tokens
    with the forward on and off."""
    rng = random.Random(3)
    shared = [rng.randrange(3, 200) for _ in range(40)]
    work = [{"prompt_token_ids": shared + [rng.randrange(3, 200) for _ in range(n)]} for n in (5, 30, 70, 90)]

    def run(**engine_args):
        llm = LLM(str(checkpoints["qwen3"]), skip_tokenizer_init=True, show_progress=False,
                  max_num_batched_tokens=48, **engine_args)
        out = llm.generate(work, SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True), use_tqdm=False)
        llm.shutdown()
        return [list(o.outputs[0].token_ids) for o in out]

    assert run() == run(disable_cpu_decode_forward=True, disable_cpu_prefill_forward=True)


def test_embedded_model_greedy_tokens_same_on_and_off() -> None:
    def run(**engine_args):
        llm = LLM(show_progress=False, **engine_args)
        assert (llm.core.executor.runner.cpu_decode is None) == bool(engine_args)  # both switches: none built
        out = llm.generate(["def fib(n):", "Write a haiku about caches."],
                           SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
        llm.shutdown()
        return [o.outputs[0].token_ids for o in out]

    assert run() == run(disable_cpu_decode_forward=True, disable_cpu_prefill_forward=True)


# ---- GEMM prepacking on (`cpu_linear.py`): oneDNN kernels, fp32 rounding instead of bit equality ----


@pytest.fixture
def pack_from_one_row(monkeypatch):
    """Every weight packed and run packed from one row (the tiny checkpoints' weights are below the sizes
    where packing pays, so the default would keep their decode steps on `F.linear`)."""
    if cpu_linear.pack(torch.ones(8, 8)).packed is None:
        pytest.skip("this torch has no oneDNN packed linear")
    monkeypatch.setattr(cpu_linear, "ROWS_MIN_BY_SIZE", ((0, 1),))
    monkeypatch.setenv(cpu_small_gemm.ENV_SWITCH, "0")  # oneDNN's kernel, not the native one for few rows


@pytest.mark.parametrize("family", ["llama", "qwen3"])
@pytest.mark.parametrize("rows", [
    [(0, 1)],
    [(36, 1)],
    [(15, 1), (4, 1), (69, 1), (32, 1)],  # decode rows
    [(0, 40), (33, 1), (0, 1), (64, 17)],  # mixed prompt chunks and decodes
    [(0, 130)],
])
def test_prepacked_gemms_close_to_layers(checkpoints, pack_from_one_row, family: str,
                                         rows: list[tuple[int, int]]) -> None:
    """Packed GEMMs (every weight, from one row): hidden states and written K/V within 1e-5 relative of the
    eager layers', the LM head (`logits`) too, and the same argmax."""
    model, config = _model(checkpoints[family])
    batch, num_pages = _rows_batch(config, rows, seed=9)
    eager_kv, fast_kv, fast = _pools_and_forward(model, config, num_pages, 4, prepack=True)
    assert all(w.qkv.packed is not None and w.down.packed is not None for w in fast.layers)
    assert fast.lm_head is not None and fast.lm_head.packed is not None
    assert fast.serves(batch)
    qkv, calls = fast.layers[0].qkv, []
    op = qkv._op
    qkv._op = lambda *args: calls.append(1) or op(*args)
    with torch.inference_mode():
        expected = model(batch, eager_kv)
        got = fast.run(batch)
        want_logits = model.compute_logits(expected.index_select(0, batch.logits_indices))
        got_logits = fast.logits(got.index_select(0, batch.logits_indices))
    assert calls == [1]  # the packed kernel ran
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    for a, b in zip((*eager_kv.k, *eager_kv.v), (*fast_kv.k, *fast_kv.v)):
        torch.testing.assert_close(b, a, rtol=1e-5, atol=1e-5 * float(a.abs().max()))
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5 * float(want_logits.abs().max()))
    assert torch.equal(got_logits.argmax(-1), want_logits.argmax(-1))


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engine_greedy_tokens_same_with_prepack_on_and_off(checkpoints, pack_from_one_row, family: str) -> None:
    on, calls = _greedy(checkpoints[family])
    off, _ = _greedy(checkpoints[family], disable_cpu_gemm_prepack=True)
    assert calls["decode"] > 10 and calls["prompt"] >= 1
    assert on == off


def test_embedded_model_prepack(monkeypatch) -> None:
    """The embedded model at the default thresholds: the LM head and gate_up packed from 2 rows, qkv / o_proj / down
    from 8; the same greedy tokens with prepacking on, off (flag) and off (env)."""

    def run(**engine_args):
        llm = LLM(show_progress=False, **engine_args)
        fast = llm.core.executor.runner.cpu_decode
        assert fast is not None
        layer = fast.layers[0]
        packed = (fast.lm_head is not None, layer.gate_up.packed is not None, layer.qkv.packed is not None)
        out = llm.generate(["def fib(n):", "Write a haiku about caches.", "import os\n", "class Cache:"],
                           SamplingParams(temperature=0.0, max_tokens=32), use_tqdm=False)
        llm.shutdown()
        return [o.outputs[0].token_ids for o in out], packed

    if cpu_linear.pack(torch.ones(8, 8)).packed is None:
        pytest.skip("this torch has no oneDNN packed linear")
    on, packed = run()
    assert packed == (True, True, True)
    assert (layer_rows := (cpu_linear.rows_min(torch.empty(1152, 256)), cpu_linear.rows_min(torch.empty(384, 256)))) \
        == (2, cpu_linear.SMALL_WEIGHT_ROWS), layer_rows
    off, unpacked = run(disable_cpu_gemm_prepack=True)
    assert unpacked == (False, False, False)
    monkeypatch.setenv(cpu_linear.ENV_SWITCH, "0")
    env_off, env_unpacked = run()
    assert env_unpacked == (False, False, False)
    assert on == off == env_off


@pytest.mark.skipif(not native, reason="no C compiler for the native paged decode kernel")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_engine_greedy_tokens_same_with_paged_attention_on_and_off(checkpoints, monkeypatch, family: str) -> None:
    """The native paged kernel is the default where it builds; its greedy tokens are the gather + SDPA
    path's (`disable_cpu_paged_attention`)."""
    monkeypatch.delenv("TOKENSPEED_CPU_ATTENTION_NATIVE", raising=False)
    llm = LLM(str(checkpoints[family]), skip_tokenizer_init=True, show_progress=False)
    assert llm.core.executor.runner.cpu_decode.paged_attention
    llm.shutdown()
    on, calls = _greedy(checkpoints[family])
    off, off_calls = _greedy(checkpoints[family], disable_cpu_paged_attention=True)
    assert calls == off_calls and calls["decode"] > 10
    assert on == off


def test_paged_attention_switches_and_no_compiler(checkpoints, monkeypatch, tmp_path) -> None:
    """`TOKENSPEED_CPU_ATTENTION_NATIVE=0` and `paged_attention=False` keep the gather + SDPA path; where no
    C compiler works the kernel is unavailable and the forward falls back to it silently."""
    model, config = _model(checkpoints["qwen3"])
    kv = _kv(config, 4, 0)
    assert not CPUDecodeForward.build(model, kv, paged_attention=False).paged_attention
    monkeypatch.setenv("TOKENSPEED_CPU_ATTENTION_NATIVE", "0")
    assert not CPUDecodeForward.build(model, kv).paged_attention
    monkeypatch.delenv("TOKENSPEED_CPU_ATTENTION_NATIVE")
    without_a_compiler(monkeypatch, tmp_path, decode_paged_cpu.NATIVE)
    assert decode_paged_cpu.load_library() is None
    forward = CPUDecodeForward.build(model, kv)
    assert forward is not None and not forward.paged_attention


@pytest.mark.skipif(not native, reason="no C compiler for the native paged decode kernel")
@pytest.mark.parametrize("paged", [True, False])
def test_prompt_rows_through_the_native_prefill_kernel(checkpoints, paged: bool) -> None:
    """With the native paged kernels on, prompt chunks (from position 0 and after a cached prefix) attend
    through the prefill kernel, the decode rows through the decode kernel, within fp32 rounding of the
    layers; off, both keep SDPA (bit for bit: `test_prompt_steps_equal_layers_bitwise`)."""
    model, config = _model(checkpoints["qwen3"])
    batch, num_pages = _rows_batch(config, [(0, 40), (33, 1), (20, 70)], seed=9)
    eager_kv, fast_kv, fast = _pools_and_forward(model, config, num_pages, 4, paged_attention=paged)
    step = fast.prepare(batch)
    assert len(step.prompts) == 2 and all((row.plan is not None) == paged for row in step.prompts)
    assert step.decode is not None and (step.decode.plan is not None) == paged
    with torch.inference_mode():
        expected = model(batch, eager_kv)
        got = fast.run(batch)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5)
    _assert_same_kv(eager_kv, fast_kv, close=True)


@pytest.mark.skipif(cpu_small_gemm.load_library() is None, reason="no C compiler for the native small GEMM")
@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_small_gemm_close_to_layers_and_same_greedy_tokens(checkpoints, monkeypatch, family: str) -> None:
    """The native small GEMM (the default for 1-16 rows where it builds, the LM head too): decode and mixed
    steps within 1e-5 relative of the layers, and the engine's greedy tokens those of `F.linear`
    (`disable_cpu_gemm_prepack`) and of `TOKENSPEED_CPU_SMALL_GEMM=0`."""
    monkeypatch.delenv(cpu_small_gemm.ENV_SWITCH, raising=False)
    model, config = _model(checkpoints[family])
    batch, num_pages = _rows_batch(config, [(15, 1), (4, 1), (69, 1), (32, 1)], seed=9)
    eager_kv, fast_kv, fast = _pools_and_forward(model, config, num_pages, 4, prepack=True)
    assert all(lin.small is not None for w in fast.layers for lin in (w.qkv, w.o_proj, w.gate_up, w.down))
    assert fast.lm_head is not None and fast.lm_head.small is not None
    with torch.inference_mode():
        expected = model(batch, eager_kv)
        got = fast.run(batch)
        want_logits, got_logits = model.compute_logits(expected), fast.logits(got)
    torch.testing.assert_close(got, expected, rtol=1e-5, atol=1e-5 * float(expected.abs().max()))
    torch.testing.assert_close(got_logits, want_logits, rtol=1e-5, atol=1e-5 * float(want_logits.abs().max()))
    assert torch.equal(got_logits.argmax(-1), want_logits.argmax(-1))
    on, calls = _greedy(checkpoints[family])
    off, _ = _greedy(checkpoints[family], disable_cpu_gemm_prepack=True)
    monkeypatch.setenv(cpu_small_gemm.ENV_SWITCH, "0")
    env_off, _ = _greedy(checkpoints[family])
    assert calls["decode"] > 10 and on == off == env_off
