"""`slipstream` command line. Heavy imports (torch, transformers) happen inside the commands."""

from __future__ import annotations

import argparse
import logging
import os
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
    from slipstream.controller.grpo import RLTrainer
    from slipstream.report import write_report

    try:
        trainer = RLTrainer(cfg)
    except ValueError as err:  # bad data source, reward name, tokenizer / model mismatch, ...
        print(f"config error: {err}", file=sys.stderr)
        return 2
    try:
        trainer.fit()
    except KeyboardInterrupt:
        print(f"interrupted; checkpoint saved under {trainer.run_dir / 'checkpoints'} (run again to resume)")
        return 130
    if trainer.rank == 0:  # under torchrun the other ranks only train
        path = write_report(trainer.run_dir)
        print(f"run finished: {trainer.run_dir} (report: {path})")
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
            first = next((line.lstrip("#").strip() for line in path.read_text().splitlines() if line.startswith("#")), "")
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
    train.add_argument("recipe", nargs="?", metavar="RECIPE", help="YAML recipe (see recipes/); without one, the list of recipes")
    train.add_argument("overrides", nargs="*", metavar="KEY=VALUE",
                       help="dotted overrides, e.g. actor.lr=1e-6 rollout.group_size=8")  # fmt: skip
    train.set_defaults(func=_train, usage=train.format_usage())

    report = sub.add_parser("report", help="plot reward, loss, KL, entropy and step time of a run")
    report.add_argument("run_dir")
    report.set_defaults(func=_report)

    from slipstream.bench.cli import add_bench_parser  # argparse only; torch is imported by the command

    add_bench_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
