"""The "megatron" backend: megatron-core's GPTModel, DDP, distributed optimizer and schedules.

The training step means exactly what LocalEngine's does (same LossFn called with the global
LossNorm, same metric keys, same warm-up, AdamW settings, clipping and skip on a non-finite
gradient norm); only the machinery is Megatron's:

  * model: `provider.build_gpt_model(packed=True)` -- packed THD micro-batches (PackedSeqParams
    with our cu_seqlens, no padding: sequence parallelism is off, so TP needs none) through
    slipstream's varlen attention on the local spec, or TE's attention when it is installed;
    the forward stops at the final norm (`layers.HiddenStatesGPTModel`);
  * log-probs: TP=1 the fused `linear_logprobs` op with the output (or tied embedding) weight,
    TP>1 `vocab_parallel.vocab_parallel_logprobs` over the vocab shards (never gathered);
  * precision as Megatron does it: with compute dtype bf16 the model holds bf16 parameters,
    DDP accumulates fp32 main grads (grad_reduce_in_fp32) and the distributed optimizer keeps
    fp32 master weights, initialised from the caller's fp32 weights (not from their bf16
    copy); with fp32 everything is fp32;
  * micro-batches run through `get_forward_backward_func()` (one packed sequence per
    micro-batch, micro_batch_size=1, variable length: the no-pipelining schedule ignores
    seq_length).

Gradient scale (the verl "Megatron grad-norm ~3x FSDP" trap). Our loss is already divided by
the minibatch's GLOBAL token / sequence counts, so nothing may divide again:
  * the schedule's loss function returns Megatron's 3-tuple (loss, num_tokens, metrics) with
    `calculate_per_token_loss=True`; with a 2-tuple (or the flag off) the schedule divides
    every micro-batch loss by num_microbatches (and by its token count);
  * `finalize_model_grads` is wrapped to receive num_tokens=None: with the flag on, Megatron
    would otherwise divide all gradients by the summed token count;
  * with the flag on, DDP's gradient_scaling_factor is 1 (average_in_collective off): rank
    gradients are SUMMED over data-parallel ranks, exactly as FSDPEngine sums them.
tests/unit/test_megatron_engine.py checks grad norm and updated weights against LocalEngine
for 1 and 3 micro-batches and every loss aggregation mode.

CPU (unit tests, `slipstream bench train-step --backend megatron --preset tiny`): megatron-core's
(0.16 to 0.19) DDP, optimizer and schedule hard-code CUDA in places (`device="cuda"` scalars,
`torch.cuda.current_device()`, `Tensor.type()` checks). When the engine's device is the CPU,
every engine call runs inside `cpu_compat.cuda_calls_on_cpu()`, which redirects just those
calls; the code inside is the code the GPU runs (on CUDA the context is never entered).

Not wired here (another issue): pipeline parallelism (PP>1 needs fixed micro-batch shapes and
a per-stage state-dict mapping) and context parallelism (needs TE's ring attention); both
raise ValueError. DP and TP run (t2 and d2 steps match one process on the CPU: tests/unit/test_megatron_engine.py).
"""

from __future__ import annotations

import contextlib
import functools
import math
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig, finalize_model_grads
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer.clip_grads import clip_grad_by_total_norm_fp32
from megatron.core.packed_seq_params import PackedSeqParams
from megatron.core.pipeline_parallel import get_forward_backward_func

from slipstream.batching.records import LossNorm, PackedBatch
from slipstream.checkpoint.manager import load_plain
from slipstream.config.schema import ActorSection, MegatronLayout
from slipstream.engine.base import (
    LogProbOutput,
    LossFn,
    accumulate_metrics,
    count_loss_tokens,
    make_norm,
    oom_advice,
    reduce_metrics,
)
from slipstream.engine.distributed import check_same_on_all_ranks, init_distributed, warn_if_other_device
from slipstream.engine.megatron import provider
from slipstream.engine.megatron.convert import megatron_to_hf, merge_tp
from slipstream.engine.megatron.cpu_compat import cuda_calls_on_cpu
from slipstream.engine.megatron.vocab_parallel import vocab_parallel_logprobs
from slipstream.models import hf
from slipstream.models.transformer import Transformer
from slipstream.ops.attention import probe_native_gqa
from slipstream.ops.logprobs import linear_logprobs

