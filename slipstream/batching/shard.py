"""This data-parallel rank's share of a minibatch: its micro-batches under a balanced plan.

Every rank gets the same number of micro-batches, as FSDP requires (it runs collectives inside
every forward): a rank whose share has fewer sequences than micro-batches runs no-loss one-token
micro-batches instead. Per-token results come back into the whole batch with
`engine.distributed.gather_per_token`.
"""

from __future__ import annotations

import torch

from slipstream.batching.packing import select
from slipstream.batching.planner import DEFAULT_QUADRATIC_SCALE, plan_micro_batches
from slipstream.batching.records import PackedBatch


def empty_micro_batch(like: PackedBatch) -> PackedBatch:
    """A one-token sequence with no loss token, carrying the same optional fields as `like`.

    It adds 0 to the loss, the gradient and the counts.
    """
    long = torch.zeros(1, dtype=torch.int64)
    zero = torch.zeros(1, dtype=torch.float32)
    optional = {
        name: (None if getattr(like, name) is None else torch.zeros(1, dtype=getattr(like, name).dtype))
        for name in ("old_logprobs", "ref_logprobs", "behav_logprobs", "fresh_mask")
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

    The ids index `batch`'s sequences, for `gather_per_token` / `scatter_per_token`; an empty
    micro-batch has no ids.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank {rank} out of range for world size {world}")
    plan = plan_micro_batches(
        batch.seq_lens(), cap, num_ranks=world, algorithm=planner, quadratic_scale=quadratic_scale
    )
    ids_per_mb = list(plan.assignments[rank])
    mbs = [select(batch, ids) if ids else empty_micro_batch(batch) for ids in ids_per_mb]
    return mbs, ids_per_mb
