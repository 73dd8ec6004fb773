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

Cells: slipstream x local|fsdp|megatron run (world size 1); trl x local|fsdp runs TRL's own
GRPOTrainer.train() on the same recipe (slipstream/bench/peers/trl_rl_step.py; TRL has one
engine, so both backend columns run the same TRL code); verl x * are explained rows.
"""

from __future__ import annotations

import dataclasses
import statistics
import tempfile
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from slipstream.bench.matrix import (
    FRAMEWORKS, ROW_KEYS, SCHEMA, STATUSES, CellSettings, MatrixSpec, _check_keys, _choice, _choice_list, _int,
    _peak, add_noise,
)  # fmt: skip
from slipstream.config.loader import load_config, parse_override
from slipstream.config.schema import Config

RL_BACKENDS = ("local", "fsdp", "megatron")
RL_TOP_KEYS = ("mode", "frameworks", "backends", "rl_step", "device", "peak_flops", "on_error")
RL_STEP_KEYS = ("recipe", "steps", "warmup_steps", "overrides", "name", "budgets", "ignore_stop")
RL_PHASES = ("rollout", "reward", "old_log_probs", "ref_log_probs", "actor_train", "update_weights")
"""Phases of one step in the order they run (the "step" phase encloses them all)."""
CORE_METRICS = (
    "perf/step_time", "perf/rollout_time", "perf/actor_train_time", "perf/actor_train_tflops",
    "perf/actor_train_mfu", "perf/actor_train_tok_per_s", "perf/wait_time_ratio",
    "perf/rollout_tokens_per_gpu_per_s",
)  # fmt: skip
"""The DESIGN.md metric set (plus perf/max_memory_allocated_gb/<phase> on CUDA); MFU needs a known peak."""
CONTROLLED_KEYS = (
    "trainer.run_dir", "trainer.export_hf", "logging.tensorboard", "trainer.resume", "trainer.total_steps",
    "actor.backend",
)  # fmt: skip
"""Config keys the bench sets itself for every cell; the spec's overrides may not touch them."""
_MEM_PREFIX = "perf/max_memory_allocated_gb/"


@dataclass(frozen=True)
class RLStepSettings:
    """The recipe every rl-step cell runs, and how many steps are run and timed."""

    recipe: str
    """Recipe YAML (relative paths are read from the current directory, like `slipstream train`)."""
    steps: int
    """Steps per cell, warm-up included."""
    warmup_steps: int = 1
    """Leading steps left out of the statistics."""
    overrides: tuple[str, ...] = ()
    """Dotted `key=value` overrides applied on top of the recipe (same syntax as `slipstream train`)."""
    name: str = ""
    """Workload name in the results (default: the recipe's file stem)."""
    budgets: str | None = None
    """Per-sample max_new_tokens: "w1" = linspace(256, 3584) over the step's samples (W1's response lengths); None: the recipe's."""
    ignore_stop: bool = False
    """Sample every budget to its end (stop tokens ignored), as a throughput benchmark needs."""

    def sample_budgets(self, num_samples: int) -> list[int] | None:
        if self.budgets is None:
            return None
        if num_samples < 2:
            return [3584] * num_samples
        return [round(256 + i * (3584 - 256) / (num_samples - 1)) for i in range(num_samples)]


# ---------------------------------------------------------------- spec


