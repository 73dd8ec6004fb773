"""Built-in reward functions.

Every reward has the signature ``fn(completion: str, answer: str | None, prompt: str) -> float | dict``;
a dict return carries the score under ``"score"`` and any other keys are logged as info.
Functions here are pure and module-level so that worker processes can import them by name.
"""

from __future__ import annotations

import ast
import json
import re
from fractions import Fraction

from slipstream.rewards.extract import extract_answer, extract_boxed, extract_last_number, extract_tag

# ---------------------------------------------------------------------------------------------
# Answer extraction and normalisation (math)
# ---------------------------------------------------------------------------------------------

_LATEX_FRAC_RE = re.compile(r"\\[dt]?frac\s*\{([^{}]*)\}\s*\{([^{}]*)\}")
_THOUSANDS_RE = re.compile(r"(?<=\d),(?=\d{3}(?:\D|$))")


def extract_math_answer(completion: str, how: str = "auto") -> str | None:
    """The final answer of a math completion: the last \\boxed{} in the answer span, else its last number.

    The span is the whole completion for `how="auto"` without <answer> tags, else what
    `extract_answer(completion, how)` returns (tag content, box content or the last line).
    """
    span = extract_tag(completion) if how == "auto" else extract_answer(completion, how)
    if span is None:
        if how != "auto":
            return None
        span = completion
    boxed = extract_boxed(span)
    if boxed is not None:
        return boxed
    return extract_last_number(span)


def normalize_math_answer(text: str) -> str:
    """Canonical string form of an answer: no $, spaces, thousands commas, trailing '.'."""
    s = text.strip().replace("\u2212", "-")
    s = s.replace("\\$", "").replace("$", "").replace("\\!", "").replace("\\,", "")
    s = re.sub(r"\\(?:text|mathrm|textbf)\{([^{}]*)\}", r"\1", s)
    s = _LATEX_FRAC_RE.sub(r"(\1)/(\2)", s)
    s = s.replace("\\left", "").replace("\\right", "")
    s = _THOUSANDS_RE.sub("", s)
    s = re.sub(r"\s+", "", s)
    s = s.rstrip(".")
    return s.lower()


def parse_number(text: str) -> Fraction | None:
    """Exact value of an int / decimal / fraction string such as "-3", "0.25", "(1)/(2)"."""
    s = text.replace("(", "").replace(")", "") if re.fullmatch(r"[\d\s().+\-/]+", text) else text
    parts = s.split("/")
    try:
        if len(parts) == 1:
            return Fraction(parts[0])
        if len(parts) == 2:
            den = Fraction(parts[1])
            return Fraction(parts[0]) / den if den != 0 else None
    except (ValueError, ZeroDivisionError):
        return None
    return None


def math_answers_equal(predicted: str, truth: str) -> bool:
    """Numeric equality when both parse as numbers, else normalised string equality."""
    p, t = normalize_math_answer(predicted), normalize_math_answer(truth)
    p_num, t_num = parse_number(p), parse_number(t)
    if p_num is not None and t_num is not None:
        return p_num == t_num
    return p == t


def _ground_truth(answer: str | None, reward_name: str) -> str:
    if answer is None:
        raise ValueError(f"the {reward_name!r} reward needs a ground-truth answer, got None")
    answer = str(answer)
    # GSM8K-style ground truth carries its reasoning before "#### <final answer>".
    if "####" in answer:
        answer = answer.rsplit("####", 1)[1]
    boxed = extract_boxed(answer)
    return boxed if boxed is not None else answer


def math_reward(completion: str, answer: str | None, prompt: str = "", extract: str = "auto") -> float:
    """1.0 when the completion's final answer (last \\boxed{} or last number of the answer span) equals `answer`."""
    truth = _ground_truth(answer, "math")
    predicted = extract_math_answer(completion, extract)
    if predicted is None:
        return 0.0
    return 1.0 if math_answers_equal(predicted, truth) else 0.0


