"""TRL cell of the benchmark matrix: the installed `trl` GRPOTrainer's own loss path on our batch.

What is built: a real `trl.GRPOTrainer` (GRPOConfig defaults unless the spec overrides them)
around an HF *ForCausalLM of the workload's preset with random weights. Its rollout is skipped:
the pre-built `PackedBatch` is turned into the dict `_generate_and_score_completions` returns
(prompts left-padded and completions right-padded over the WHOLE generation batch with trl's
own `pad`, then `split_tensor_dict` into `per_device_train_batch_size` micro-batches), so every
micro-batch carries TRL's padding exactly as TRL produces it.

What is timed (device events on CUDA):
  actor_train  for each micro-batch: `compute_loss` under `compute_loss_context_manager` and
               `accelerator.backward` (the body of Trainer.training_step), then the Trainer
               loop's gradient clip, optimizer step, scheduler step and zero_grad.
  log_probs    `_get_per_token_logps_and_entropies` under no_grad with gradient checkpointing
               disabled, over the whole generation batch in chunks of per_device_train_batch_size
               (TRL's old / ref log-prob pass).
Trainer.training_step itself is not called: GRPOTrainer's `_prepare_inputs` inside it would
generate completions. Old log-probs are passed in (as with num_iterations > 1), so the PPO
ratio is not identically 1; that changes no shapes and no FLOPs.

TRL's loss types vs slipstream's aggregation (checked by `trl_loss_cross_check`):
  dapo (TRL default)  sum over loss tokens / loss tokens of the generation batch == token-mean
  grpo                per-sequence token mean, averaged over sequences == seq-mean-token-mean
  dr_grpo             sum / (num sequences * max_completion_length) == seq-mean-token-sum-norm
  bnpo                token mean of each micro-batch / accumulation steps (no slipstream twin)
"""

from __future__ import annotations

import tempfile

import torch

from benchmarks.peers import missing_result, peer_version
from slipstream.algo.losses import SpecLoss
from slipstream.batching.records import PackedBatch
from slipstream.bench import train_step as ts
from slipstream.bench.settings import CellSettings, TrlSettings
from slipstream.bench.naive import build_hf_model, paired_models
from slipstream.bench.workloads import Workload, get_workload, synthetic_batch
from slipstream.models.config import ModelConfig
from slipstream.models.presets import get_preset
from slipstream.models.tokenizer import build_char_tokenizer
from slipstream.perf.flops import forward_flops, train_flops

# slipstream aggregation mode equal to each TRL loss_type over one generation batch.
SLIPSTREAM_AGG = {"dapo": "token-mean", "grpo": "seq-mean-token-mean", "dr_grpo": "seq-mean-token-sum-norm"}
_NORMALISATION = {
    "dapo": "dapo: sum over loss tokens / loss tokens of the whole generation batch (token-mean)",
    "bnpo": "bnpo: token mean within each micro-batch / accumulation steps",
    "grpo": "grpo: per-sequence token mean, averaged over sequences",
    "dr_grpo": "dr_grpo: sum / (sequences * max_completion_length)",
}


def _zero_reward(completions, **kwargs) -> list[float]:
    """Reward function GRPOTrainer requires; never called, because no rollout runs."""
    return [0.0] * len(completions)


def trl_inputs(batch: PackedBatch, pad_token_id: int, pad_to_multiple_of: int | None = None) -> dict[str, torch.Tensor]:
    """The generation-batch dict GRPOTrainer builds after rollout, for the sequences of `batch`.

    prompt_ids / prompt_mask (N, P) are left-padded and completion_ids / completion_mask /
    old_per_token_logps (N, C) right-padded to the longest prompt / completion of the batch, with
    trl's own `pad`. Old log-probs and advantages are read at the packed positions that predict
    each completion token (PackedBatch convention: position t predicts targets[t]).
    """
    from trl.trainer.utils import pad

    if batch.old_logprobs is None:
        raise ValueError("trl_inputs needs batch.old_logprobs (use synthetic_batch)")
    cu = batch.cu_seqlens.tolist()
    prompts, completions, old, advantages = [], [], [], []
    for i in range(batch.num_seqs):
        lo, hi = cu[i], cu[i + 1]
        loss_pos = batch.loss_mask[lo:hi].nonzero().flatten()
        assert loss_pos.numel() > 0, "every sequence of a bench batch has a response"
        p = int(loss_pos[0]) + 1  # the first loss position is the last prompt token
        prompts.append(batch.input_ids[lo : lo + p])
        completions.append(batch.input_ids[lo + p : hi])
        old.append(batch.old_logprobs[lo + p - 1 : hi - 1])
        advantages.append(batch.advantages[lo + p - 1])
    completion_mask = pad([torch.ones_like(c) for c in completions], 0, "right", pad_to_multiple_of)
    return {
        "prompt_ids": pad(prompts, pad_token_id, "left", pad_to_multiple_of),
        "prompt_mask": pad([torch.ones_like(p) for p in prompts], 0, "left", pad_to_multiple_of),
        "completion_ids": pad(completions, pad_token_id, "right", pad_to_multiple_of),
        "completion_mask": completion_mask,
        "old_per_token_logps": pad(old, 0.0, "right", pad_to_multiple_of),
        "advantages": torch.stack(advantages),
        # Loss tokens of the generation batch: the dapo denominator (one process here).
        "num_items_in_batch": completion_mask.sum(),
    }