CHECKPOINT_DIR = "engine_megatron"
"""Sub-directory of a checkpoint: one file per rank (model shard, optimizer shard, step count)."""


def _finalize_grads_without_token_scaling(model, num_tokens=None, **kwargs) -> None:
    """Megatron's finalize_model_grads (DP reduce, TP / embedding grad syncs) minus the 1/num_tokens scale."""
    finalize_model_grads(model, None, **kwargs)


def _packed_seq_params(
    cu_seqlens: torch.Tensor, host_cu_seqlens: torch.Tensor | None, max_seqlen: int
) -> PackedSeqParams:
    """THD parameters of one micro-batch; `host_cu_seqlens` (CPU) is only given to Megatron's RoPE.

    Megatron's THD RoPE splits q / k per sequence with `cu_seqlens.tolist()` in every layer; on
    a device tensor that is two host syncs per layer. It reads `cu_seqlens_*_padded` when set, so
    the local spec gets the same boundaries (nothing is padded) as a CPU tensor there, while the
    attention kernel reads the device copy. TE's attention reads the padded fields itself, so
    with TE (`host_cu_seqlens=None`) they stay unset.
    """
    cu = cu_seqlens.to(torch.int32)
    host = None if host_cu_seqlens is None else host_cu_seqlens.to(torch.int32)
    return PackedSeqParams(
        qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu, cu_seqlens_q_padded=host, cu_seqlens_kv_padded=host,
        max_seqlen_q=max_seqlen, max_seqlen_kv=max_seqlen,
    )  # fmt: skip


def _mark_tensor_parallel(gpt) -> None:
    """Flag every TP-sharded weight as such, where megatron-core has not already.

    With `perform_initialization=False` (our weights are copied in afterwards) megatron-core
    0.16 never sets `tensor_model_parallel` on the sharded weights, so the grad norm would count
    them as replicas and drop TP ranks >= 1's shards; 0.19 sets it in that case too, and its
    `set_tensor_model_parallel_attributes` asserts that nothing was set before. So the flags are
    set only where missing, and checked where Megatron set them. Must run before DDP and the
    optimizer, which copy the flag to their buffers and main params.
    """
    from megatron.core.tensor_parallel import ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding
    from megatron.core.tensor_parallel.layers import set_tensor_model_parallel_attributes

    for module in gpt.modules():
        weight = getattr(module, "weight", None)
        if weight is None:
            continue
        if isinstance(module, (ColumnParallelLinear, VocabParallelEmbedding)):
            dim = 0  # output rows (vocabulary rows) are split
        elif isinstance(module, RowParallelLinear):
            dim = 1  # input columns are split
        else:
            continue
        if hasattr(weight, "tensor_model_parallel"):  # newer megatron-core (0.19) marked it at construction
            assert weight.tensor_model_parallel and weight.partition_dim == dim, (
                f"{type(module).__name__} weight marked tensor_model_parallel={weight.tensor_model_parallel}, "
                f"partition_dim={weight.partition_dim}; expected True, {dim}"
            )
        else:
            set_tensor_model_parallel_attributes(weight, True, dim, 1)


