"""`mode: rl-step` of `slipstream bench matrix`: whole GRPO steps, timed phase by phase.

A cell builds `RLTrainer` from a recipe plus overrides (given once in the spec, so they are the
same for every cell) in a temporary run_dir, runs `steps` full steps (rollout, reward,
advantages, log-prob passes, update, weight sync) and keeps what `RLTrainer.step()` reports.
The first `warmup_steps` steps are discarded (allocator warm-up, reward-worker start-up,
compilation); every `perf/` metric is then summarised as median and min-max over the timed
steps. Only the backend (`actor.backend`) varies between the slipstream cells.

    mode: rl-step
    frameworks: [slipstream, trl]
    backends: [local, fsdp]
    rl_step:
      recipe: recipes/demo.yaml     # read from the current directory
      steps: 6                      # total, warm-up included
      warmup_steps: 1
      overrides: [rollout.max_new_tokens=4]

Cells: slipstream x local|fsdp|megatron run (world size 1); trl x accelerate runs TRL's own
GRPOTrainer.train() on the same recipe once (benchmarks/peers/trl_rl_step.py; TRL has one
engine); verl x * are explained rows.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

from slipstream.bench.rows import ROW_KEYS, SCHEMA, STATUSES, add_noise
from slipstream.bench.settings import CellSettings, MatrixSpec, RLStepSettings
from slipstream.bench.spec import cell_config
from slipstream.config.schema import Config

RL_PHASES = ("rollout", "reward", "old_log_probs", "ref_log_probs", "actor_train", "update_weights")
"""Phases of one step in the order they run (the "step" phase encloses them all)."""
CORE_METRICS = (
    "perf/step_time", "perf/rollout_time", "perf/actor_train_time", "perf/actor_train_tflops",
    "perf/actor_train_mfu", "perf/actor_train_tok_per_s", "perf/wait_time_ratio",
    "perf/rollout_tokens_per_gpu_per_s",
)  # fmt: skip
"""The metric set of docs/architecture.md#metrics (plus perf/max_memory_allocated_gb/<phase> on CUDA); MFU needs a known peak."""
_MEM_PREFIX = "perf/max_memory_allocated_gb/"


def held_constant_rl(spec: MatrixSpec) -> dict:
    """Settings shared by every rl-step row: the recipe, overrides, step counts and the resolved config."""
    rl = spec.rl_step
    assert rl is not None
    cfg = dataclasses.asdict(cell_config(rl, spec.settings, backend="local", run_dir="<temporary>"))
    del cfg["actor"]["backend"]  # varied by the matrix
    return {
        "mode": "rl-step",
        "recipe": rl.recipe,
        "overrides": list(rl.overrides),
        "steps": rl.steps,
        "warmup_steps": rl.warmup_steps,
        "device": spec.settings.device,
        "peak_flops": spec.settings.peak_flops,
        "frameworks": list(spec.frameworks),
        "backends": list(spec.backends),
        "config": cfg,
    }


def workload_info(rl: RLStepSettings, cfg: Config) -> dict:
    """What an rl-step row trains on, read from the resolved config."""
    r = cfg.rollout
    return {
        "name": rl.name, "recipe": rl.recipe, "preset": cfg.model.path or cfg.model.preset,
        "data_source": cfg.data.source, "prompts_per_step": r.prompts_per_step, "group_size": r.group_size,
        "num_seqs": r.prompts_per_step * r.group_size, "max_new_tokens": r.max_new_tokens,
    }  # fmt: skip


# ---------------------------------------------------------------- statistics


def summarise(values: Sequence[float]) -> dict:
    """Median, min and max of the timed values (the values themselves kept for re-analysis)."""
    if not values:
        raise ValueError("no values to summarise")
    return {"median": statistics.median(values), "min": min(values), "max": max(values), "values": list(values)}