def build_trl_trainer(
    model, w: Workload, output_dir: str, per_device_train_batch_size: int = 8, loss_type: str = "dapo",
    gradient_checkpointing: bool = True, bf16: bool = True, use_liger_kernel: bool = False,
):  # fmt: skip
    """A GRPOTrainer around `model`, set up as `trainer.train()` would be before its first step."""
    from datasets import Dataset
    from trl import GRPOConfig, GRPOTrainer

    if w.num_seqs % per_device_train_batch_size:
        raise ValueError(
            f"per_device_train_batch_size={per_device_train_batch_size} does not divide {w.num_seqs} sequences"
        )
    accumulation = w.num_seqs // per_device_train_batch_size
    on_cpu = next(model.parameters()).device.type == "cpu"
    args = GRPOConfig(
        output_dir=output_dir, per_device_train_batch_size=per_device_train_batch_size,
        gradient_accumulation_steps=accumulation, num_generations=w.group_size,
        max_completion_length=w.response_len[1], loss_type=loss_type,
        gradient_checkpointing=gradient_checkpointing, bf16=bf16, use_cpu=on_cpu, use_liger_kernel=use_liger_kernel,
        report_to="none", save_strategy="no", logging_steps=1, seed=w.seed,
    )  # fmt: skip
    trainer = GRPOTrainer(
        model=model, reward_funcs=[_zero_reward], args=args,
        train_dataset=Dataset.from_dict({"prompt": ["x"] * w.num_seqs}), processing_class=build_char_tokenizer(),
    )  # fmt: skip
    if use_liger_kernel:
        _apply_liger(trainer)
    if gradient_checkpointing:
        _enable_checkpointing(trainer)
    trainer.create_optimizer_and_scheduler(num_training_steps=10_000)
    # Set per optimizer step by Trainer's loop; the grpo / bnpo / dr_grpo losses divide by it.
    trainer.current_gradient_accumulation_steps = accumulation
    trainer.model.train()
    return trainer


def _apply_liger(trainer) -> None:
    # What Trainer.train() does first with use_liger_kernel (this adapter never calls train()): patch
    # Liger's layer kernels into the model instance, with GRPOTrainer's config (no fused cross-entropy).
    from liger_kernel.transformers import _apply_liger_kernel_to_instance

    _apply_liger_kernel_to_instance(model=trainer.model, **(trainer.args.liger_kernel_config or {}))


def _enable_checkpointing(trainer) -> None:
    # What Trainer.train() does before its loop. transformers 5.24 renamed the option and the
    # model method (activation_checkpointing*); 5.17 only has gradient_checkpointing*.
    args, model = trainer.args, trainer.model
    kwargs = getattr(args, "activation_checkpointing_kwargs", None) or args.gradient_checkpointing_kwargs or {}
    kwargs = {k: v for k, v in kwargs.items() if k not in ("every_n_layers", "offload")} or None
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)


def trl_micro_batches(trainer, batch: PackedBatch, device: torch.device) -> tuple[dict, list[dict]]:
    """(whole generation batch, its per-step micro-batches) on `device`, padded and split as TRL does."""
    from trl.trainer.utils import split_tensor_dict

    full = trl_inputs(batch, trainer._tokenizer.pad_token_id, trainer.pad_to_multiple_of)
    full = {k: v.to(device) for k, v in full.items()}
    return full, split_tensor_dict(full, trainer.args.steps_per_generation)


def trl_actor_update(trainer, micro_batches: list[dict]) -> list[torch.Tensor]:
    """One optimizer step over the micro-batches, as Trainer's loop runs it; returns the losses."""
    model, acc = trainer.model, trainer.accelerator
    losses = []
    for inputs in micro_batches:
        model.train()
        with trainer.compute_loss_context_manager():
            loss = trainer.compute_loss(model, inputs, num_items_in_batch=inputs["num_items_in_batch"])
        acc.backward(loss)
        losses.append(loss.detach())
    if trainer.args.max_grad_norm > 0:
        acc.clip_grad_norm_(model.parameters(), trainer.args.max_grad_norm)
    trainer.optimizer.step()
    trainer.lr_scheduler.step()
    model.zero_grad()
    return losses


