"""The "local" backend: one process, the CPU or one GPU, fp32 master weights by default.

With `model.dtype=bfloat16` the forward runs under bf16 autocast while parameters, gradients
and AdamW state stay fp32; `actor.master_dtype=bfloat16` holds those in bf16 too, with
stochastically rounded AdamW updates (engine/optim.py). The FSDP2 backend keeps this exact
training step and only changes where parameters live and how gradients are reduced.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch

from slipstream.batching.records import LossNorm, PackedBatch
from slipstream.checkpoint.manager import load_plain
from slipstream.config.schema import ActorSection
from slipstream.engine.base import (
    LogProbOutput,
    LossFn,
    accumulate_metrics,
    count_norm,
    oom_advice,
    reduce_metrics,
)
from slipstream.engine.optim import build_optimizer
from slipstream.models import hf
from slipstream.models.transformer import Transformer
from slipstream.ops.logprobs import linear_logprobs


class LocalEngine:
    """TrainEngine for a single device. `actor=None` builds a frozen, forward-only engine (reference model).

    FSDPEngine subclasses it and overrides only the hooks below the public methods (model
    placement, autocast, the cross-rank reductions, gradient clipping), so both backends run
    the same training step.
    """

    dp_rank = 0
    """This process's data-parallel rank and the number of them (one process here)."""
    dp_size = 1

    def __init__(
        self,
        model: Transformer,
        device: torch.device,
        compute_dtype: torch.dtype,
        temperature: float,
        actor: ActorSection | None = None,
    ) -> None:
        self.device = device
        self.compute_dtype = compute_dtype
        self.temperature = temperature
        self.actor = actor
        self.chunk_size = actor.logprob_chunk_size if actor else None
        self.master_dtype = getattr(torch, actor.master_dtype) if actor else torch.float32
        self.optimizer: torch.optim.Optimizer | None = None
        self.scheduler = None
        if actor is None:
            model.requires_grad_(False)
        self.model = self._place_model(model)
        if actor is None:
            self.model.eval()
            return
        self.optimizer = build_optimizer(self.model.parameters(), actor, fused=self._fused_optimizer(), rank=self.dp_rank)
        warmup = max(actor.warmup_steps, 0)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(
            self.optimizer, lambda step: min(1.0, (step + 1) / warmup) if warmup else 1.0
        )

    # ------------------------------------------------------------------ backend hooks
    def _place_model(self, model: Transformer) -> Transformer:
        """Put the master weights (fp32, or bf16 with `actor.master_dtype`) where training happens."""
        return model.to(device=self.device, dtype=self.master_dtype)

    def _fused_optimizer(self) -> bool:
        """Fused AdamW kernels when the parameters live on the GPU."""
        return self.device.type == "cuda"

    def _global_norm(self, micro_batches: Sequence[PackedBatch], max_response_len: int) -> LossNorm:
        """Loss denominators of the whole minibatch (one process here: just count)."""
        return count_norm(micro_batches, max_response_len)

    def _sum_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """Sum per-rank metric partials over data-parallel ranks (one process here: identity)."""
        return values

    def _max_over_ranks(self, values: torch.Tensor) -> torch.Tensor:
        """Elementwise max of per-rank values over data-parallel ranks (one process here: identity)."""
        return values

    def _clip_grad_norm(self, max_norm: float) -> float:
        """Clip gradients to `max_norm` and return the (pre-clip) global norm."""
        if self.master_dtype != torch.float32:
            return self._clip_low_precision_grads(max_norm)
        return float(torch.nn.utils.clip_grad_norm_(self.model.parameters(), max_norm))

    def _clip_low_precision_grads(self, max_norm: float) -> float:
        """Clipping for bf16 gradients with the norm accumulated and returned in fp32.

        torch's norm helpers return the gradients' dtype, which would round the logged norm and
        the clip factor to bf16 (~0.4%). Each local shard's sum of squares is taken in fp32 and
        summed over ranks (FSDP shards are disjoint), so the norm is the global one.
        """
        grads = [p.grad for p in self.model.parameters() if p.grad is not None]
        local = [g.to_local() if hasattr(g, "to_local") else g for g in grads]
        squares = sum((torch.linalg.vector_norm(g, dtype=torch.float32).square() for g in local), torch.zeros(()))
        total = self._sum_over_ranks(squares.reshape(1).to(self.device))[0].sqrt()
        if math.isfinite(max_norm) and local:
            # the factor stays an fp32 0-dim tensor: bf16 * fp32 scalar rounds once, in the product
            torch._foreach_mul_(local, (max_norm / (total + 1e-6)).clamp(max=1.0))
        return float(total)

    def _autocast(self):
        if self.compute_dtype == torch.float32:
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device.type, dtype=self.compute_dtype)

    def _logprobs(self, mb: PackedBatch, with_entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        with self._autocast():
            hidden = self.model(mb.input_ids, mb.position_ids, mb.cu_seqlens, mb.max_seqlen)
        # under autocast the final norm returns fp32; the LM-head matmul must run in the compute dtype
        hidden = hidden.to(self.compute_dtype)
        weight = self.model.lm_head_weight.to(self.compute_dtype)
        return linear_logprobs(
            hidden, weight, mb.targets, temperature=self.temperature, with_entropy=with_entropy,
            chunk_size=self.chunk_size,
        )

    @torch.no_grad()
    def forward_logprobs(self, micro_batches: Sequence[PackedBatch], *, with_entropy: bool = False) -> list[LogProbOutput]:
        out = []
        with oom_advice("actor.max_tokens_per_mb", micro_batches):
            for mb in micro_batches:
                logprobs, entropy = self._logprobs(mb.to(self.device, non_blocking=True), with_entropy)
                out.append(LogProbOutput(logprobs=logprobs.float(), entropy=None if entropy is None else entropy.float()))
        return out

    def forward_backward(self, micro_batches: Sequence[PackedBatch], loss_fn: LossFn, *, max_response_len: int) -> dict[str, float]:
        assert self.optimizer is not None, "forward_backward on a frozen engine"
        self.model.train()
        norm = self._global_norm(micro_batches, max_response_len)
        totals: dict[str, torch.Tensor] = {}
        with oom_advice("actor.max_tokens_per_mb", micro_batches):
            for mb in micro_batches:
                mb = mb.to(self.device, non_blocking=True)
                logprobs, entropy = self._logprobs(mb, loss_fn.needs_entropy)
                loss, metrics = loss_fn(logprobs, entropy, mb, norm)
                loss.backward()
                accumulate_metrics(totals, metrics)
        result = reduce_metrics(totals, self.device, self._sum_over_ranks, self._max_over_ranks)
        result["actor/num_loss_tokens"] = float(norm.num_loss_tokens)
        result["actor/num_micro_batches"] = float(len(micro_batches))
        return result

    def optim_step(self) -> dict[str, float]:
        assert self.optimizer is not None and self.actor is not None
        max_norm = self.actor.grad_clip if self.actor.grad_clip > 0 else math.inf
        grad_norm = self._clip_grad_norm(max_norm)
        lr = self.optimizer.param_groups[0]["lr"]
        if math.isfinite(grad_norm):
            self.optimizer.step()
            self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        return {"actor/grad_norm": grad_norm, "actor/lr": lr, "actor/step_skipped": float(not math.isfinite(grad_norm))}

    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        yield from hf.to_hf_state_dict(self.model.state_dict()).items()

    def save(self, directory: Path) -> None:
        state = {"model": self.model.state_dict()}
        if self.optimizer is not None:
            state["optimizer"] = self.optimizer.state_dict()
            state["scheduler"] = self.scheduler.state_dict()
        torch.save(state, Path(directory) / "engine.pt")

    def load(self, directory: Path) -> None:
        state = load_plain(Path(directory) / "engine.pt", map_location=self.device)
        self.model.load_state_dict(state["model"])
        if self.optimizer is not None:
            self.optimizer.load_state_dict(state["optimizer"])
            self.scheduler.load_state_dict(state["scheduler"])

    def offload(self) -> None:
        self._move(torch.device("cpu"))

    def onload(self) -> None:
        self._move(self.device)

    def _move(self, device: torch.device) -> None:
        if self.device.type == "cpu":
            return
        self.model.to(device)
        if self.optimizer is not None:
            for state in self.optimizer.state.values():
                for key, value in state.items():
                    if isinstance(value, torch.Tensor):
                        state[key] = value.to(device)

