"""TRL cell of an rl-step matrix: whole GRPO steps of TRL's own `GRPOTrainer.train()`.

Same recipe as the slipstream cells, translated into TRL's settings:
  model       an HF *ForCausalLM of the recipe's preset, random weights (seed trainer.seed),
              sdpa attention, the recipe's dtype (bf16 autocast via `bf16=True` on CUDA)
  tokenizer   the recipe's char or id tokenizer (the HF tokenizer slipstream builds), no chat template
  prompts     the recipe's procedural task (`data.source: task:NAME` + `data.task_params`),
              `prompts_per_step x group_size` completions per optimizer step
  generation  TRL's default: `transformers` generate inside the trainer (no vLLM), with the
              recipe's max_new_tokens / temperature / top_p / top_k
  reward      slipstream's reward functions of the recipe (same code, called inline)
  update      one optimizer step per generation batch (per_device_train_batch_size = all
              completions, gradient_accumulation_steps 1), AdamW with the recipe's lr, betas,
              eps, weight decay, grad clip and warm-up; loss_type from algo.loss_agg
              (token-mean -> dapo, seq-mean-token-mean -> grpo, seq-mean-token-sum-norm -> dr_grpo),
              beta = algo.kl_coef, epsilon = algo.clip_low / clip_high
What is timed (perf_counter after a device sync at each Trainer step boundary):
  step        Trainer callback on_step_begin -> on_step_end (one optimizer step, generation included)
  rollout     GRPOTrainer._generate_and_score_completions (generation + reward + TRL's old /
              ref log-prob passes, which TRL runs inside it), timed by wrapping the bound method
  actor_train step - rollout (forward/backward over the generation batch, clip, optimizer step)
The first `warmup_steps` steps are discarded as in the slipstream cells.
"""

from __future__ import annotations

import random
import tempfile
import time

from benchmarks.peers import missing_result, peer_version

LOSS_TYPES = {"token-mean": "dapo", "seq-mean-token-mean": "grpo", "seq-mean-token-sum-norm": "dr_grpo"}


def trl_settings(cfg) -> dict:
    """GRPOConfig keyword arguments equivalent to a slipstream Config (raises when there is no equivalent)."""
    a, r, algo = cfg.actor, cfg.rollout, cfg.algo
    unmapped = {
        "algo.ppo_n_minibatches": (algo.ppo_n_minibatches, 1),
        "algo.ppo_epochs": (algo.ppo_epochs, 1),  # TRL's num_iterations would split one step over several
        "algo.entropy_coef": (algo.entropy_coef, 0.0),
        "algo.dual_clip_c": (algo.dual_clip_c, None),
        "algo.behav_is_cap": (algo.behav_is_cap, None),
        "rollout.stop": (tuple(r.stop or ()), ()),
    }
    if algo.kl_coef:
        unmapped["algo.kl_estimator"] = (algo.kl_estimator, "k3")  # TRL's beta term is the k3 estimator
    differing = [f"{key}={value!r}" for key, (value, default) in unmapped.items() if value != default]
    if differing:
        raise ValueError(f"the TRL rl-step cell has no equivalent for {', '.join(differing)} (leave them at default)")
    if algo.loss_agg not in LOSS_TYPES:
        raise ValueError(f"algo.loss_agg={algo.loss_agg!r} has no TRL loss_type equivalent ({sorted(LOSS_TYPES)})")
    if algo.advantage != "grpo":
        raise ValueError(f"algo.advantage={algo.advantage!r}: TRL's GRPOTrainer computes GRPO advantages only")
    completions = r.prompts_per_step * r.group_size
    return dict(
        per_device_train_batch_size=completions, gradient_accumulation_steps=1, num_generations=r.group_size,
        max_completion_length=r.max_new_tokens, temperature=r.temperature, top_p=r.top_p,
        top_k=r.top_k if r.top_k and r.top_k > 0 else 0,
        learning_rate=a.lr, adam_beta1=a.betas[0], adam_beta2=a.betas[1], adam_epsilon=a.eps,
        weight_decay=a.weight_decay, max_grad_norm=a.grad_clip if a.grad_clip > 0 else 1e9,
        warmup_steps=a.warmup_steps, lr_scheduler_type="constant_with_warmup",
        loss_type=LOSS_TYPES[algo.loss_agg], beta=algo.kl_coef, epsilon=algo.clip_low,
        epsilon_high=algo.clip_high, num_iterations=1, scale_rewards="group" if algo.std_normalize else "none",
        gradient_checkpointing=a.activation_checkpointing != "none", seed=cfg.trainer.seed,
    )  # fmt: skip


