"""`slipstream eval TARGET [key=value ...]`: score a run's checkpoint, or any HF / GGUF model, on eval sets.

TARGET is a run directory (its config.yaml and newest checkpoint), one checkpoint directory
(RUN_DIR/checkpoints/step_NNNNNN) or a model (`model.path`: an HF directory, a .gguf file or
pkg:<module>/<file>; the config is `--recipe` or the defaults). Overrides apply on top, so
`eval.sets.<name>.*`, `eval.n` or `eval.max_new_tokens` can differ from the run's. A checkpoint
is scored with the weights and rollout settings the run had at that step: its greedy
accuracy is the run's own eval score there.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from slipstream.checkpoint.manager import STEP_DIR, CheckpointManager
from slipstream.config.loader import load_config
from slipstream.config.schema import Config
from slipstream.controller import setup
from slipstream.engine.factory import build_engine
from slipstream.eval.evaluator import Evaluator, format_eval
from slipstream.eval.sets import build_eval_sets
from slipstream.models import hf

log = logging.getLogger(__name__)


def resolve_target(target: str, recipe: str | None, overrides: list[str]) -> tuple[Config, Path | None, int]:
    """(config, checkpoint directory or None, step) of an eval target."""
    path = Path(target)
    if path.is_dir() and (path / "config.yaml").is_file():  # a run directory
        if recipe is not None:
            raise ValueError("--recipe is for a model; a run directory brings its own config.yaml")
        checkpoint = CheckpointManager(path / "checkpoints").latest()
        if checkpoint is None:
            raise ValueError(_no_checkpoint(path))
        return load_config(path / "config.yaml", overrides), checkpoint, int(checkpoint.name.removeprefix("step_"))
    match = STEP_DIR.match(path.name)
    if path.is_dir() and match and (path.parent.parent / "config.yaml").is_file():  # RUN_DIR/checkpoints/step_N
        if recipe is not None:
            raise ValueError("--recipe is for a model; a checkpoint's run directory brings its own config.yaml")
        return load_config(path.parent.parent / "config.yaml", overrides), path, int(match.group(1))
    if not (target.startswith("pkg:") or path.exists()):
        raise ValueError(f"{target!r} is neither a run directory, a checkpoint directory nor a model path")
    return load_config(recipe, [f"model.path={target}", *overrides]), None, 0


def _no_checkpoint(run_dir: Path) -> str:
    """What a run directory without a checkpoint does hold, and what to pass instead."""
    export = run_dir / "hf"
    if (export / "config.json").is_file():
        return f"{run_dir} has no checkpoint; score its exported model: slipstream eval {export}"
    contents = ", ".join(sorted(p.name for p in run_dir.iterdir()))
    return (
        f"{run_dir} has no checkpoint and no hf/ export (it holds {contents}): the run stopped before its first "
        "save. Resume it with `slipstream train`, or pass a model (an HF directory or a .gguf file) to score"
    )


def evaluate_target(
    target: str, recipe: str | None = None, overrides: list[str] | None = None, show: int = 0
) -> tuple[int, dict]:
    """(step, metrics) of TARGET on the configured eval sets; prints `show` example completions per set."""
    cfg, checkpoint, step = resolve_target(target, recipe, list(overrides or []))
    if not cfg.eval.sets:
        raise ValueError("no eval sets configured: add one, e.g. eval.sets.test.source=rg:chain_sum eval.sets.test.size=200")
    setup.seed_everything(cfg.trainer.seed)
    device = setup.pick_device(cfg.trainer.device)
    tokenizer = setup.build_tokenizer(cfg)
    model, model_cfg = setup.build_policy(cfg, len(tokenizer))
    compute_dtype = setup.DTYPES[cfg.model.dtype]
    if checkpoint is not None:
        engine = build_engine(model, device, compute_dtype, cfg.rollout.temperature, cfg.actor)
        engine.load(checkpoint)
        device, weights = engine.device, engine.export_weights()
        log.info("scoring %s (step %d)", checkpoint, step)
    else:
        weights = hf.iter_hf_weights(model)
    rollout = setup.build_rollout(cfg, model_cfg, device, compute_dtype)
    rollout.update_weights(weights, version=step)
    del model, weights
    sets = build_eval_sets(cfg, tokenizer, max_context=model_cfg.max_position_embeddings)
    stop_ids = setup.stop_token_ids(tokenizer, cfg.rollout.stop, model_cfg.eos_token_id)
    evaluator = Evaluator.build(cfg, tokenizer, rollout, sets, stop_ids)
    try:
        metrics = evaluator.run()
    finally:
        evaluator.close()
    for name, examples in evaluator.examples.items():
        for prompt, completion, score in examples[:show]:
            print(f"--- {name} (score {score:g})\n{prompt}\n>>> {completion}")
    print(format_eval(step, metrics, sets))
    return step, metrics


def write_json(path: str | Path, target: str, step: int, metrics: dict) -> None:
    Path(path).write_text(json.dumps({"target": target, "step": step, **metrics}, indent=1) + "\n")
