"""`Executor`: everything of one engine replica that lives on its device.

It owns the model (built and loaded by `load_model`), the paged KV pool it
sizes from the memory budget, the decode CUDA graphs it captures, and the
`ModelRunner` that turns each plan into a forward pass and a sampling step.
The engine core sees only the `ModelExecutor` interface (`interface.py`):
`limits`, `launch(plan, previous) -> StepHandle`, `collect(handle)`; the
core calls `close()` when the engine shuts down, which frees all of it.

Construction order matters and is kept fixed: kernel overrides before the
model is built (layers choose their kernels in their constructors), the torch
seed before any weight is drawn, the memory check before anything is
allocated (`memory_check.py`), the KV pool after the weights (on a GPU it
takes what memory they leave, after a speculative drafter's weights: its
pages hold the target's K/V and the drafter's), graphs last (they capture
the pool).

`load_model` is a plain function of its arguments, so that a tensor-parallel
worker can build its own copy on its own device with the same call.
"""

from __future__ import annotations

import gc
import logging
import math
from collections.abc import Callable
from pathlib import Path

import torch

from tokenspeed.batch.kv_storage import PagedKVStorage
from tokenspeed.config import (
    EngineConfig,
    kv_cache_budget_bytes,
    parse_kernel_override,
    resolve_device,
    resolve_dtype,
    resolve_kv_cache_dtype,
)
from tokenspeed.errors import ContextTooLong, EngineDead, InvalidRequest
from tokenspeed.executor.attention_ranks import AttentionRanks
from tokenspeed.executor.cpu_decode import CPUDecodeForward
from tokenspeed.executor.cpu_threads import apply_cpu_threads
from tokenspeed.executor.cuda_graphs import DecodeGraphs, graph_batch_sizes, verify_graph_sizes
from tokenspeed.executor.kv_scale_calibration import calibrate_kv_scales
from tokenspeed.executor.kv_tiers import HostKVTier, default_host_kv_cache_bytes
from tokenspeed.executor.memory_check import check_fits, weight_bytes
from tokenspeed.executor.model_runner import ModelRunner, StepHandle
from tokenspeed.executor.rank_setup import RankSetup
from tokenspeed.executor.speculator import Speculator
from tokenspeed.kernels import check_override_environment, scoped_kernel_overrides
from tokenspeed.kvcache import KVLayout
from tokenspeed.layers.attention_backend import VERIFY_MAX_QUERY_LEN
from tokenspeed.layers.fp8_weights import fp8_weight_allocation
from tokenspeed.models import CausalLM, ModelConfig, build_model, load_weights
from tokenspeed.models.fp8_model import finish_fp8, prepare_fp8
from tokenspeed.models.parallel.footprint import weights_per_rank
from tokenspeed.models.parallel.local_config import local_model_config
from tokenspeed.models.parallel.rank_model import build_rank_model
from tokenspeed.models.parallel.sharded_reader import ReadStats
from tokenspeed.models.quant_config import Fp8Config, resolve_quantization
from tokenspeed.placement.placements import ParallelGroup
from tokenspeed.scheduler.plan import ExecutionPlan, ExecutionResult, ExecutorLimits

logger = logging.getLogger("tokenspeed.executor")

_MAX_GRAPH_BS = 512


def load_model(
    model_config: ModelConfig,
    weights: Path | None,
    *,
    load_format: str,
    dtype: torch.dtype,
    device: torch.device,
    seed: int = 0,
    progress: bool = False,
    fp8: Fp8Config | None = None,
) -> CausalLM:
    """The model of `model_config` on `device`, in eval mode, with its weights: read from the
    checkpoint folder `weights`, or seeded random ones when `load_format == "dummy"`; FP8 layers
    as `fp8` says (`models/fp8_model.py`)."""
    with fp8_weight_allocation(fp8 is not None and fp8.serialized):
        model = build_model(model_config, dtype=dtype, device=device)
    prepare_fp8(model, fp8)
    load_weights(model, weights, load_format=load_format, seed=seed, progress=progress, fp8=fp8)
    finish_fp8(model, fp8)
    model.eval()
    return model