def recompute_settings(mode: str) -> dict:
    """TransformerConfig recompute options for `actor.activation_checkpointing`.

    "full" recomputes every transformer layer in the backward (Megatron's uniform method, one
    layer per checkpoint: the same boundaries as slipstream's per-block checkpointing);
    "selective" is Megatron's own selective recompute (the core attention), which keeps less
    than slipstream's selective mode (norms, RoPE, SiLU) recomputes; "none" stores everything.
    """
    if mode == "none":
        return {}
    if mode == "full":
        return {"recompute_granularity": "full", "recompute_method": "uniform", "recompute_num_layers": 1}
    if mode == "selective":
        return {"recompute_granularity": "selective"}
    raise ValueError(f"activation_checkpointing must be none, selective or full, got {mode!r}")


def fusion_settings(on: bool) -> dict:
    """Megatron's own elementwise fusions: SwiGLU and the residual (bias-dropout-)add.

    Both run through megatron.core.jit's `jit_fuser` (torch.compile'd functions behind a custom
    autograd.Function for SwiGLU), as Megatron-LM trains by default. Without them the local spec
    runs silu, mul and the adds as separate kernels with their own fp32/bf16 round trips
    (docs/benchmarks.md, the Megatron gap breakdown). RoPE fusion needs Transformer Engine.
    """
    return {"bias_activation_fusion": on, "bias_dropout_fusion": on}


