"""Pick the training backend from the config, and split batches across data-parallel ranks.

The RL loop calls `build_engine` for the actor and the reference model, and
`local_micro_batches` / `gather_per_token` around the engine calls; with one process
(the local backend, or fsdp without torchrun) the last two reduce to the single-rank plan.
"""

from __future__ import annotations

import warnings

import torch

from slipstream.batching.packing import scatter_per_token, select
from slipstream.batching.planner import DEFAULT_QUADRATIC_SCALE, plan_micro_batches
from slipstream.batching.records import PackedBatch
from slipstream.config.schema import ActorSection, parse_backend
from slipstream.engine.base import TrainEngine
from slipstream.engine.distributed import all_reduce_
from slipstream.engine.local import LocalEngine
from slipstream.models.parallelize import parallelize
from slipstream.models.transformer import Transformer


def build_engine(
    model: Transformer,
    device: torch.device,
    compute_dtype: torch.dtype,
    temperature: float,
    actor: ActorSection | None,
    *,
    forward_only: bool = False,
    offload: bool | None = None,
) -> TrainEngine:
    """LocalEngine, FSDPEngine or MegatronEngine according to `actor.backend`; `forward_only` builds a frozen reference.

    `offload=None` takes the actor section's setting: `offload_params` for the trainable
    engine, `offload_ref` for a forward-only one. `actor=None` means a forward-only local engine.
    """
    if actor is None:
        if not forward_only:
            raise ValueError("a trainable engine needs the actor config section (actor=None given)")
        return LocalEngine(model, device, compute_dtype, temperature)
    if offload is None:
        offload = actor.offload_ref if forward_only else actor.offload_params
    backend, layout = parse_backend(actor.backend)
    if actor.master_dtype != "float32" and not forward_only and (backend == "megatron" or compute_dtype != torch.bfloat16):
        raise ValueError(
            f"actor.master_dtype={actor.master_dtype} needs model.dtype=bfloat16 and the local or fsdp backend "
            f"(got compute dtype {compute_dtype}, backend {backend!r}); the megatron backend keeps fp32 master weights"
        )
    if backend == "megatron":
        from slipstream.engine.megatron.engine import MegatronEngine  # megatron-core only when asked for

        if offload:
            raise ValueError(
                "actor.offload_params / actor.offload_ref are not supported by the megatron backend "
                "(megatron-core 0.16.1's DistributedOptimizer.offload_to_cpu fails on CUDA); set them to false "
                "or use actor.backend=fsdp"
            )
        if actor.compile:
            warnings.warn("actor.compile: the megatron engine does not torch.compile its blocks", stacklevel=2)
        return MegatronEngine(
            model, device, compute_dtype, temperature, None if forward_only else actor, layout=layout
        )
    if backend == "fsdp":
        from slipstream.engine.fsdp import FSDPEngine  # torch.distributed only when asked for

        return FSDPEngine(
            model, device, compute_dtype, temperature, None if forward_only else actor,
            activation_checkpointing="none" if forward_only else actor.activation_checkpointing,
            compile=actor.compile,
            offload=offload,
        )  # fmt: skip
    if offload:
        warnings.warn("parameter offload needs actor.backend='fsdp'; ignored by the local backend", stacklevel=2)
    if forward_only:
        if actor.compile:
            parallelize(model, compile=True)
        return LocalEngine(model, device, compute_dtype, temperature)
    # Checkpointing and compile work without sharding too (mesh=None).
    parallelize(model, activation_checkpointing=actor.activation_checkpointing, compile=actor.compile)
    return LocalEngine(model, device, compute_dtype, temperature, actor=actor)


def _empty_micro_batch(like: PackedBatch) -> PackedBatch:
    """A one-token sequence with no loss token, carrying the same optional fields as `like`.

    Ranks whose share of the plan has fewer sequences than micro-batches run it so every rank
    makes the same FSDP collectives; it adds 0 to the loss, the gradient and the counts.
    """
    long = torch.zeros(1, dtype=torch.int64)
    zero = torch.zeros(1, dtype=torch.float32)
    optional = {
        name: (None if getattr(like, name) is None else zero.clone())
        for name in ("old_logprobs", "ref_logprobs", "behav_logprobs")
    }
    return PackedBatch(
        input_ids=long.clone(),
        position_ids=long.clone(),
        cu_seqlens=torch.tensor([0, 1], dtype=torch.int32),
        max_seqlen=1,
        targets=long.clone(),
        loss_mask=torch.zeros(1, dtype=torch.bool),
        seq_index=long.clone(),
        advantages=zero.clone(),
        sample_ids=(),
        **optional,
    )


def local_micro_batches(
    batch: PackedBatch,
    cap: int,
    planner: str = "kk",
    rank: int = 0,
    world: int = 1,
    quadratic_scale: float = DEFAULT_QUADRATIC_SCALE,
) -> tuple[list[PackedBatch], list[tuple[int, ...]]]:
    """This rank's micro-batches of `batch` under a plan balanced over `world` ranks, and their sequence ids.

    Every rank gets the same number of micro-batches (empty ones are replaced by a no-loss
    one-token micro-batch with no sequence ids), as FSDP requires. The ids index `batch`'s
    sequences, for `gather_per_token` / `scatter_per_token`.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} out of range for world size {world}")
    plan = plan_micro_batches(
        batch.seq_lens(), cap, num_ranks=world, algorithm=planner, quadratic_scale=quadratic_scale
    )
    ids_per_mb = list(plan.assignments[rank])
    mbs = [select(batch, ids) if ids else _empty_micro_batch(batch) for ids in ids_per_mb]
    return mbs, ids_per_mb


def gather_per_token(
    values_per_mb: list[torch.Tensor], ids_per_mb: list[tuple[int, ...]], batch: PackedBatch
) -> torch.Tensor:
    """Per-token values (T, ...) of the whole `batch` on every rank, from each rank's micro-batch results.

    Each rank scatters its own sequences into a zero tensor; every position is covered by
    exactly one rank, so a SUM all-reduce assembles the full batch exactly.
    """
    full = scatter_per_token(values_per_mb, ids_per_mb, batch)
    return all_reduce_(full)