# ---------------------------------------------------------------------------------------------
# Exact match and format
# ---------------------------------------------------------------------------------------------


def _normalize_text(text: str) -> str:
    return " ".join(text.split()).lower()


def exact_reward(completion: str, answer: str | None, prompt: str = "") -> float:
    """1.0 when completion and answer are equal up to whitespace runs and case."""
    if answer is None:
        raise ValueError("the 'exact' reward needs a ground-truth answer, got None")
    return 1.0 if _normalize_text(completion) == _normalize_text(str(answer)) else 0.0


DEFAULT_FORMAT_PATTERN = r"<answer>.*?</answer>|\\boxed\{"


def format_reward(
    completion: str, answer: str | None = None, prompt: str = "", pattern: str = DEFAULT_FORMAT_PATTERN
) -> float:
    """1.0 when `pattern` (a regex, searched with DOTALL) occurs in the completion, else 0.0.

    Use ``functools.partial(format_reward, pattern=...)`` for another pattern; a partial of this
    module-level function can still be sent to reward worker processes.
    """
    return 1.0 if re.search(pattern, completion, flags=re.DOTALL) else 0.0


# ---------------------------------------------------------------------------------------------
# Countdown: combine the given numbers with + - * / (each exactly once) to reach the target
# ---------------------------------------------------------------------------------------------

_BINOPS = {ast.Add: lambda a, b: a + b, ast.Sub: lambda a, b: a - b, ast.Mult: lambda a, b: a * b}


def countdown_answer(numbers: list[int], target: int) -> str:
    """The ground-truth string the countdown reward expects: JSON with numbers and target."""
    return json.dumps({"numbers": list(numbers), "target": target})


def _eval_countdown(node: ast.AST, used: list[int]) -> Fraction:
    """Exact value of an arithmetic AST; appends every literal to `used`; ValueError otherwise."""
    if isinstance(node, ast.Expression):
        return _eval_countdown(node.body, used)
    if isinstance(node, ast.Constant) and type(node.value) is int:
        used.append(node.value)
        return Fraction(node.value)
    if isinstance(node, ast.BinOp):
        left, right = _eval_countdown(node.left, used), _eval_countdown(node.right, used)
        if isinstance(node.op, ast.Div):
            if right == 0:
                raise ValueError("division by zero")
            return left / right
        if type(node.op) in _BINOPS:
            return _BINOPS[type(node.op)](left, right)
    raise ValueError(f"unsupported expression element {type(node).__name__}")


def extract_countdown_expression(completion: str, how: str = "auto") -> str | None:
    """Expression in the answer span (auto: last <answer>...</answer>, else last \\boxed{}, else last line), lhs of '='."""
    expr = extract_answer(completion, how)
    if expr is None:
        return None
    expr = expr.split("=")[0].replace("\u00d7", "*").replace("\u00f7", "/").replace("\u2212", "-")
    return expr.strip() or None


def countdown_reward(completion: str, answer: str | None, prompt: str = "", extract: str = "auto") -> float:
    """1.0 when the expression uses each given number exactly once and evaluates to the target.

    `answer` is the JSON written by `countdown_answer` ({"numbers": [...], "target": int}).
    """
    if answer is None:
        raise ValueError("the 'countdown' reward needs an answer with numbers and target, got None")
    spec = json.loads(answer)
    numbers, target = spec["numbers"], spec["target"]
    expr = extract_countdown_expression(completion, extract)
    if expr is None or len(expr) > 200:  # long inputs are never valid and would only cost time
        return 0.0
    try:
        tree = ast.parse(expr, mode="eval")
        used: list[int] = []
        value = _eval_countdown(tree, used)
    except (SyntaxError, ValueError):
        return 0.0
    if sorted(used) != sorted(numbers):
        return 0.0
    return 1.0 if value == target else 0.0
