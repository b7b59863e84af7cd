"""Placement: how a model written for one device runs on N, decided by a compiler, not by hand.

- `placements.py`: `Replicate`, `Shard(dim)`, `Partial` over the parallel groups
  `ATTN_TP`, `ATTN_DP`, `DENSE_TP`, `MOE_TP_EP`;
- `parallel_config.py`: `ParallelConfig` (vLLM/SGLang option names, validation
  against the model and the machine) and the `Topology` it implies;
- `module_specs.py`, `model_graph.py`, `compiler.py`: each module kind's
  placement contract, the modules a model runs, and the compiler that inserts
  every collective (fusing all-reduce + residual add + RMSNorm into
  `comm.fused_allreduce_rmsnorm`); `plan_text.py` prints the plan;
- `weight_sharding.py`, `weight_inventory.py`, `sharded_reader.py`,
  `footprint.py`: which slice of each checkpoint tensor a rank holds, read
  without materialising the rest, and the bytes per rank;
- `process_groups.py`, `collectives.py`: torch.distributed groups (gloo on the
  CPU, NCCL on CUDA) and collectives that are no-ops at world size 1;
- `command.py`: `tokenspeed placement MODEL --tp N [--ep M] [--dp-attention]`.

- `rank_context.py`: the rank a model is being built for (layers whose split
  is not a plain size, vocab-parallel embedding/head and EP experts, read it).

Execution on N ranks: every family builds at local size
(`models/parallel/local_config.py`, `vocab.py`), loads only its slices
(`models/parallel/rank_model.py`) and runs the compiled op list
(`models/parallel/planned_model.py`); `executor/multi_rank.py` spawns the
ranks and hands them each step's plan. DP attention runs with one rank per
attention group (`executor/attention_ranks.py` places requests, the dim-0
gathers and scatters pad to equal shards); the all-to-all MoE backend is
compiled and printed but not executed yet.

Import the concrete modules directly: this package stays import-light.
"""