def parse_rl_step_spec(data: Mapping) -> MatrixSpec:
    """Validate a `mode: rl-step` spec mapping; the recipe and overrides are resolved once to catch errors early."""
    for key in data:
        if key not in RL_TOP_KEYS and key in {"workloads", "peers"} | {f.name for f in dataclasses.fields(CellSettings)}:
            raise ValueError(
                f"matrix spec: key {key!r} applies to mode train-step only; in mode rl-step the recipe in "
                f"rl_step.recipe and rl_step.overrides set the workload and the training settings"
            )
    _check_keys("", data, RL_TOP_KEYS)
    for key in ("frameworks", "backends", "rl_step"):
        if key not in data:
            raise ValueError(f"matrix spec: missing required key {key!r}")
    settings = CellSettings(
        mode="rl-step",
        device=_choice("device", data.get("device"), (None, "cuda", "cpu")),
        peak_flops=_peak("peak_flops", data.get("peak_flops")),
    )
    rl = _rl_step_section(data["rl_step"], settings)
    return MatrixSpec(
        workloads=(rl,),  # type: ignore[arg-type]  # the recipe is the one workload of an rl-step matrix
        frameworks=_choice_list("frameworks", data["frameworks"], FRAMEWORKS),
        backends=_choice_list("backends", data["backends"], RL_BACKENDS),
        settings=settings,
        on_error=_choice("on_error", data.get("on_error", "record"), ("record", "raise")),
        rl_step=rl,
    )


def _rl_step_section(raw, settings: CellSettings) -> RLStepSettings:
    if not isinstance(raw, Mapping):
        raise ValueError(f"matrix spec: rl_step must be a mapping (recipe, steps, ...), got {raw!r}")
    _check_keys("rl_step.", raw, RL_STEP_KEYS)
    for key in ("recipe", "steps"):
        if key not in raw:
            raise ValueError(f"matrix spec: rl_step is missing required key {key!r}")
    recipe = raw["recipe"]
    if not isinstance(recipe, str) or not recipe:
        raise ValueError(f"matrix spec: rl_step.recipe must be a path to a recipe YAML, got {recipe!r}")
    steps = _int("rl_step.steps", raw["steps"], 1)
    warmup = _int("rl_step.warmup_steps", raw.get("warmup_steps", 1), 0)
    if warmup >= steps:
        raise ValueError(
            f"matrix spec: rl_step.steps={steps} leaves no timed step after rl_step.warmup_steps={warmup} "
            "(steps counts the warm-up too)"
        )
    overrides = raw.get("overrides", [])
    if isinstance(overrides, str):
        overrides = [overrides]
    if not isinstance(overrides, list) or not all(isinstance(o, str) for o in overrides):
        raise ValueError(f"matrix spec: rl_step.overrides must be a list of 'key=value' strings, got {overrides!r}")
    controlled = set(CONTROLLED_KEYS)
    controlled |= {"trainer.device"} if settings.device is not None else set()
    controlled |= {"trainer.peak_flops"} if settings.peak_flops is not None else set()
    for i, item in enumerate(overrides):
        try:
            key, _ = parse_override(item)
        except ValueError as err:
            raise ValueError(f"matrix spec: rl_step.overrides[{i}]: {err}") from None
        if key in controlled:
            raise ValueError(
                f"matrix spec: rl_step.overrides[{i}] sets {key!r}, which the bench sets itself "
                f"({', '.join(sorted(controlled))}); vary the backend with `backends` and the device with `device`"
            )
    name = raw.get("name", Path(recipe).stem)
    if not isinstance(name, str) or not name:
        raise ValueError(f"matrix spec: rl_step.name must be a non-empty string, got {name!r}")
    budgets = raw.get("budgets")
    if budgets not in (None, "w1"):
        raise ValueError(f"matrix spec: rl_step.budgets must be 'w1' or absent, got {budgets!r}")
    ignore_stop = raw.get("ignore_stop", False)
    if not isinstance(ignore_stop, bool):
        raise ValueError(f"matrix spec: rl_step.ignore_stop must be true or false, got {ignore_stop!r}")
    rl = RLStepSettings(recipe=recipe, steps=steps, warmup_steps=warmup, overrides=tuple(overrides), name=name,
                        budgets=budgets, ignore_stop=ignore_stop)  # fmt: skip
    try:  # resolve now: a typo in an override fails at spec load, not after the first cells have run
        cell_config(rl, settings, backend="local", run_dir="/nonexistent/rl-step-check")
    except ValueError as err:
        raise ValueError(f"matrix spec: rl_step: {err}") from None
    return rl


