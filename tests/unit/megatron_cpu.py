"""Helpers of the megatron engine tests: parallel-state teardown and a spawned rank's environment."""

from __future__ import annotations

import os


def reset_megatron() -> None:
    """Destroy megatron's parallel state and the default process group (between layouts / tests)."""
    from megatron.core import parallel_state

    from slipstream.engine.distributed import destroy_distributed

    parallel_state.destroy_model_parallel()
    destroy_distributed()


def set_rank_env(rank: int, world: int, port: int) -> None:
    """torchrun's variables for a spawned test rank."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port)
    )