def task_dataset(cfg, num_rows: int):
    """A `datasets.Dataset` of the recipe's task prompts (prompt text + answer), seeded like the run."""
    from datasets import Dataset

    from slipstream.data.tasks import get_task

    source = cfg.data.source
    if not source.startswith("task:"):
        raise ValueError(f"the TRL rl-step cell supports data.source 'task:NAME' recipes, got {source!r}")
    task = get_task(source.removeprefix("task:"), **(cfg.data.task_params or {}))
    rng = random.Random(cfg.trainer.seed)
    rows = [task.sample(rng) for _ in range(num_rows)]
    return Dataset.from_dict({"prompt": [p.prompt for p in rows], "answer": [p.answer for p in rows]}), task


def reward_function(cfg, task):
    """A TRL reward function (prompts, completions, answer=...) -> scores, from the recipe's rewards."""
    from slipstream.rewards.registry import CombinedReward

    names = cfg.reward.functions or [task.reward]
    weights = cfg.reward.weights or [1.0] * len(names)
    combined = CombinedReward(list(zip(names, weights)))

    def slipstream_reward(prompts, completions, answer, **kwargs) -> list[float]:
        return [combined.score(c, a, p)[0] for p, c, a in zip(prompts, completions, answer)]

    return slipstream_reward


def run_trl_rl_step_cell(rl, settings, backend: str) -> dict:
    """`rl.steps` steps of TRL's GRPOTrainer on the rl-step recipe; the cell's result (or an explained row).

    TRL has one engine (transformers' Trainer on accelerate, one process here), so the matrix runs this
    once per recipe, under the backend label "accelerate".
    """
    if peer_version("trl") is None:
        return missing_result("trl")
    import torch

    from slipstream.bench.rl_step import step_statistics
    from slipstream.bench.spec import cell_config

    with tempfile.TemporaryDirectory(prefix="slipstream-trl-rl-step-") as tmp:
        cfg = cell_config(rl, settings, "local", f"{tmp}/run")
        trainer, timer = build_trl_rl_trainer(cfg, rl.steps, tmp)
        start = time.perf_counter()
        trainer.train()
        total_s = time.perf_counter() - start
        device = trainer.accelerator.device
        del trainer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    per_step = timer.per_step_metrics(cfg, device)
    metrics, phases = step_statistics(per_step, rl.warmup_steps)
    r = cfg.rollout
    fairness = {
        "engine": "transformers Trainer on accelerate (no FSDP)",
        "processes": 1,
        "dtype": cfg.model.dtype,
        "attention_kernel": "train and generation: HF sdpa over padded batches",
        "recompute": "gradient checkpointing" if cfg.actor.activation_checkpointing != "none" else "none",
        "real_tokens": round(sum(timer.real_tokens[rl.warmup_steps:]) / max(len(timer.real_tokens) - rl.warmup_steps, 1)),
        "padding_fraction": timer.padding_fraction(),
        "loss_normalisation": f"TRL loss_type={LOSS_TYPES[cfg.algo.loss_agg]}",
        "optimizer": f"AdamW (transformers Trainer) lr={cfg.actor.lr}, grad clip {cfg.actor.grad_clip}",
        "micro_batching": f"one batch of {r.prompts_per_step * r.group_size} padded completions per optimizer step",
        "rollout": f"TRL default generation (transformers generate), T={r.temperature} top_p={r.top_p} "
        f"top_k={r.top_k}, max_new_tokens {r.max_new_tokens}",
        "placement": "colocated, synchronous, one process (TRL default without vLLM)",
    }
    return {
        "status": "ok", "phases": phases, "metrics": metrics, "fairness": fairness,
        "impl": {"name": "trl", "version": peer_version("trl"), "device": str(device), "train_wall_s": total_s,
                 "steps": rl.steps, "warmup_steps": rl.warmup_steps, "grpo_config": trl_settings(cfg)},
    }  # fmt: skip