def cell_config(rl: RLStepSettings, settings: CellSettings, backend: str, run_dir: str | Path) -> Config:
    """The Config of one cell: recipe <- spec overrides <- what the bench controls (backend, run_dir, ...)."""
    forced = [
        f"trainer.run_dir={run_dir}", "trainer.export_hf=false", "logging.tensorboard=false",
        "trainer.resume=false", f"trainer.total_steps={rl.steps}", f"actor.backend={backend}",
    ]  # fmt: skip
    if settings.device is not None:
        forced.append(f"trainer.device={settings.device}")
    if settings.peak_flops is not None:
        forced.append(f"trainer.peak_flops={settings.peak_flops!r}")
    return load_config(rl.recipe, [*rl.overrides, *forced])


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


def step_statistics(per_step: Sequence[Mapping[str, float]], warmup_steps: int) -> tuple[dict, dict]:
    """(metrics, phases) of a run: every perf/ metric over the timed steps, and per-phase time stats.

    A metric enters only when every timed step reports it (e.g. MFU needs a known peak, peak memory
    needs CUDA). `reward/mean` keeps its first and last value over all steps, warm-up included.
    """
    if len(per_step) <= warmup_steps:
        raise ValueError(f"{len(per_step)} steps leave none to time after {warmup_steps} warm-up steps")
    timed = per_step[warmup_steps:]
    names = sorted(k for k in timed[0] if k.startswith("perf/") and all(k in m for m in timed))
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


def run_slipstream_rl_step(rl: RLStepSettings, settings: CellSettings, backend: str) -> dict:
    """Run `rl.steps` GRPO steps of slipstream on `backend` in a temporary run_dir; the cell's result."""
    import torch

    from slipstream.controller.grpo import RLTrainer
    from slipstream.ops.attention import select_backend

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
            trainer.logger.close()
            trainer.rewards.close()
        del trainer
    if device.type == "cuda":
        torch.cuda.empty_cache()
    metrics, phases = step_statistics(per_step, rl.warmup_steps)
    dtype = getattr(torch, cfg.model.dtype)
    kernel = select_backend(torch.empty(0, device=device, dtype=dtype))
    # Trained tokens per step: tok/s x train time / passes (packed, so every token is real).
    tokens = [
        m["perf/actor_train_tok_per_s"] * m["perf/actor_train_time"] / cfg.algo.ppo_epochs
        for m in per_step[rl.warmup_steps:] if "perf/actor_train_tok_per_s" in m
    ]  # fmt: skip
    a, r = cfg.actor, cfg.rollout
    fairness = {
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
        "placement": "colocated, synchronous, one process (trainer and rollout share the device)",
    }
    return {
        "status": "ok",
        "phases": phases,
        "metrics": metrics,
        "fairness": fairness,
        "impl": {"name": "slipstream", "version": None, "backend": backend, "device": str(device),
                 "setup_time_s": setup_s, "steps": rl.steps, "warmup_steps": rl.warmup_steps},  # fmt: skip
    }


def run_rl_step_cell(spec: MatrixSpec, rl: RLStepSettings, framework: str, backend: str) -> dict:
    """The framework-specific part of one rl-step row; peers without an adapter get an explained row."""
    if framework == "slipstream":
        return run_slipstream_rl_step(rl, spec.settings, backend)
    if framework == "trl":
        from slipstream.bench.peers.trl_rl_step import run_trl_rl_step_cell

        return run_trl_rl_step_cell(rl, spec.settings, backend)
    return {
        "status": "not-available",
        "reason": f"rl-step adapter for {framework} not written yet (its train-step adapter exists; "
        "full-step timing of its own generation loop is a later slice)",
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
        "- Per GPU: train TFLOP/s and tok/s count real trained tokens (model FLOPs, DESIGN.md); wait = share of the "
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
