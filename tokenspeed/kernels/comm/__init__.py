"""Communication kernels: `comm.fused_allreduce_rmsnorm` (the placement compiler's fused reduction).

Where a row-parallel output (`Partial`) meets a norm, the all-reduce, the
residual add and the RMSNorm are one op. REFERENCE: `torch.distributed`
all-reduce, then the norm (no collective at world size 1). PORTABLE (Triton,
cuda): reads every rank's addend straight from its buffer (peer memory, e.g.
symmetric memory over NVLink; on one GPU the slices of a stacked tensor stand
in for the peers), sums them, adds the residual and normalises in one pass.
The kernels take a `PartialSums` that says where the addends are.
"""
