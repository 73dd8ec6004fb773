"""Held-out evaluation: eval sets from any data source, metrics (accuracy, mean@n, pass@k, maj@n), the evaluator."""

from slipstream.eval.evaluator import EvalSchedule, Evaluator, format_eval, generate_keyed
from slipstream.eval.metrics import pass_at_k, set_metrics
from slipstream.eval.sets import EvalSet, build_eval_sets, excluded_hashes

__all__ = [
    "EvalSchedule",
    "EvalSet",
    "Evaluator",
    "build_eval_sets",
    "excluded_hashes",
    "format_eval",
    "generate_keyed",
    "pass_at_k",
    "set_metrics",
]
