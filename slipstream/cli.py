"""`slipstream` command line. Heavy imports (torch, transformers) happen inside the commands."""

from __future__ import annotations

import argparse
import faulthandler
import logging
import os
import signal
import sys
from pathlib import Path


def _train(args: argparse.Namespace) -> int:
    from slipstream.config.loader import RecipeError, load_config

    if args.recipe is None or "=" in args.recipe:  # the defaults alone train nothing useful
        print(args.usage + _recipe_list(), file=sys.stderr, end="")
        return 2
    try:
        cfg = load_config(args.recipe, args.overrides)
    except RecipeError as err:  # already "file:line:col: problem"
        print(err, file=sys.stderr)
        return 2
    except ValueError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    try:  # start-up: imports (torch), model load, reward workers, resume
        from slipstream.controller.trainer import Interrupted, build_trainer
        from slipstream.controller.run_dir import RunComplete, check_resume_config, missing_outputs
        from slipstream.report import write_report
        from slipstream.rewards.runner import RewardError

        if not args.overwrite:
            check_resume_config(cfg, allow_change=args.allow_config_change)
        trainer = build_trainer(cfg, overwrite=args.overwrite)
    except KeyboardInterrupt:
        import multiprocessing

        for child in multiprocessing.active_children():  # reward workers still starting: gone, without
            child.kill()  # a traceback from their start-up when this process exits under them
        print("interrupted during start-up: no step was run, nothing was saved", file=sys.stderr)
        return 130
    except RunComplete as done:
        print(done)
        if "report.png" in missing_outputs(cfg.trainer) and int(os.environ.get("RANK", "0")) == 0:
            print(f"wrote the report it was missing: {write_report(cfg.trainer.run_dir)}")
        return 0
    except ValueError as err:  # bad data source, reward name, tokenizer / model mismatch, run_dir in use, ...
        print(f"config error: {err}", file=sys.stderr)
        return 2
    try:
        trainer.fit()
    except Interrupted as stop:
        print(_stopped(stop), file=sys.stderr)
        return 130
    except RewardError as err:  # reward.on_error=raise, or every reward function disabled
        print(f"stopped: {err}", file=sys.stderr)
        return 1
    if trainer.rank == 0:  # under torchrun the other ranks only train
        path = write_report(trainer.run_dir)
        if trainer.finishing:
            print(f"{trainer.run_dir} was complete at step {trainer.step_num}; wrote what a stop after its final "
                  f"checkpoint left out: the HF export ({trainer.run_dir / 'hf'}) and the report ({path})")
        else:
            print(f"run finished: {trainer.run_dir} (report: {path})")
    return 0


def _stopped(stop) -> str:
    """What an interrupted run left behind, in one line."""
    if stop.saved is not None:
        return (f"interrupted: checkpoint {stop.saved.name} saved after step {stop.step} in {stop.saved.parent}; "
                "run the same command again to resume")  # fmt: skip
    if stop.resume_point is not None:
        where = f"a rerun resumes from {stop.resume_point.name} in {stop.resume_point.parent}"
    else:
        where = "there is no checkpoint: a rerun starts over (with --overwrite)"
    return f"interrupted again: stopped at once during step {stop.step + 1}, no checkpoint was written; {where}"


def _eval(args: argparse.Namespace) -> int:
    from slipstream.evaluate import evaluate_target, write_json

    try:
        step, metrics = evaluate_target(args.target, args.recipe, args.overrides, show=args.show)
    except ValueError as err:  # bad target, config, eval source or missing package
        print(f"eval error: {err}", file=sys.stderr)
        return 2
    if args.out:
        write_json(args.out, args.target, step, metrics)
    return 0


def _report(args: argparse.Namespace) -> int:
    from slipstream.report import write_report

    try:
        path = write_report(args.run_dir)
    except ValueError as err:  # no such run directory, no metrics.jsonl, a malformed line
        print(f"error: {err}", file=sys.stderr)
        return 2
    print(f"wrote {path}")
    return 0


def _recipe_list() -> str:
    """The recipes/*.yaml of the working directory and of the source checkout, each with its first comment line."""
    found: dict[Path, str] = {}
    for directory in (Path("recipes"), Path(__file__).resolve().parents[1] / "recipes"):
        for path in sorted(directory.glob("*.yaml")):
            shown = os.path.relpath(path) if path.resolve().is_relative_to(Path.cwd()) else str(path)
            comments = (line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#"))
            first = next(comments, "")
            found.setdefault(path.resolve(), (shown, first))
    if not found:
        return "a recipe is needed and none was found in recipes/ (fields: docs/config.md)\n"
    width = max(len(shown) for shown, _ in found.values())
    lines = [f"  {shown:<{width}}  {first}".rstrip() for shown, first in found.values()]
    return "a recipe is needed; these are at hand:\n" + "\n".join(lines) + "\n"


def _version() -> str:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version("slipstream")
    except PackageNotFoundError:  # run from a source tree that was never installed
        return "unknown (not installed)"


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slipstream", description="RL post-training for LLMs, measured honestly.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    parser.add_argument("--version", action="version", version=f"slipstream {_version()}")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run GRPO / PPO from a recipe plus key=value overrides")
    train.add_argument("recipe", nargs="?", metavar="RECIPE",
                       help="YAML recipe (see recipes/); without one, the list of recipes")  # fmt: skip
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                       help="dotted overrides, e.g. actor.lr=1e-6 rollout.group_size=8")  # fmt: skip
    train.add_argument("--overwrite", action="store_true",
                       help="start over in a trainer.run_dir that holds an earlier run (its checkpoints, metrics, logs "
                       "and export are deleted first)")  # fmt: skip
    train.add_argument("--allow-config-change", action="store_true",
                       help="resume a run with a config that differs from its config.yaml beyond the length, "
                       "logging, saving and the eval schedule")  # fmt: skip
    train.set_defaults(func=_train, usage=train.format_usage())

    ev = sub.add_parser("eval", help="score a run, a checkpoint or an HF / GGUF model on eval sets, without training")
    ev.add_argument("target", help="RUN_DIR, RUN_DIR/checkpoints/step_NNNNNN, or a model path (HF dir, .gguf, pkg:...)")
    ev.add_argument("overrides", nargs="*", help="dotted overrides, e.g. eval.n=8 eval.sets.test.source=rg:chain_sum")
    ev.add_argument("--recipe", help="config for a model target (a run brings its own config.yaml)")
    ev.add_argument("--out", help="also write the metrics to this JSON file")
    ev.add_argument("--show", type=int, default=0, metavar="N", help="print N example completions per set")
    ev.set_defaults(func=_eval)

    report = sub.add_parser("report", help="plot reward, loss, KL, entropy, step time and eval curves of a run")
    report.add_argument("run_dir")
    report.set_defaults(func=_report)

    from slipstream.bench.cli import add_bench_parser  # argparse only; torch is imported by the command

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args, extra = parser.parse_known_args(argv)
    # argparse ends a nargs="*" positional at the first option: overrides after an option land here
    if args.command in ("train", "eval") and all("=" in item and not item.startswith("-") for item in extra):
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    if hasattr(signal, "SIGUSR1"):  # `kill -USR1 <pid>`: every thread's Python stack on stderr, the run goes on
        try:
            faulthandler.register(signal.SIGUSR1, all_threads=True)
        except (RuntimeError, ValueError, AttributeError):  # a stderr without a file descriptor (captured)
            pass
    try:
        return args.func(args)
    except KeyboardInterrupt:  # any command; train says more about what it left behind
        print("interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