def resolve_max_model_len(model_config: ModelConfig, wanted: int | None) -> int:
    """`max_model_len` as asked, or the model's limit when not asked; never past that limit."""
    limit = model_config.max_position_embeddings
    if wanted is None:
        return limit
    if wanted > limit:
        raise ContextTooLong(f"max_model_len {wanted} exceeds the model's max_position_embeddings ({limit}).")
    return wanted


class Executor:
    def __init__(
        self,
        config: EngineConfig,
        model_folder: Path,
        *,
        dummy_weights: bool = False,
        progress: bool = False,
        speculator: Callable[[Executor], Speculator] | None = None,
        rank: RankSetup | None = None,
    ) -> None:
        """`model_folder` holds the model's config.json (and its weights unless `dummy_weights`, as for
        a preset, or `config.load_format == "dummy"`). `speculator` builds speculative decoding's
        verifier and drafter once the target is loaded (`spec.build.speculator_factory`)."""
        self.config = config
        self._closed = False
        self.speculator: Speculator | None = None  # built once the target's weights are loaded
        self.model_config = ModelConfig.from_pretrained(model_folder)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.device, self.model_config.torch_dtype)
        self.max_model_len = resolve_max_model_len(self.model_config, config.max_model_len)
        # One rank of several (`multi_rank.py`): it holds its share of the weights and of the KV heads.
        self.rank = rank
        self.local_config = self.model_config
        if rank is not None:
            topology = config.parallel_config().validate_for_model(self.model_config)
            self.local_config = local_model_config(self.model_config, topology)
        self.fp8 = resolve_quantization(self.model_config.raw, config.quantization)
        self.kv_dtype = resolve_kv_cache_dtype(config.kv_cache_dtype, self.dtype)

        check_override_environment()
        with scoped_kernel_overrides(parse_kernel_override(item) for item in config.kernel_overrides):
            self._build(model_folder, dummy_weights=dummy_weights, progress=progress, speculator=speculator)

    def _build(
        self,
        model_folder: Path,
        *,
        dummy_weights: bool,
        progress: bool,
        speculator: Callable[[Executor], Speculator] | None,
    ) -> None:
        """Load the model, size and allocate the KV pool, capture CUDA graphs: every step that
        picks kernels, so it runs under this engine's kernel overrides."""
        config, rank = self.config, self.rank
        torch.manual_seed(config.seed)
        # Weights and the KV pool must fit before anything is allocated (memory_check.py). The
        # pool's size is known now unless a GPU's free memory sizes it; then its floor counts.
        one_request = self._pages_for_one_request()
        planned_pages = self._planned_num_pages()
        check_fits(
            weights=self._weight_bytes(),
            kv_cache=(max(planned_pages or 0, one_request) + 1) * self._bytes_per_page(),
            kv_what="the KV cache" if (planned_pages or 0) > one_request
            else f"the KV cache of one request of max_model_len {self.max_model_len}",
            device=self.device,
            dtype=self.dtype,
            gpu_memory_utilization=config.gpu_memory_utilization if planned_pages is None else None,
        )
        dummy = dummy_weights or config.load_format == "dummy"
        self._dummy_weights = dummy
        self.read_stats: ReadStats | None = None  # what this rank read of the checkpoint (several ranks)
        if rank is not None:
            self.model, self.read_stats = build_rank_model(
                self.model_config,
                None if dummy else model_folder,
                rank.groups,
                dtype=self.dtype,
                device=self.device,
                seed=config.seed,
                fp8=self.fp8,
            )
        else:
            self.model = load_model(
                self.model_config,
                None if dummy else model_folder,
                load_format="dummy" if dummy else config.load_format,
                dtype=self.dtype,
                device=self.device,
                seed=config.seed,
                progress=progress,
                fp8=self.fp8,
            )

        if self.device.type == "cpu":  # every front end: explicit --cpu-threads, else sized to the model
            apply_cpu_threads(config.cpu_threads, sum(p.numel() for p in self.model.parameters()))

        if speculator is not None:
            self.speculator = speculator(self)
        num_pages = self._resolve_num_pages()
        if rank is not None:
            num_pages = rank.agree_num_pages(num_pages)  # every rank's pool must hold the same page ids
        if self.speculator is not None:
            self.speculator.allocate(num_pages + 1)  # the drafter's pages mirror the pool's, scratch included
        kv_heads, k_dim, v_dim = self.local_config.kv_cache_layout
        self.kv = PagedKVStorage(
            num_layers=self.model_config.num_hidden_layers,
            num_pages=num_pages + 1,  # the last page is scratch for padded CUDA-graph rows
            page_size=config.page_size,
            num_kv_heads=kv_heads,
            head_dim=k_dim,
            v_head_dim=v_dim,
            dtype=self.kv_dtype,
            device=self.device,
        )
        self.runner = ModelRunner(
            self.model,
            self.kv,
            self.device,
            scratch_page=num_pages,
            graphs=self._capture_graphs(scratch_page=num_pages),
            max_model_len=self.max_model_len,
            graph_sizes=graph_batch_sizes(self._graph_max_bs()),
        )
        if config.calculate_kv_scales:  # before the drafter joins the runner: the target's layers only
            calibrate_kv_scales(self.runner, vocab_size=self.model_config.vocab_size,
                                max_tokens=min(self.max_model_len, num_pages * config.page_size), seed=config.seed)
        self.runner.speculation = self.speculator
        if self.device.type == "cpu" and rank is None and self.speculator is None:
            self.runner.cpu_decode = CPUDecodeForward.build(
                self.model, self.kv, decode=not config.disable_cpu_decode_forward,
                prefill=not config.disable_cpu_prefill_forward,
                prepack=False if config.disable_cpu_gemm_prepack else None,
                paged_attention=False if config.disable_cpu_paged_attention else None,
                fused_ops=False if config.disable_cpu_fused_ops else None,
            )
        if rank is not None and rank.groups.topology.dp_attention:
            topology = rank.groups.topology
            self.runner.attention_ranks = AttentionRanks(topology.attn_dp, config.page_size)
            self.runner.attention_rank = topology.coordinate(ParallelGroup.ATTN_DP, rank.rank)
        self.runner.verify_query_len = self._verify_query_len()
        self.kv_layout = self._kv_layout()
        self.tiers = self._open_host_tier()
        if self.speculator is not None and self.runner.graphs is not None:
            self.speculator.capture_graphs(self.runner.graphs)  # a device drafter's own graphs
        self._limits = ExecutorLimits(
            vocab_size=self.model_config.vocab_size,
            max_model_len=self.max_model_len,
            num_pages=num_pages,
            page_size=config.page_size,
            device=str(self.device),
            dtype=str(self.dtype).removeprefix("torch."),
            kv_layout=self.kv_layout,
            host_kv_cache_bytes=0 if self.tiers is None else self.tiers.num_slots * self.kv_layout.bytes_per_page,
        )
        logger.info(
            "executor ready: %s on %s (%s%s, KV %s), %d KV pages of %d tokens, max_model_len %d, CUDA graphs %s",
            self.model_config.architecture,
            self.device,
            self.dtype,
            "" if self.fp8 is None else ", fp8 weights",
            self.kv_dtype,
            num_pages,
            config.page_size,
            self.max_model_len,
            "on" if self.cuda_graphs_enabled else "off",
        )

    # ---- the ModelExecutor interface ----------------------------------------------------

    @property
    def limits(self) -> ExecutorLimits:
        return self._limits

    def launch(self, plan: ExecutionPlan, previous: StepHandle | None = None) -> StepHandle:
        if self._closed:
            raise EngineDead("The engine is shut down: its model and KV cache are freed.")
        if self.tiers is not None:
            self.tiers.run(plan.step_id, plan.copies)
        elif plan.copies:
            raise RuntimeError(f"plan {plan.step_id} carries KV tier copies, but this executor has no host tier")
        return self.runner.launch(plan, previous)

    def collect(self, handle: StepHandle) -> ExecutionResult:
        result = handle.result()
        if self.tiers is not None:
            result.completed_copies = self.tiers.finished(handle.plan.step_id, handle.plan.wait_for_copies)
        return result

    def close(self) -> None:
        """Free what this executor holds on its device: the CUDA graphs (and their memory pool),
        the KV pool, the weights. Nothing runs afterwards; a second call does nothing.

        Everything goes back to the allocator, and on a GPU the allocator's cache to the driver,
        so another engine can be built in the same process.
        """
        if self._closed:
            return
        self._closed = True
        if self.speculator is not None:
            self.speculator.release_graphs()
        if self.tiers is not None:
            self.tiers.close()
            self.tiers = None
        if self.runner.graphs is not None:
            self.runner.graphs.release()
        del self.runner, self.kv, self.model
        self.speculator = None  # a drafter's weights and K/V go with the target's
        gc.collect()  # layers may sit in reference cycles; their tensors must go now, not later
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            torch.cuda.empty_cache()

    # ---- construction --------------------------------------------------------------------

    @property
    def cuda_graphs_enabled(self) -> bool:
        return self.runner.graphs is not None

    @property
    def verify_shape(self) -> tuple[int, int | None] | None:
        """(drafts every verify row is padded to, the most tokens a verify step replays from a graph: None
        where verify graphs failed their probe), or None where verify rows run unpadded (the CPU, or no
        speculation). The scheduler prices a drafting step by it (`scheduler/speculation.py`). Without
        graphs (`enforce_eager`) steps are priced as the graphs would run them: graphs on and off then plan
        the same steps, and give the same tokens in bf16 too, where a token's rounding depends on the step
        that computed it."""
        q_len = self.runner.verify_query_len
        if q_len <= 1:
            return None
        graphs = self.runner.graphs
        sizes = graphs.verify_sizes if graphs is not None else verify_graph_sizes(self._graph_max_bs(), q_len)
        return q_len - 1, max(sizes) * q_len if sizes else None

    def _graph_max_bs(self) -> int:
        return min(self.config.cuda_graph_max_bs or _MAX_GRAPH_BS, self.config.max_num_seqs)

    def _verify_query_len(self) -> int:
        """k+1 of speculative decoding's verify batches, as graphs capture them (1: no speculation, or
        the CPU, where padding rows to it would only cost)."""
        if self.speculator is None or self.device.type != "cuda":
            return 1
        return min(self.speculator.max_draft_tokens + 1, VERIFY_MAX_QUERY_LEN)

    def _capture_graphs(self, *, scratch_page: int) -> DecodeGraphs | None:
        if self.device.type != "cuda" or self.config.enforce_eager:
            return None
        if self.rank is not None and self.rank.groups.topology.dp_attention:
            # each rank's batch (and its padded gathers) changes shape with the placement: not captured yet
            logger.info("CUDA graphs off: DP attention runs eagerly (enable_dp_attention)")
            return None
        q_len = self._verify_query_len()
        graphs = DecodeGraphs(
            self.model,
            self.kv,
            max_bs=self._graph_max_bs(),
            max_pages_per_seq=math.ceil(self.max_model_len / self.config.page_size),
            max_model_len=self.max_model_len,
            scratch_page=scratch_page,
            verify_query_len=q_len if q_len > 1 else None,
        )
        return graphs if graphs.capture() else None

    def _kv_layout(self) -> KVLayout:
        """What one device page's bytes are: sizes the host tier and fingerprints disk files."""
        kv_heads, k_dim, v_dim = self.local_config.kv_cache_layout
        return KVLayout(
            # Random weights differ by seed: their KV must never be read by another seed's engine.
            model=(self.config.model or "embedded") + (f"|dummy seed {self.config.seed}" if self._dummy_weights else ""),
            dtype=str(self.kv_dtype).removeprefix("torch."),  # the pages' own (fp8 with kv_cache_dtype fp8)
            page_size=self.config.page_size,
            num_layers=self.model_config.num_hidden_layers,
            bytes_per_page=PagedKVStorage.bytes_per_page(
                num_layers=self.model_config.num_hidden_layers,
                page_size=self.config.page_size,
                num_kv_heads=kv_heads,
                head_dim=k_dim,
                v_head_dim=v_dim,
                dtype=self.kv_dtype,
            ),
        )

    def _open_host_tier(self) -> HostKVTier | None:
        """The host tier's slots (pinned on a GPU), or None when it is off (0 bytes)."""
        config, layout = self.config, self.kv_layout
        wanted = config.host_kv_cache_bytes
        if self.rank is not None:  # each rank would need its own host slots, moved in lockstep: not yet
            if wanted:
                raise InvalidRequest("the KV host tier (host_kv_cache_bytes) with tensor_parallel_size > 1 "
                                     "is not supported yet.")
            return None
        host_bytes = default_host_kv_cache_bytes(self.device) if wanted is None else wanted
        num_slots = host_bytes // layout.bytes_per_page
        if host_bytes and not num_slots:
            raise InvalidRequest(f"host_kv_cache_bytes={host_bytes} cannot hold one KV page of {layout.bytes_per_page} bytes.")
        if not num_slots:
            return None
        if self.speculator is not None and self.speculator.kv_bytes_per_page():
            if wanted is None:  # the default tier gives way: a drafter with its own KV must start as asked
                logger.info("KV host tier off: it does not carry the speculative drafter's own KV")
                return None
            raise InvalidRequest("the KV host tier does not carry a speculative drafter's own KV: set "
                                 "host_kv_cache_bytes=0 with this speculative_config.")
        logger.info("KV host tier: %d slots of %d bytes (%.2f GiB)%s", num_slots, layout.bytes_per_page,
                    num_slots * layout.bytes_per_page / 1024**3,
                    f", disk tier in {config.kv_cache_dir}" if config.kv_cache_dir else "")
        return HostKVTier(self.kv, layout, num_slots, self.device, config.kv_cache_dir, eager=wanted is not None)

    def _weight_bytes(self) -> int:
        if self.rank is None:
            return weight_bytes(self.model_config, self.dtype, fp8=self.fp8)
        topology = self.rank.groups.topology
        share = weights_per_rank(
            self.model_config, topology, torch.empty((), dtype=self.dtype).element_size(), fp8=self.fp8
        )
        return share[self.rank.groups.rank].total_bytes

    def _pages_for_one_request(self) -> int:
        return math.ceil(self.max_model_len / self.config.page_size)

    def _bytes_per_page(self) -> int:
        """One page's K/V bytes: the target's, and a speculative drafter's own (on the same page ids)."""
        kv_heads, k_dim, v_dim = self.local_config.kv_cache_layout
        drafter = 0 if self.speculator is None else self.speculator.kv_bytes_per_page()
        return drafter + PagedKVStorage.bytes_per_page(
            num_layers=self.model_config.num_hidden_layers,
            page_size=self.config.page_size,
            num_kv_heads=kv_heads,
            head_dim=k_dim,
            v_head_dim=v_dim,
            dtype=self.kv_dtype,
        )

    def _budget_num_pages(self) -> int:
        """The pages the memory budget pays for, capped at what `max_num_seqs` requests could use."""
        useful_pages = self.config.max_num_seqs * self._pages_for_one_request() + 1
        return min(kv_cache_budget_bytes(self.config, self.device) // self._bytes_per_page(), useful_pages)

    def _planned_num_pages(self) -> int | None:
        """The pool's page count before the weights exist; None when a GPU's free memory decides it."""
        config = self.config
        if config.num_kv_pages is not None:
            return config.num_kv_pages
        if self.device.type == "cuda" and config.kv_cache_memory_bytes is None:
            return None
        return self._budget_num_pages()

    def _resolve_num_pages(self) -> int:
        """Enough pages for one max-length request at least; otherwise what the memory budget allows."""
        config = self.config
        one_request = self._pages_for_one_request()
        if config.num_kv_pages is not None:
            if config.num_kv_pages < one_request:
                raise InvalidRequest(
                    f"num_kv_pages={config.num_kv_pages} cannot hold one request of max_model_len "
                    f"{self.max_model_len} (needs {one_request} pages of {config.page_size})."
                )
            return config.num_kv_pages
        num_pages = self._budget_num_pages()
        if num_pages < one_request:
            raise InvalidRequest(
                f"The KV cache budget holds {num_pages} pages but one request of max_model_len "
                f"{self.max_model_len} needs {one_request}; lower max_model_len or raise the budget."
            )
        return int(num_pages)