def trl_log_probs(trainer, full: dict) -> torch.Tensor:
    """TRL's old / ref log-prob pass over the whole generation batch, (N, C)."""
    from trl.models.utils import disable_gradient_checkpointing

    input_ids = torch.cat([full["prompt_ids"], full["completion_ids"]], dim=1)
    attention_mask = torch.cat([full["prompt_mask"], full["completion_mask"]], dim=1)
    with torch.no_grad(), disable_gradient_checkpointing(trainer.model, trainer.args.gradient_checkpointing_kwargs):
        logps, _, _ = trainer._get_per_token_logps_and_entropies(
            trainer.model, input_ids, attention_mask, full["completion_ids"].size(1),
            batch_size=trainer.args.per_device_train_batch_size,
        )  # fmt: skip
    return logps


def bench_trl(
    w: Workload, settings: CellSettings, trl: TrlSettings, cfg: ModelConfig | None = None
) -> dict:
    """Time TRL's actor update and log-prob pass on the workload; a matrix cell result."""
    import trl as trl_pkg

    cfg = cfg or get_preset(w.preset)
    device = ts.resolve_device(settings.device)
    dtype = getattr(torch, settings.dtype)
    params_dtype = getattr(torch, trl.params_dtype or settings.dtype)
    checkpointing = trl_checkpointing(settings, trl)
    torch.manual_seed(w.seed)
    # TRL trains the parameters in the dtype they were loaded in (bf16 for released Qwen3).
    model = build_hf_model(cfg, params_dtype, device)
    batch = synthetic_batch(w, cfg.vocab_size)
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = build_trl_trainer(
            model, w, out_dir, trl.per_device_train_batch_size, trl.loss_type, checkpointing,
            bf16=dtype == torch.bfloat16, use_liger_kernel=trl.use_liger_kernel,
        )  # fmt: skip
        full, micro = trl_micro_batches(trainer, batch, device)
        losses: list[torch.Tensor] = []
        train_times, train_peak = ts.repeat_timed(
            lambda: losses.extend(trl_actor_update(trainer, micro)), device, settings.repeats, settings.warmup
        )  # fmt: skip
        fwd_times, fwd_peak = ts.repeat_timed(
            lambda: trl_log_probs(trainer, full), device, settings.repeats, settings.warmup
        )
        args = trainer.args
        attn = trainer.model.config._attn_implementation
        trainer = model = None  # free before _free(); the lambdas above read these names
    ts._free(device)

    lens = batch.seq_lens()
    real = sum(lens)
    width = full["prompt_ids"].size(1) + full["completion_ids"].size(1)
    padded = w.num_seqs * width  # every micro-batch row has the generation batch's full width
    peak = ts.peak_for(device, settings.peak_flops)
    last_loss = float(sum(losses[-len(micro) :]))
    return {
        "status": "ok",
        "phases": {
            "actor_train": ts.phase_stats(train_times, train_flops(cfg, lens), real, train_peak, peak),
            "log_probs": ts.phase_stats(fwd_times, forward_flops(cfg, lens), real, fwd_peak, peak),
        },
        "micro_batches": {
            "count": len(micro),
            "num_seqs": [int(m["prompt_ids"].size(0)) for m in micro],
            "padded_tokens": [int(m["prompt_ids"].numel() + m["completion_ids"].numel()) for m in micro],
        },
        "fairness": {
            "engine": "transformers Trainer on accelerate (no FSDP)"
            + (", Liger layer kernels (RMSNorm, SwiGLU, RoPE)" if trl.use_liger_kernel else ""),
            "processes": 1,
            "compile": "no",
            "dtype": settings.dtype,
            "params_dtype": f"{str(params_dtype).removeprefix('torch.')} parameters and AdamW state, "
            + (f"{settings.dtype} autocast" if params_dtype != dtype else "no master copy"),
            "attention_kernel": f"{attn} (padded rows, attention mask)",
            "recompute": "full (HF gradient checkpointing, every layer)" if checkpointing else "none",
            "real_tokens": real,
            "padded_tokens": padded,
            "padding_fraction": 1.0 - real / padded,
            "loss_normalisation": _NORMALISATION[trl.loss_type],
            "optimizer": f"{_enum_value(args.optim)} lr={args.learning_rate} betas=({args.adam_beta1},{args.adam_beta2}) "
            f"wd={args.weight_decay}, grad clip {args.max_grad_norm}",
            "micro_batching": f"{trl.per_device_train_batch_size} sequences per micro-batch x {len(micro)} "
            f"accumulation steps, rows padded to {width} tokens (max prompt + max completion of the batch)",
            "logprob_head": "trl add_fused_lm_head (chunked; log-probs and entropy, no (B, S, V) logits)",
        },
        "impl": {
            "name": "trl",
            "version": trl_pkg.__version__,
            "accelerate": _version("accelerate"),
            "config": {
                "loss_type": args.loss_type, "per_device_train_batch_size": args.per_device_train_batch_size,
                "gradient_accumulation_steps": args.gradient_accumulation_steps,
                "gradient_checkpointing": checkpointing, "bf16": args.bf16, "optim": _enum_value(args.optim),
                "use_liger_kernel": args.use_liger_kernel, "params_dtype": str(params_dtype).removeprefix("torch."),
                "beta": args.beta, "epsilon": args.epsilon, "epsilon_high": args.epsilon_high,
                "temperature": args.temperature, "attn_implementation": attn, "device": str(device),
                "repeats": settings.repeats, "warmup": settings.warmup,
            },  # fmt: skip
            "timed": "actor_train: compute_loss + accelerator.backward per micro-batch, then clip, optimizer and "
            "scheduler step, zero_grad; log_probs: _get_per_token_logps_and_entropies under no_grad",
            "workarounds": [
                "rollout skipped: the pre-built batch stands in for _generate_and_score_completions' output",
                "Trainer.training_step's body is replayed (its _prepare_inputs would generate)",
                "no shuffle_sequence_dict before splitting (every row has the same padded width either way)",
            ],
            "last_loss": last_loss,
        },
    }


