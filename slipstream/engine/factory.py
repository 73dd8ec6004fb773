"""Pick the training backend from the config: `build_engine` for the actor and the reference model."""

from __future__ import annotations

import warnings

import torch

from slipstream.config.schema import ActorSection, parse_backend
from slipstream.engine.base import TrainEngine
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