class MegatronEngine:
    """TrainEngine over megatron-core. `actor=None` builds a frozen, forward-only engine (reference model).

    `model` is the native model holding the initial weights; they are converted into a
    GPTModel (this rank's TP shard) and `model` is not used afterwards.
    """

    def __init__(
        self,
        model: Transformer,
        device: torch.device,
        compute_dtype: torch.dtype,
        temperature: float,
        actor: ActorSection | None = None,
        *,
        layout: MegatronLayout | None = None,
        fuse_elementwise: bool | None = None,
    ) -> None:
        layout = layout or MegatronLayout()
        self.fuse_elementwise = fuse_elementwise
        if layout.pp > 1 or layout.cp > 1:
            raise ValueError(
                f"actor.backend megatron: pipeline (p{layout.pp}) and context (c{layout.cp}) parallelism are "
                "not wired into the engine yet; use d<D>t<T> only"
            )
        self.rank, world, self.device = init_distributed(torch.device(device).type)
        warn_if_other_device(device, self.device)
        layout.data_parallel_size(world)  # raises when the sizes do not fit the world
        with self._compat():
            self._setup(model, layout, compute_dtype, temperature, actor)

    def _compat(self):
        """On the CPU, megatron-core's hard-coded CUDA calls are redirected (see cpu_compat.py)."""
        return cuda_calls_on_cpu() if self.device.type == "cpu" else contextlib.nullcontext()

    def _setup(self, model, layout, compute_dtype, temperature, actor) -> None:
        provider.init_model_parallel(layout.tp, layout.pp, layout.cp, device_type=self.device.type)
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_size = parallel_state.get_data_parallel_world_size()
        self.tp_rank = parallel_state.get_tensor_model_parallel_rank()
        self.tp_size = parallel_state.get_tensor_model_parallel_world_size()
        self.cfg = model.cfg
        self.compute_dtype = compute_dtype
        self.temperature = temperature
        self.actor = actor
        self.chunk_size = actor.logprob_chunk_size if actor else None
        self.num_steps = 0  # successful optimizer steps: drives the LR warm-up
        self.use_te = self.device.type == "cuda" and provider.te_available()
        if self.device.type == "cuda":
            probe_native_gqa(self.device)  # once, outside autograd: lets the varlen kernel skip the k/v repeat
        self.gpt, master = self._build_model(model)
        self.model = self.gpt
        self.optimizer = None
        if actor is None:
            self.gpt.requires_grad_(False)
            self.gpt.eval()
            return
        self.model = self._wrap_ddp(self.gpt)
        self.optimizer = self._build_optimizer(actor)
        # The distributed optimizer copies its fp32 master weights from the (bf16) model params;
        # take them from the caller's fp32 weights instead, as FSDP's fp32 shards are.
        self.optimizer.reload_model_params(state_dict={"model": master})

    # ------------------------------------------------------------------ construction
    def _build_model(self, model: Transformer):
        """GPTModel on this rank's device with `model`'s weights, and this rank's fp32 Megatron-named shard."""
        if self.device.type == "cuda":
            self._seed_rng_tracker()
        gpt = provider.build_gpt_model(
            self.cfg,
            dtype=self.compute_dtype,
            use_te=self.use_te,
            packed=True,
            use_cpu_initialization=self.device.type == "cpu",
            perform_initialization=False,  # every weight is overwritten from `model` below
            calculate_per_token_loss=True,  # see the module docstring: no division by #micro-batches
            **recompute_settings(self.actor.activation_checkpointing if self.actor else "none"),
            # On the GPU by default; on the CPU only when asked (inductor's C++ build is slow there).
            **fusion_settings(self.device.type == "cuda" if self.fuse_elementwise is None else self.fuse_elementwise),
        )
        # Megatron's own layers allocate on the current CUDA device in params_dtype, but plain torch
        # modules of the local spec (its RMSNorms: layer, q/k and final norms) are built fp32 on the
        # default device. Move and cast the whole model, as Megatron's Float16Module does: an fp32
        # norm weight under bf16 input sends torch.rms_norm to its unfused upcast path (extra casts
        # and elementwise kernels in every layer; docs/benchmarks.md, the Megatron gap breakdown).
        gpt.to(device=self.device, dtype=self.compute_dtype)
        _mark_tensor_parallel(gpt)
        hf_sd = hf.to_hf_state_dict(model.state_dict())
        # TP shards of row-parallel weights are non-contiguous views; the optimizer flattens them
        master = {
            k: v.to(self.device, torch.float32).contiguous()
            for k, v in provider.megatron_shard(gpt, hf_sd, self.cfg).items()
        }
        provider.load_megatron_state_dict(gpt, {k: v.to(self.compute_dtype) for k, v in master.items()})
        return gpt, master

    @staticmethod
    def _seed_rng_tracker() -> None:
        """Megatron's CUDA RNG tracker must exist for TE layers; seeding it must not move torch's CUDA RNG."""
        if tensor_parallel.get_cuda_rng_tracker().is_initialized():
            return
        state = torch.cuda.get_rng_state()
        tensor_parallel.model_parallel_cuda_manual_seed(0)
        torch.cuda.set_rng_state(state)

    def _wrap_ddp(self, gpt) -> DistributedDataParallel:
        ddp_config = DistributedDataParallelConfig(
            grad_reduce_in_fp32=True,  # fp32 main grads under bf16 params
            use_distributed_optimizer=True,
            overlap_grad_reduce=False,
            overlap_param_gather=False,
            average_in_collective=False,  # SUM over DP ranks (our loss is globally normalised)
        )
        ddp = DistributedDataParallel(config=gpt.config, ddp_config=ddp_config, module=gpt)
        gpt.config.no_sync_func = ddp.no_sync
        gpt.config.finalize_model_grads_func = _finalize_grads_without_token_scaling
        return ddp

    def _build_optimizer(self, actor: ActorSection):
        bf16 = self.compute_dtype == torch.bfloat16
        config = OptimizerConfig(
            optimizer="adam",
            lr=actor.lr,
            weight_decay=actor.weight_decay,
            adam_beta1=actor.betas[0],
            adam_beta2=actor.betas[1],
            adam_eps=actor.eps,
            decoupled_weight_decay=True,  # AdamW, as LocalEngine
            use_distributed_optimizer=True,
            clip_grad=actor.grad_clip,  # informational: optim_step clips itself (after a finiteness check)
            bf16=bf16,
            params_dtype=self.compute_dtype,
        )
        # config_overrides={}: one param group with weight decay on every parameter, like
        # torch AdamW in LocalEngine (Megatron's default exempts biases and norms).
        return get_megatron_optimizer(config, [self.model], config_overrides={})

    # ------------------------------------------------------------------ log-probs
    def _logprobs(self, mb: PackedBatch, hidden: torch.Tensor, with_entropy: bool):
        """Per-token fp32 log-probs (and entropy) from (T, 1, H) final-normed hidden states."""
        weight = self.gpt.output_weight()
        hidden = hidden[:, 0].to(weight.dtype)
        if self.tp_size == 1:
            return linear_logprobs(
                hidden, weight, mb.targets, temperature=self.temperature, with_entropy=with_entropy,
                chunk_size=self.chunk_size,
            )  # fmt: skip
        return vocab_parallel_logprobs(
            hidden, weight, mb.targets, vocab_start=self.tp_rank * weight.shape[0],
            group=parallel_state.get_tensor_model_parallel_group(), temperature=self.temperature,
            with_entropy=with_entropy, chunk_size=self.chunk_size,
        )  # fmt: skip

    def _run_schedule(self, micro_batches: Sequence[PackedBatch], head, forward_only: bool) -> list:
        """Megatron's forward(-backward) schedule over our micro-batches; returns what `head` reported per micro-batch.

        `head(mb, hidden)` returns (loss, num_tokens, report): the 3-tuple keeps the schedule
        from dividing the loss (calculate_per_token_loss=True, see the module docstring).
        """

        def forward_step(data_iterator, model):
            host_mb = next(data_iterator)
            mb = host_mb.to(self.device, non_blocking=True)
            host_cu = None if self.use_te else host_mb.cu_seqlens.cpu()
            hidden = model(
                input_ids=mb.input_ids[None], position_ids=mb.position_ids[None], attention_mask=None,
                packed_seq_params=_packed_seq_params(mb.cu_seqlens, host_cu, mb.max_seqlen),
            )  # fmt: skip
            return hidden, functools.partial(head, mb)

        return get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iter(micro_batches),
            model=[self.model],
            num_microbatches=len(micro_batches),
            seq_length=max(mb.num_tokens for mb in micro_batches),  # unused without pipelining
            micro_batch_size=1,
            forward_only=forward_only,
        )

    @torch.no_grad()
    def forward_logprobs(
        self, micro_batches: Sequence[PackedBatch], *, with_entropy: bool = False
    ) -> list[LogProbOutput]:
        check_same_on_all_ranks(len(micro_batches), "micro-batches per forward_logprobs call")
        if not micro_batches:
            return []

        def head(mb: PackedBatch, hidden: torch.Tensor):
            logprobs, entropy = self._logprobs(mb, hidden, with_entropy)
            out = LogProbOutput(logprobs=logprobs.float(), entropy=None if entropy is None else entropy.float())
            return logprobs.new_zeros(()), torch.zeros((), dtype=torch.int), out

        with oom_advice("actor.max_tokens_per_mb", micro_batches), self._compat():
            return self._run_schedule(micro_batches, head, forward_only=True)

    # ------------------------------------------------------------------ training step
    def _global_norm(self, micro_batches: Sequence[PackedBatch], max_response_len: int) -> LossNorm:
        """Loss denominators summed over data-parallel ranks (TP ranks share their micro-batches)."""
        check_same_on_all_ranks(len(micro_batches), "micro-batches per minibatch")
        counts = torch.tensor(count_loss_tokens(micro_batches), dtype=torch.int64)
        if self.dp_size > 1:  # CPU int64 over gloo: no wait on the GPU stream
            dist.all_reduce(counts, group=parallel_state.get_data_parallel_group_gloo())
        return make_norm(int(counts[0]), int(counts[1]), max_response_len)

    def forward_backward(
        self, micro_batches: Sequence[PackedBatch], loss_fn: LossFn, *, max_response_len: int
    ) -> dict[str, float]:
        assert self.optimizer is not None, "forward_backward on a frozen engine"
        self.model.train()
        norm = self._global_norm(micro_batches, max_response_len)
        totals: dict[str, torch.Tensor] = {}

        def head(mb: PackedBatch, hidden: torch.Tensor):
            logprobs, entropy = self._logprobs(mb, hidden, loss_fn.needs_entropy)
            loss, metrics = loss_fn(logprobs, entropy, mb, norm)
            accumulate_metrics(totals, metrics)
            return loss, mb.loss_mask.sum().to(torch.int), {}

        with oom_advice("actor.max_tokens_per_mb", micro_batches), self._compat():
            self._run_schedule(micro_batches, head, forward_only=False)
        def over_ranks(op):
            def reduce(values: torch.Tensor) -> torch.Tensor:
                if self.dp_size > 1:
                    dist.all_reduce(values, op=op, group=parallel_state.get_data_parallel_group())
                return values

            return reduce

        result = reduce_metrics(totals, self.device, over_ranks(dist.ReduceOp.SUM), over_ranks(dist.ReduceOp.MAX))
        result["actor/num_loss_tokens"] = float(norm.num_loss_tokens)
        result["actor/num_micro_batches"] = float(len(micro_batches))
        return result

    def _lr(self) -> float:
        """LocalEngine's schedule: linear warm-up over actor.warmup_steps successful steps, then constant."""
        warmup = max(self.actor.warmup_steps, 0)
        return self.actor.lr * (min(1.0, (self.num_steps + 1) / warmup) if warmup else 1.0)

    def optim_step(self) -> dict[str, float]:
        assert self.optimizer is not None and self.actor is not None
        with self._compat():
            return self._optim_step()

    def _optim_step(self) -> dict[str, float]:
        lr = self._lr()
        for group in self.optimizer.param_groups:
            group["lr"] = lr
        # Main (fp32) grads from the DDP buffers, then the global norm over every rank's shard.
        # Megatron's own step() checks finiteness only under fp16 loss scaling, hence this order.
        self.optimizer.prepare_grads()
        grad_norm = float(self.optimizer.get_grad_norm())
        finite = math.isfinite(grad_norm)
        if finite:
            if self.actor.grad_clip > 0:
                for opt in self.optimizer.chained_optimizers:
                    clip_grad_by_total_norm_fp32(opt.get_parameters(), self.actor.grad_clip, grad_norm)
            self.optimizer.step_with_ready_grads()  # also all-gathers updated params over DP
            self.num_steps += 1
        self.model.zero_grad_buffer()
        self.optimizer.zero_grad()
        return {"actor/grad_norm": grad_norm, "actor/lr": lr, "actor/step_skipped": float(not finite)}

    # ------------------------------------------------------------------ weights, checkpoints, offload
    def export_weights(self) -> Iterator[tuple[str, torch.Tensor]]:
        """Full weights under HF names, fp32 (the model's values: bf16-rounded under bf16 compute).

        With TP>1 every tensor is all-gathered over the TP group, so every rank must iterate.
        """
        with self._compat():
            hf_weights = megatron_to_hf(self._full_state_dict(), self.cfg)
        for name, tensor in hf_weights.items():
            yield name, tensor.float()

    def _full_state_dict(self) -> dict[str, torch.Tensor]:
        """TP-merged Megatron-named weights of the whole model."""
        local = {k: v for k, v in self.gpt.state_dict().items() if not k.endswith("_extra_state")}
        if self.tp_size > 1:
            group = parallel_state.get_tensor_model_parallel_group()
            shards: list[dict[str, torch.Tensor]] = [{} for _ in range(self.tp_size)]
            for name, tensor in local.items():
                parts = [torch.empty_like(tensor) for _ in range(self.tp_size)]
                dist.all_gather(parts, tensor.contiguous(), group=group)
                for shard, part in zip(shards, parts):
                    shard[name] = part
            local = merge_tp(shards)
        return local

    def _inner_optimizers(self) -> list[torch.optim.Optimizer]:
        """The torch optimizers under the distributed optimizer; their params are this rank's fp32 master shards."""
        return [opt.optimizer for opt in self.optimizer.chained_optimizers]

    def _rank_file(self, directory: Path) -> Path:
        return Path(directory) / CHECKPOINT_DIR / f"rank{self.rank:05d}.pt"

    def save(self, directory: Path) -> None:
        """One file per rank (model shard, fp32 master shard, Adam state); restorable on the same layout.

        Megatron's own `save_parameter_state` drops the per-parameter "step" that torch's AdamW
        keeps (it expects TE / Apex FusedAdam), so the inner torch optimizers are saved as they are.
        """
        path = self._rank_file(directory)
        path.parent.mkdir(parents=True, exist_ok=True)
        with self._compat():
            self._save(path)

    def _layout(self) -> dict[str, int]:
        return {"world": dist.get_world_size(), "dp": self.dp_size, "tp": self.tp_size}

    def _save(self, path: Path) -> None:
        state = {"model": self.gpt.state_dict(), "layout": self._layout()}
        if self.optimizer is not None:
            inner = self._inner_optimizers()
            state["optimizer"] = [opt.state_dict() for opt in inner]
            state["master"] = [[p.detach().clone() for g in opt.param_groups for p in g["params"]] for opt in inner]
            state["num_steps"] = self.num_steps
        torch.save(state, path)
        if dist.get_world_size() > 1:
            dist.barrier()

    def load(self, directory: Path) -> None:
        path = self._rank_file(directory)
        saved_ranks = len(list(path.parent.glob("rank*.pt")))
        if not path.exists() or saved_ranks != dist.get_world_size():
            raise ValueError(
                f"{directory} holds a megatron checkpoint of {saved_ranks} ranks; this engine has "
                f"{dist.get_world_size()} (dp {self.dp_size}, tp {self.tp_size}): megatron checkpoints restore only "
                "on the layout that saved them"
            )
        with self._compat():
            self._load(path)

    def _load(self, path: Path) -> None:
        state = load_plain(path, map_location=self.device)
        saved = state.get("layout")
        if saved is not None and saved != self._layout():
            raise ValueError(f"megatron checkpoint layout {saved} differs from this engine's {self._layout()}")
        provider.load_megatron_state_dict(self.gpt, state["model"])
        if self.optimizer is None:
            return
        for opt, opt_state, master in zip(self._inner_optimizers(), state["optimizer"], state["master"], strict=True):
            opt.load_state_dict(opt_state)
            params = [p for g in opt.param_groups for p in g["params"]]
            with torch.no_grad():  # under fp32 the master shards are views of the model params
                for param, saved in zip(params, master, strict=True):
                    param.copy_(saved)
        self.num_steps = state["num_steps"]

    def offload(self) -> None:
        """A frozen (reference) engine's parameters to the CPU; a trainable engine refuses.

        megatron-core 0.16.1's DistributedOptimizer.offload_to_cpu failed on the H200 ("CUDA
        error: invalid argument" copying an optimizer parameter after the DDP buffers were
        offloaded), so the trainable engine does not offer offload yet rather than risk
        corrupting its state; use actor.backend=fsdp with actor.offload_params for that.
        """
        if self.device.type == "cpu":
            return
        if self.optimizer is not None:
            raise NotImplementedError(
                "offload() of a trainable megatron engine is not supported (megatron-core 0.16.1's "
                "DistributedOptimizer.offload_to_cpu fails on CUDA); use actor.backend=fsdp with actor.offload_params"
            )
        torch.cuda.synchronize(self.device)
        self.gpt.cpu()
        torch.cuda.empty_cache()

    def onload(self) -> None:
        if self.device.type == "cpu" or self.optimizer is not None:
            return
        self.gpt.to(self.device)
        torch.cuda.synchronize(self.device)
