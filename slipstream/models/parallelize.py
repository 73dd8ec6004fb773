"""Apply activation checkpointing, torch.compile and FSDP2 to a native `Transformer`.

The order is fixed (torchtitan's): activation checkpointing -> compile -> fully_shard.
Checkpointing wraps each `Block`, compile then traces the wrapped block (so the recompute is
compiled too), and sharding comes last so FSDP's hooks sit outside both.

Activation checkpointing modes (per block):
  none       every activation is kept for the backward.
  full       only the block input is kept; the whole block is recomputed in backward.
  selective  op-level selective checkpointing: the outputs of matmuls (q/k/v/o, gate/up/down)
             and of the attention kernel are kept; the cheap memory-bound ops in between
             (RMSNorm, RoPE, SiLU, the gate*up product, residual adds) are recomputed. This drops
             the elementwise intermediates (several (T, intermediate) tensors per MLP) for a
             recompute cost that is negligible next to the matmuls, which are never recomputed.
Recompute is bit-identical to the first pass (no dropout), so all modes give the same gradients.

Sharding: every block is one FSDP group; the root group holds the embedding, the final norm
and the LM head. Tied embeddings share one Parameter between `embed_tokens` and the head
(`lm_head_weight` returns it); keeping it in the root group shards it exactly once and the
two uses accumulate into the same gradient.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard
from torch.utils.checkpoint import CheckpointPolicy, create_selective_checkpoint_contexts

from slipstream.models.transformer import Transformer

CheckpointMode = Literal["none", "selective", "full"]
CHECKPOINT_MODES = ("none", "selective", "full")

# Matmuls whose outputs selective checkpointing keeps (F.linear dispatches to these).
_SAVED_MATMULS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default, torch.ops.aten.bmm.default}


def mixed_precision_policy(compute_dtype: torch.dtype) -> MixedPrecisionPolicy:
    """FSDP2 policy: params all-gathered in `compute_dtype`, gradients reduced in fp32.

    The sharded parameters (and so AdamW's state) are the master weights: fp32 by default,
    bf16 under `actor.master_dtype=bfloat16`: then each micro-batch's gradient is reduced in fp32
    but stored, and summed over the micro-batches of a step, in bf16 (engine/optim.py).
    """
    if compute_dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"unsupported compute dtype {compute_dtype}; expected float32, bfloat16 or float16")
    return MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)


def _saves_output(func) -> bool:
    """Selective-checkpoint rule: keep matmul and attention-kernel outputs, recompute the rest."""
    if func in _SAVED_MATMULS:
        return True
    # Attention kernels differ by backend and version (sdpa flash/efficient/cudnn/cpu variants,
    # torch_attn::_varlen_attn, flex); all carry "attention" or "attn" in their op name.
    name = str(func)
    return "attention" in name or "attn" in name


def _selective_policy(ctx, func, *args, **kwargs) -> CheckpointPolicy:
    return CheckpointPolicy.MUST_SAVE if _saves_output(func) else CheckpointPolicy.PREFER_RECOMPUTE


def _selective_context():
    return create_selective_checkpoint_contexts(_selective_policy)


def apply_activation_checkpointing(model: Transformer, mode: CheckpointMode) -> None:
    """Wrap every block of `model.layers` in place according to `mode` (see the module docstring)."""
    if mode not in CHECKPOINT_MODES:
        raise ValueError(f"unknown activation_checkpointing {mode!r}; expected one of {CHECKPOINT_MODES}")
    if mode == "none":
        return
    for i, block in enumerate(model.layers):
        # checkpoint_wrapper's state-dict hooks strip its "_checkpoint_wrapped_module." prefix,
        # so state_dict() names (and HF export) are unchanged.
        if mode == "full":
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False)
        else:
            wrapped = checkpoint_wrapper(block, preserve_rng_state=False, context_fn=_selective_context)
        model.layers[i] = wrapped


def apply_compile(model: Transformer) -> None:
    """torch.compile each block in place (`Module.compile` keeps parameter names unchanged)."""
    for block in model.layers:
        block.compile(fullgraph=False)


def apply_fsdp(
    model: Transformer,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy,
    offload: bool,
) -> None:
    """fully_shard every block, then the root (embedding, final norm, LM head / tied embedding)."""
    offload_policy = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if offload else None
    kwargs = dict(mesh=mesh, mp_policy=mp_policy)
    if offload_policy is not None:
        kwargs["offload_policy"] = offload_policy
    for block in model.layers:
        fully_shard(block, **kwargs)
    # The root's parameters are not resharded after forward (FSDP2 default for the root):
    # the LM head is used right after the forward and the backward starts with it.
    fully_shard(model, **kwargs)


def parallelize(
    model: Transformer,
    *,
    activation_checkpointing: CheckpointMode = "none",
    compile: bool = False,
    mesh: DeviceMesh | None = None,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload: bool = False,
) -> Transformer:
    """Apply activation checkpointing -> torch.compile -> FSDP2 (in that order) to `model` in place.

    `mesh=None` skips sharding (single-device training with checkpointing / compile only).
    `mp_policy` defaults to fp32 compute; `offload` keeps sharded parameters, gradients and
    optimizer state on the CPU (FSDP2 CPUOffloadPolicy). Returns the same module.
    """
    if not isinstance(model, Transformer):
        raise ValueError(f"parallelize expects a slipstream Transformer, got {type(model).__name__}")
    if mesh is None and (offload or mp_policy is not None):
        raise ValueError("offload and mp_policy need FSDP sharding: pass a device mesh")
    apply_activation_checkpointing(model, activation_checkpointing)
    if compile:
        apply_compile(model)
    if mesh is not None:
        if mesh.ndim != 1:
            raise ValueError(f"expected a 1-D data-parallel mesh, got {mesh.ndim} dimensions")
        apply_fsdp(model, mesh, mp_policy or mixed_precision_policy(torch.float32), offload)
    return model