class StepTimer:
    """Trainer callback + generation wrapper: per-step wall times, rollout times, tokens and rewards."""

    def __init__(self) -> None:
        self.step_s: list[float] = []
        self.rollout_s: list[float] = []
        self.real_tokens: list[int] = []
        self.padded_tokens: list[int] = []
        self.completion_tokens: list[int] = []
        self.seq_lens: list[list[int]] = []
        self.rewards: list[float] = []
        self._t0 = 0.0

    @staticmethod
    def _sync() -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()

    def callback(self):
        from transformers import TrainerCallback

        timer = self

        class _Callback(TrainerCallback):
            def on_step_begin(self, args, state, control, **kwargs):
                timer._sync()
                timer._t0 = time.perf_counter()

            def on_step_end(self, args, state, control, **kwargs):
                timer._sync()
                timer.step_s.append(time.perf_counter() - timer._t0)

            def on_log(self, args, state, control, logs=None, **kwargs):
                if logs and "reward" in logs:
                    timer.rewards.append(float(logs["reward"]))

        return _Callback()

    def wrap_generation(self, trainer) -> None:
        original = trainer._generate_and_score_completions

        def timed(inputs):
            self._sync()
            start = time.perf_counter()
            out = original(inputs)
            self._sync()
            self.rollout_s.append(time.perf_counter() - start)
            prompt, completion = out["prompt_mask"], out["completion_mask"]
            lens = (prompt.sum(1) + completion.sum(1)).tolist()
            self.seq_lens.append([int(n) for n in lens])
            self.real_tokens.append(int(sum(lens)))
            self.padded_tokens.append(int(prompt.numel() + completion.numel()))
            self.completion_tokens.append(int(completion.sum()))
            return out

        trainer._generate_and_score_completions = timed

    def padding_fraction(self) -> float:
        padded = sum(self.padded_tokens)
        return 1.0 - sum(self.real_tokens) / padded if padded else 0.0

    def per_step_metrics(self, cfg, device) -> list[dict[str, float]]:
        """One dict per step with the rl-step metric names slipstream's cells report."""
        from slipstream.bench.train_step import peak_for
        from slipstream.models.presets import get_preset
        from slipstream.perf.flops import train_flops

        model_cfg = get_preset(cfg.model.preset)
        peak = peak_for(device, cfg.trainer.peak_flops)
        steps = min(len(self.step_s), len(self.rollout_s))
        if steps == 0:
            raise RuntimeError("TRL ran no step (no timing was recorded)")
        out = []
        for i in range(steps):
            train_s = max(self.step_s[i] - self.rollout_s[i], 1e-9)
            flops = train_flops(model_cfg, self.seq_lens[i])
            m = {
                "perf/step_time": self.step_s[i], "perf/rollout_time": self.rollout_s[i],
                "perf/actor_train_time": train_s, "perf/actor_train_tflops": flops / train_s / 1e12,
                "perf/actor_train_tok_per_s": self.real_tokens[i] / train_s,
                "perf/wait_time_ratio": self.rollout_s[i] / self.step_s[i],
                "perf/rollout_tokens_per_gpu_per_s": self.completion_tokens[i] / self.rollout_s[i],
                "reward/mean": self.rewards[i] if i < len(self.rewards) else float("nan"),
            }  # fmt: skip
            if peak:
                m["perf/actor_train_mfu"] = flops / train_s / peak
            out.append(m)
        return out


def build_trl_rl_trainer(cfg, steps: int, output_dir: str):
    """(GRPOTrainer ready to `train()` for `steps` steps, its StepTimer)."""
    import torch
    from trl import GRPOConfig, GRPOTrainer

    from slipstream.bench.naive import build_hf_model
    from slipstream.models.presets import get_preset
    from slipstream.controller.setup import build_tokenizer

    name = cfg.model.tokenizer or "char"
    if cfg.model.path or not (name == "char" or name.startswith("ids:")):
        raise ValueError("the TRL rl-step cell builds preset models with the char or id tokenizer "
                         "(model.tokenizer: char or ids:VOCAB)")  # fmt: skip
    device = torch.device(cfg.trainer.device if cfg.trainer.device != "auto" else
                          ("cuda" if torch.cuda.is_available() else "cpu"))  # fmt: skip
    model_cfg = get_preset(cfg.model.preset)
    torch.manual_seed(cfg.trainer.seed)
    model = build_hf_model(model_cfg, torch.float32, device)
    r = cfg.rollout
    dataset, task = task_dataset(cfg, r.prompts_per_step * (steps + 1))
    bf16 = device.type == "cuda" and cfg.model.dtype == "bfloat16"
    args = GRPOConfig(
        output_dir=output_dir, max_steps=steps, logging_steps=1, report_to="none", save_strategy="no",
        bf16=bf16, use_cpu=device.type == "cpu", dataloader_num_workers=0, **trl_settings(cfg),
    )  # fmt: skip
    tokenizer = build_tokenizer(cfg)
    trainer = GRPOTrainer(
        model=model, reward_funcs=[reward_function(cfg, task)], args=args, train_dataset=dataset,
        processing_class=tokenizer,
    )  # fmt: skip
    timer = StepTimer()
    trainer.add_callback(timer.callback())
    timer.wrap_generation(trainer)
    return trainer, timer


__all__ = ["run_trl_rl_step_cell", "trl_settings", "task_dataset", "reward_function", "StepTimer"]