_SUMMARISED = ("perf/", "async/", "rollout/")
"""Metrics summarised over the timed steps: speed and memory, the async loop's staleness and drops, the
rollout's log-prob mismatch against the trainer and its truncation share."""


def step_statistics(per_step: Sequence[Mapping[str, float]], warmup_steps: int) -> tuple[dict, dict]:
    """(metrics, phases) of a run: every perf/, async/ and rollout/ metric over the timed steps, and per-phase
    time stats.

    A metric enters only when every timed step reports it (e.g. MFU needs a known peak, peak memory
    needs CUDA). `reward/mean` keeps its first and last value over all steps, warm-up included.
    """
    if len(per_step) <= warmup_steps:
        raise ValueError(f"{len(per_step)} steps leave none to time after {warmup_steps} warm-up steps")
    timed = per_step[warmup_steps:]
    names = sorted(k for k in timed[0] if k.startswith(_SUMMARISED) and all(k in m for m in timed))
    metrics = {k: summarise([float(m[k]) for m in timed]) for k in names}
    rewards = [float(m["reward/mean"]) for m in per_step]
    metrics["reward/mean"] = {**summarise(rewards[warmup_steps:]), "first": rewards[0], "last": rewards[-1],
                              "all_steps": rewards}  # fmt: skip

    phases = {}
    for phase in (*RL_PHASES, "step"):
        t = metrics.get(f"perf/{phase}_time")
        if t is None:
            continue
        mem = metrics.get(_MEM_PREFIX + phase)
        phases[phase] = {
            "time_s": t["median"], "time_min_s": t["min"], "time_max_s": t["max"], "times_s": t["values"],
            "peak_memory_gib": mem["median"] if mem else None,
        }  # fmt: skip
    if "actor_train" in phases:  # the same keys as a train-step phase, so the report's plots read both
        def median(key: str) -> float | None:
            return metrics[key]["median"] if key in metrics else None

        phases["actor_train"] |= {
            "tflops": median("perf/actor_train_tflops"), "tok_per_s": median("perf/actor_train_tok_per_s"),
            "mfu": median("perf/actor_train_mfu"),
        }  # fmt: skip
    return metrics, add_noise(phases)


# ---------------------------------------------------------------- cells


def shape_rollout(trainer, rl: RLStepSettings) -> None:
    """Apply the spec's per-sample budgets and stop-token policy to a built trainer's rollout stage."""
    st = trainer.stages
    if rl.ignore_stop:
        st.sampling = dataclasses.replace(st.sampling, stop_token_ids=())
    st.sample_budgets = rl.sample_budgets(trainer.cfg.rollout.prompts_per_step * st.sampling.n)


def _placement(cfg) -> str:
    """The fairness line's placement: colocated in one process, the loop, and the settings that change how
    rollout and training share the device."""
    t, r = cfg.trainer, cfg.rollout
    if t.mode == "sync":
        parts = ["synchronous"] + ([] if r.sleep_during_train else ["rollout awake while training"])
    else:
        parts = [f"asynchronous, max_staleness {t.max_staleness}"]
        parts += [] if t.async_stream else ["rollout on the trainer's CUDA stream"]
        parts += ["in-flight requests re-prefilled at a weight sync"] if r.on_weight_update == "reprefill" else []
    return "colocated, one process (trainer and rollout share the device), " + ", ".join(parts)


