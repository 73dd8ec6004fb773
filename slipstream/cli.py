"""`slipstream` command line. Heavy imports (torch, transformers) happen inside the commands."""

from __future__ import annotations

import argparse
import logging
import sys


def _train(args: argparse.Namespace) -> int:
    from slipstream.config import load_config

    recipe, overrides = None, list(args.overrides)
    if args.recipe is not None:
        if "=" in args.recipe:  # `slipstream train actor.lr=1e-6` with no recipe
            overrides.insert(0, args.recipe)
        else:
            recipe = args.recipe
    try:
        cfg = load_config(recipe, overrides)
    except ValueError as err:
        print(f"config error: {err}", file=sys.stderr)
        return 2
    from slipstream.controller.grpo import RLTrainer
    from slipstream.report import write_report

    try:
        trainer = RLTrainer(cfg)
    except ValueError as err:  # bad data source, reward name, tokenizer / model mismatch, missing package, ...
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


def _eval(args: argparse.Namespace) -> int:
    from slipstream.eval.standalone import evaluate_target, write_json

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

    path = write_report(args.run_dir)
    print(f"wrote {path}")
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="slipstream", description="RL post-training for LLMs, measured honestly.")
    parser.add_argument("-v", "--verbose", action="store_true", help="debug logging")
    sub = parser.add_subparsers(dest="command", required=True)

    train = sub.add_parser("train", help="run GRPO / PPO from a recipe plus key=value overrides")
    train.add_argument("recipe", nargs="?", help="YAML recipe (see recipes/); omit to use the defaults")
    train.add_argument("overrides", nargs="*", help="dotted overrides, e.g. actor.lr=1e-6 rollout.group_size=8")
    train.set_defaults(func=_train)

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
    if extra and args.command == "eval":  # overrides after an option: `eval TARGET --recipe R key=value`
        args.overrides += extra
    elif extra:
        parser.error(f"unrecognized arguments: {' '.join(extra)}")
    logging.basicConfig(
        level=logging.DEBUG if args.verbose else logging.INFO,
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
        datefmt="%H:%M:%S",
    )
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