def _enum_value(x) -> str:
    # TrainingArguments turns `optim` into an OptimizerNames enum after parsing.
    return str(getattr(x, "value", x))


def _version(module: str) -> str | None:
    import importlib.metadata

    try:
        return importlib.metadata.version(module)
    except importlib.metadata.PackageNotFoundError:
        return None


def trl_checkpointing(settings: CellSettings, trl: TrlSettings) -> bool:
    """Whether the TRL cell turns HF gradient checkpointing on (full recompute of every layer)."""
    return trl.gradient_checkpointing == "on" or (trl.gradient_checkpointing == "follow" and settings.recompute != "none")


def run_trl_cell(w: Workload, settings: CellSettings, trl: TrlSettings) -> dict:
    """The matrix cell for TRL: "missing" (with the install command) when trl, or liger-kernel if asked for, is not."""
    if peer_version("trl") is None:
        return missing_result("trl")
    if trl.use_liger_kernel and peer_version("liger-kernel") is None:
        return missing_result("liger-kernel")
    return bench_trl(w, settings, trl)


def trl_loss_cross_check(
    workload: Workload | str = "tiny", per_device_train_batch_size: int = 4, loss_type: str = "dapo", seed: int = 0
) -> dict[str, float]:
    """fp32 CPU loss of TRL's compute_loss (summed over micro-batches) and slipstream's, same weights and batch."""
    if loss_type not in SLIPSTREAM_AGG:
        raise ValueError(f"loss_type {loss_type!r} has no slipstream equivalent; choose from {list(SLIPSTREAM_AGG)}")
    from slipstream.algo.losses import LossSpec

    w = get_workload(workload) if isinstance(workload, str) else workload
    cfg, native, hf_model, batch = paired_models(w, seed)
    with tempfile.TemporaryDirectory() as out_dir:
        trainer = build_trl_trainer(
            hf_model, w, out_dir, per_device_train_batch_size, loss_type, gradient_checkpointing=False, bf16=False
        )
        _, micro = trl_micro_batches(trainer, batch, torch.device("cpu"))
        with torch.no_grad():
            trl_loss = sum(float(trainer.compute_loss(trainer.model, m)) for m in micro)
    engine = ts.build_engine_for_bench(native, "local", torch.device("cpu"), torch.float32)
    mbs = ts.plan_and_select(batch, cfg, max_tokens_per_mb=max(batch.seq_lens()) * 2)
    loss_fn = SpecLoss(LossSpec(agg_mode=SLIPSTREAM_AGG[loss_type]), needs_entropy=False)
    # Dr.GRPO's constant is TRL's max_completion_length, the workload's longest response budget.
    metrics = engine.forward_backward(mbs, loss_fn, max_response_len=w.response_len[1])
    return {"trl": trl_loss, "slipstream": float(metrics["actor/pg_loss"]), "num_micro_batches": float(len(micro))}