def run_slipstream_rl_step(rl: RLStepSettings, settings: CellSettings, backend: str) -> dict:
    """Run `rl.steps` GRPO steps of slipstream on `backend` in a temporary run_dir; the cell's result."""
    import torch

    from slipstream.controller.trainer import RLTrainer
    from slipstream.ops.attention import kernel_for

    with tempfile.TemporaryDirectory(prefix="slipstream-rl-step-") as tmp:
        cfg = cell_config(rl, settings, backend, Path(tmp) / "run")
        start = time.perf_counter()
        trainer = RLTrainer(cfg)
        shape_rollout(trainer, rl)
        setup_s = time.perf_counter() - start
        try:
            per_step = [trainer.step() for _ in range(rl.steps)]
            device = trainer.device
        finally:
            trainer.close()
        del trainer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    metrics, phases = step_statistics(per_step, rl.warmup_steps)
    dtype = getattr(torch, cfg.model.dtype)
    kernel = kernel_for(device, dtype, compiled=cfg.actor.compile)
    # Trained tokens per step: tok/s x train time / passes (packed, so every token is real).
    tokens = [
        m["perf/actor_train_tok_per_s"] * m["perf/actor_train_time"] / cfg.algo.ppo_epochs
        for m in per_step[rl.warmup_steps:] if "perf/actor_train_tok_per_s" in m
    ]  # fmt: skip
    a, r = cfg.actor, cfg.rollout
    fairness = {
        "engine": {"local": "one process, no wrapper", "fsdp": "FSDP2 (fully_shard per block)",
                   "megatron": "megatron-core DDP + distributed optimizer"}.get(backend, backend),  # fmt: skip
        "processes": 1,
        "dtype": cfg.model.dtype,
        "attention_kernel": f"train: {kernel} over packed sequences (no padding)",
        "recompute": a.activation_checkpointing,
        "real_tokens": round(statistics.median(tokens)) if tokens else None,
        "padding_fraction": 0.0,
        "loss_normalisation": f"{cfg.algo.loss_agg} over the minibatch (global denominator)",
        "optimizer": f"AdamW lr={a.lr} betas={tuple(a.betas)} wd={a.weight_decay}, grad clip {a.grad_clip}",
        "micro_batching": f"token budget {a.max_tokens_per_mb} ({a.planner} planner)",
        "rollout": f"builtin engine (continuous batching, {r.decode_attention} decode attention), T={r.temperature} "
        f"top_p={r.top_p} top_k={r.top_k}, max_new_tokens "
        f"{'linspace(256, 3584) per sample' if rl.budgets == 'w1' else r.max_new_tokens}"
        f"{', stop tokens ignored' if rl.ignore_stop else ''}, {r.prompts_per_step} prompts x group {r.group_size}",
        "placement": _placement(cfg),
    }
    return {
        "status": "ok",
        "phases": phases,
        "metrics": metrics,
        "fairness": fairness,
        "impl": {"name": "slipstream", "version": None, "backend": backend, "device": str(device),
                 "setup_time_s": setup_s, "steps": rl.steps, "warmup_steps": rl.warmup_steps},  # fmt: skip
    }


def make_rl_step_row(spec: MatrixSpec, rl: RLStepSettings, framework: str, backend: str, result: dict,
                     env: dict) -> dict:  # fmt: skip
    """One JSONL row of an rl-step cell, with the same ROW_KEYS as a train-step row."""
    row = {
        "schema": SCHEMA,
        "cell": f"{rl.name}/{framework}/{backend}",
        "workload": workload_info(rl, cell_config(rl, spec.settings, backend="local", run_dir="<temporary>")),
        "framework": framework,
        "backend": backend,
        "mode": "rl-step",
        "status": result["status"],
        "reason": result.get("reason"),
        "install": result.get("install"),
        "held_constant": held_constant_rl(spec),
        "phases": result.get("phases") or {},
        "metrics": result.get("metrics") or {},
        "micro_batches": None,
        "fairness": result.get("fairness"),
        "impl": result.get("impl"),
        "env": env,
    }
    assert tuple(row) == ROW_KEYS and row["status"] in STATUSES
    return row


# ---------------------------------------------------------------- report


def _fmt(value, spec: str) -> str:
    return "-" if value is None else format(value, spec)


def _stat(row: dict, key: str, spec: str, spread: bool = False) -> str:
    m = row["metrics"].get(key)
    if m is None:
        return "-"
    text = format(m["median"], spec)
    return f"{text} ({format(m['min'], spec)}-{format(m['max'], spec)})" if spread else text


