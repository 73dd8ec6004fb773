"""The "fsdp" backend: FSDP2 (`fully_shard`) data parallelism over every rank, fp32 master weights.

The training step is LocalEngine's, unchanged; this class only overrides where parameters
live and how ranks agree:

  * parameters are sharded per block (see slipstream/models/parallelize.py); with
    `compute_dtype=bfloat16` FSDP all-gathers them in bf16 and reduce-scatters gradients in
    fp32, while the sharded fp32 parameters and AdamW state are the master copy;
  * the loss denominators (loss tokens, sequences) are counted from the CPU-side masks of
    this rank's micro-batches and all-reduced once per minibatch over gloo, before any
    device work, so every rank divides by the global counts without a GPU sync;
  * because each rank's loss is already divided by the global counts, the gradient of the
    minibatch is the SUM of the rank gradients: FSDP's default division by the world size is
    turned off (gradient divide factor 1, sum-only reductions);
  * the gradient norm is the global one (DTensor norms reduced across ranks before clipping).

Every rank must call forward_logprobs / forward_backward with the same number of
micro-batches (FSDP runs collectives inside each forward); `batching.shard.local_micro_batches`
pads a rank's share with empty micro-batches to guarantee it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.fsdp import FSDPModule
from torch.distributed.tensor import DTensor

from slipstream.batching.records import LossNorm, PackedBatch
from slipstream.checkpoint.manager import load_plain
from slipstream.config.schema import ActorSection
from slipstream.engine.base import LogProbOutput, count_loss_tokens, make_norm
from slipstream.engine.distributed import (
    all_reduce_,
    check_same_on_all_ranks,
    data_parallel_group,
    dp_mesh,
    init_distributed,
    warn_if_other_device,
)
from slipstream.engine.distributed import rank as dp_rank
from slipstream.engine.distributed import world_size as dp_world_size
from slipstream.engine.local import LocalEngine
from slipstream.models import hf
from slipstream.models.parallelize import CheckpointMode, mixed_precision_policy, parallelize
from slipstream.models.transformer import Transformer

DCP_DIR = "engine_dcp"
"""Sub-directory of a checkpoint holding the sharded model + optimizer (torch.distributed.checkpoint)."""
SCHEDULER_FILE = "engine_scheduler.pt"


class FSDPEngine(LocalEngine):
    """TrainEngine over FSDP2. `actor=None` builds a frozen, forward-only engine (reference model).

    The parallel options default to the actor section's (`activation_checkpointing`,
    `compile`, `offload_params`); `offload=True` keeps sharded parameters (and gradients and
    optimizer state) on the CPU between uses via FSDP2's CPUOffloadPolicy. A forward-only
    engine stays on the accelerator unless `offload` is asked.
    """

    def __init__(
        self,
        model: Transformer,
        device: torch.device,
        compute_dtype: torch.dtype,
        temperature: float,
        actor: ActorSection | None = None,
        *,
        activation_checkpointing: CheckpointMode | None = None,
        compile: bool | None = None,
        offload: bool | None = None,
    ) -> None:
        requested = device
        _, _, device = init_distributed(torch.device(device).type)
        # the data-parallel ranks: every rank, or the trainer ranks of a disaggregated placement
        self.rank, self.world_size = dp_rank(), dp_world_size()
        self.dp_rank, self.dp_size = self.rank, self.world_size
        warn_if_other_device(requested, device)
        if activation_checkpointing is None:
            activation_checkpointing = actor.activation_checkpointing if actor is not None else "none"
        if actor is None and activation_checkpointing != "none":
            raise ValueError("activation checkpointing only applies to a trainable engine (actor is None)")
        self.activation_checkpointing = activation_checkpointing
        self.compile = actor.compile if (compile is None and actor is not None) else bool(compile)
        self.offload_params = actor.offload_params if (offload is None and actor is not None) else bool(offload)
        super().__init__(model, device, compute_dtype, temperature, actor)

    # ------------------------------------------------------------------ backend hooks
    def _place_model(self, model: Transformer) -> Transformer:
        # fully_shard moves each rank's shard to the mesh device (or keeps it on the CPU
        # under CPUOffloadPolicy); the shards (fp32, or bf16 with actor.master_dtype) are the master weights.
        model = parallelize(
            model.to(dtype=self.master_dtype),
            activation_checkpointing=self.activation_checkpointing,
            compile=self.compile,
            mesh=dp_mesh(self.device.type),
            mp_policy=mixed_precision_policy(self.compute_dtype),
            offload=self.offload_params,
        )
        # Rank losses are already divided by the global counts, so the minibatch gradient is the
        # plain sum over ranks: no division by the world size, and SUM collectives (gloo has no
        # AVG / PREMUL_SUM).
        for module in model.modules():
            if isinstance(module, FSDPModule):
                module.set_gradient_divide_factor(1.0)
                module.set_force_sum_reduction_for_comms(True)
        return model

    def _fused_optimizer(self) -> bool:
        return self.device.type == "cuda" and not self.offload_params

    def _autocast(self):
        # FSDP's MixedPrecisionPolicy already gathers parameters in the compute dtype.
        return contextlib.nullcontext()

    def _global_norm(self, micro_batches: Sequence[PackedBatch], max_response_len: int) -> LossNorm:
        check_same_on_all_ranks(len(micro_batches), "micro-batches per minibatch")
        # CPU int64 counts: the all-reduce runs over gloo and never waits on the GPU stream.
        counts = all_reduce_(torch.tensor(count_loss_tokens(micro_batches), dtype=torch.int64))
        return make_norm(int(counts[0]), int(counts[1]), max_response_len)

    def _sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        return all_reduce_(values)

    def _max_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        return all_reduce_(values, op=torch.distributed.ReduceOp.MAX)

    def _clip_grad_norm(self, max_norm: float) -> float:
        if self.master_dtype != torch.float32:
            return self._clip_low_precision_grads(max_norm)
        params = [p for p in self.model.parameters() if p.grad is not None]
        total = torch.nn.utils.get_total_norm([p.grad for p in params], norm_type=2.0)
        # Sharded grads give a partial norm per rank; full_tensor() reduces it to the global one
        # (without this, float() would read this rank's shard only).
        if isinstance(total, DTensor):
            total = total.full_tensor()
        torch.nn.utils.clip_grads_with_norm_(params, max_norm, total)
        return float(total)

    # ------------------------------------------------------------------ TrainEngine
    def forward_logprobs(
        self, micro_batches: Sequence[PackedBatch], *, with_entropy: bool = False
    ) -> list[LogProbOutput]:
        check_same_on_all_ranks(len(micro_batches), "micro-batches per forward_logprobs call")
        out = super().forward_logprobs(micro_batches, with_entropy=with_entropy)
        # FSDP2 keeps the root group (embedding / LM head) gathered after a forward because a
        # backward normally follows; without one, free it here.
        self.model.reshard()
        return out

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full fp32 weights under HF names, one tensor at a time.

        Each tensor is all-gathered, so EVERY rank must iterate to the end (ranks other than
        the one feeding the rollout engine may drop the tensors).
        """
        self.model.reshard()
        for name, tensor in self.model.state_dict().items():
            if isinstance(tensor, DTensor):
                # Offloaded shards live on the CPU; gather them over the accelerator's backend.
                tensor = tensor.to(self.device).full_tensor()
            yield hf.to_hf_name(name), tensor

    def _dcp_state(self) -> dict:
        """Sharded state dicts in DCP form (FQNs without wrapper prefixes, optimizer keyed by FQN)."""
        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optimizer": optim_sd}

    def save(self, directory: Path) -> None:
        """Every rank writes its shards with torch.distributed.checkpoint (restorable on another world size)."""
        directory = Path(directory)
        dcp.save(self._dcp_state(), checkpoint_id=directory / DCP_DIR, process_group=data_parallel_group())
        if self.scheduler is not None and self.rank == 0:
            torch.save({"scheduler": self.scheduler.state_dict()}, directory / SCHEDULER_FILE)
        if self.world_size > 1:
            dist.barrier(group=data_parallel_group())  # the scheduler file exists before any rank moves on

    def load(self, directory: Path) -> None:
        directory = Path(directory)
        state = self._dcp_state()
        dcp.load(state, checkpoint_id=directory / DCP_DIR, process_group=data_parallel_group())  # fills `state`
        if self.optimizer is None:
            set_model_state_dict(self.model, state["model"])
            return
        set_state_dict(self.model, self.optimizer, model_state_dict=state["model"], optim_state_dict=state["optimizer"])
        sched = load_plain(directory / SCHEDULER_FILE)
        self.scheduler.load_state_dict(sched["scheduler"])

    def offload(self) -> None:
        if not self.offload_params:  # under CPUOffloadPolicy everything already lives on the CPU
            super().offload()

    def onload(self) -> None:
        if not self.offload_params:
            super().onload()