def rl_step_markdown(rows: Sequence[dict]) -> list[str]:
    """Header facts and the result table of an rl-step matrix (medians, min-max for the times)."""
    env, held = rows[0]["env"], rows[0]["held_constant"]
    cfg = held["config"]
    mem_phases = [p for p in (*RL_PHASES, "step") if any(_MEM_PREFIX + p in r["metrics"] for r in rows)]
    overrides = ", ".join(f"`{o}`" for o in held["overrides"]) or "none"
    lines = [
        "# Benchmark matrix (rl-step)",
        "",
        f"- Device: {env.get('gpu') or 'CPU'} x{max(env.get('num_gpus') or 0, 1)}; torch {env.get('torch')}, "
        f"transformers {env.get('transformers')}, CUDA {env.get('cuda')}, Python {env.get('python')}",
        f"- Commit: `{env.get('git_commit')}`; recorded {env.get('time')}",
        f"- Command: `{env.get('command')}`",
        f"- Held constant: recipe `{held['recipe']}` with overrides {overrides}; model {cfg['model']['preset']} "
        f"({cfg['model']['dtype']}), {cfg['rollout']['prompts_per_step']} prompts x group "
        f"{cfg['rollout']['group_size']}, max_new_tokens {cfg['rollout']['max_new_tokens']}, recompute "
        f"{cfg['actor']['activation_checkpointing']}, micro-batch budget {cfg['actor']['max_tokens_per_mb']} tokens; "
        f"{held['steps']} steps per cell, the first {held['warmup_steps']} discarded (median, min-max over the rest)",
        "- Per GPU: train TFLOP/s and tok/s count real trained tokens (model FLOPs, docs/architecture.md#tokens-flops-and-mfu); wait = share of the "
        "step the trainer is not running trainer phases; rollout tok/s = response tokens / rollout time; MFU "
        f"against {'an override peak of %.0f TFLOP/s' % (held['peak_flops'] / 1e12) if held['peak_flops'] else 'the datasheet dense bf16 peak'} "
        "(- where no peak is known, e.g. the CPU)",
        "",
    ]
    head = ("| workload | framework | backend | status | step s (min-max) | rollout s (min-max) | train s (min-max) "
            "| train TFLOP/s | MFU | train tok/s/GPU | wait | rollout tok/s/GPU | reward first->last |")  # fmt: skip
    head += "".join(f" peak GiB {p} |" for p in mem_phases)
    lines += [head, "|---" * (13 + len(mem_phases)) + "|"]
    for r in rows:
        cells = f"| {r['workload']['name']} ({r['workload']['preset']}) | {r['framework']} | {r['backend']} | {r['status']} |"
        if r["status"] != "ok":
            lines.append(cells + " - |" * (9 + len(mem_phases)))
            continue
        reward = r["metrics"].get("reward/mean")
        values = [
            _stat(r, "perf/step_time", ".3f", True), _stat(r, "perf/rollout_time", ".3f", True),
            _stat(r, "perf/actor_train_time", ".3f", True), _stat(r, "perf/actor_train_tflops", ".3g"),
            _fmt(r["metrics"]["perf/actor_train_mfu"]["median"] if "perf/actor_train_mfu" in r["metrics"] else None,
                 ".1%"),
            _stat(r, "perf/actor_train_tok_per_s", ",.0f"), _stat(r, "perf/wait_time_ratio", ".1%"),
            _stat(r, "perf/rollout_tokens_per_gpu_per_s", ",.0f"),
            f"{reward['first']:.3f} -> {reward['last']:.3f}" if reward else "-",
            *(_stat(r, _MEM_PREFIX + p, ".2f") for p in mem_phases),
        ]  # fmt: skip
        lines.append(cells + "".join(f" {v} |" for v in values))
    if not mem_phases:
        lines += ["", "Peak memory per phase: not measured (it is read from the CUDA allocator)."]
    return lines
