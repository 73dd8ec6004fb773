"""Procedural tasks: prompts generated from a seed, no files needed, each scored by a named reward.

A task is any object with `name`, `reward` (a name in `slipstream.rewards.registry.REWARDS`) and
`sample(rng: random.Random) -> PromptRecord`. Samples depend only on the rng state, so the same
seed gives the same prompts on every machine and Python version (random.Random is stable).
"""

from __future__ import annotations

import dataclasses
import difflib
import random
from dataclasses import dataclass
from typing import Protocol

from slipstream.data.sources import PromptRecord
from slipstream.rewards.functions import countdown_answer


class Task(Protocol):
    name: str
    reward: str

    def sample(self, rng: random.Random) -> PromptRecord: ...


def _operand(rng: random.Random, digits: int) -> int:
    # 1 digit means 0..9; more digits means exactly that many (no leading zero).
    low = 0 if digits == 1 else 10 ** (digits - 1)
    return rng.randint(low, 10**digits - 1)


@dataclass(frozen=True)
class ArithmeticTask:
    """"a op b" with `digits`-digit operands; the answer is the integer result (math reward)."""

    digits: int = 2
    ops: str = "+-*"
    """Any of "+-*/"; "/" is exact integer division (the dividend is built as divisor * quotient)."""
    template: str = "What is {expr}? Put the final answer in \\boxed{}."
    name: str = "arithmetic"
    reward: str = "math"

    def __post_init__(self) -> None:
        if not 1 <= self.digits <= 12:
            raise ValueError(f"arithmetic digits must be in 1..12, got {self.digits}")
        if not self.ops or set(self.ops) - set("+-*/"):
            raise ValueError(f"arithmetic ops must be a non-empty subset of '+-*/', got {self.ops!r}")
        if "{expr}" not in self.template:
            raise ValueError("arithmetic template must contain '{expr}'")

    def sample(self, rng: random.Random) -> PromptRecord:
        op = rng.choice(self.ops)
        a, b = _operand(rng, self.digits), _operand(rng, self.digits)
        if op == "/":
            b = max(b, 1)
            result = a  # a plays the quotient; the prompt shows (a * b) / b
            a = a * b
        else:
            result = {"+": a + b, "-": a - b, "*": a * b}[op]
        expr = f"{a} {op} {b}"
        prompt = self.template.replace("{expr}", expr)
        return PromptRecord(prompt=prompt, answer=str(result), meta={"task": self.name, "expr": expr})


@dataclass(frozen=True)
class CountdownTask:
    """Reach `target` from `num_numbers` numbers with + - * / using each once (countdown reward)."""

    num_numbers: int = 4
    min_number: int = 1
    max_number: int = 50
    max_target: int = 100
    template: str = (
        "Using the numbers {numbers}, create an equation that equals {target}. You can use basic "
        "arithmetic operations (+, -, *, /) and each number exactly once. Show your final expression "
        "in <answer> </answer> tags, for example <answer>(1 + 2) / 3</answer>."
    )
    name: str = "countdown"
    reward: str = "countdown"

    def __post_init__(self) -> None:
        if not 2 <= self.num_numbers <= 8:
            raise ValueError(f"countdown num_numbers must be in 2..8, got {self.num_numbers}")
        if not 1 <= self.min_number <= self.max_number:
            raise ValueError(f"countdown needs 1 <= min_number <= max_number, got {self.min_number}, {self.max_number}")
        if self.max_target < 1:
            raise ValueError(f"countdown max_target must be >= 1, got {self.max_target}")

    def _random_solution(self, rng: random.Random, numbers: list[int]) -> tuple[str, int] | None:
        """Combine random pairs with random ops until one (expression, value) remains."""
        terms = [(str(n), n) for n in numbers]
        while len(terms) > 1:
            i, j = rng.sample(range(len(terms)), 2)
            (ea, va), (eb, vb) = terms[i], terms[j]
            op = rng.choice("+-*/")
            # Keep every intermediate a natural number: targets stay readable and solvable by hand.
            if op == "-" and va < vb:
                (ea, va), (eb, vb) = (eb, vb), (ea, va)
            if op == "/" and (vb == 0 or va % vb):
                op = "+"
            value = {"+": va + vb, "-": va - vb, "*": va * vb, "/": va // vb if vb else 0}[op]
            terms = [t for k, t in enumerate(terms) if k not in (i, j)] + [(f"({ea} {op} {eb})", value)]
        expr, value = terms[0]
        if not 1 <= value <= self.max_target:
            return None
        return expr[1:-1], value  # drop the outermost parentheses

    def sample(self, rng: random.Random) -> PromptRecord:
        for _ in range(10_000):
            numbers = [rng.randint(self.min_number, self.max_number) for _ in range(self.num_numbers)]
            found = self._random_solution(rng, numbers)
            if found is not None:
                break
        else:
            raise ValueError(f"countdown: no target in 1..{self.max_target} found; raise max_target")
        solution, target = found
        prompt = self.template.replace("{numbers}", str(numbers)).replace("{target}", str(target))
        return PromptRecord(
            prompt=prompt,
            answer=countdown_answer(numbers, target),
            meta={"task": self.name, "solution": solution},
        )


@dataclass(frozen=True)
class SumMod10Task:
    """The tiny-model task: "3+4=" -> "7", the sum mod 10 as one digit.

    The alphabet is only digits, "+" and "=", so a from-scratch character-level model can learn it.
    """

    num_terms: int = 2
    name: str = "sum-mod10"
    reward: str = "exact"
    alphabet: str = "0123456789+="

    def __post_init__(self) -> None:
        if not 1 <= self.num_terms <= 16:
            raise ValueError(f"sum-mod10 num_terms must be in 1..16, got {self.num_terms}")

    def sample(self, rng: random.Random) -> PromptRecord:
        terms = [rng.randint(0, 9) for _ in range(self.num_terms)]
        prompt = "+".join(map(str, terms)) + "="
        return PromptRecord(prompt=prompt, answer=str(sum(terms) % 10), meta={"task": self.name})


@dataclass(frozen=True)
class RandomIdsTask:
    """Benchmark prompts: `length` random token ids as text for the "ids:<V>" tokenizer; the answer is one
    more random id, so the exact-match reward is cheap and almost always 0 (throughput, not learning)."""

    length: int = 512
    vocab_size: int = 151936
    name: str = "random-ids"
    reward: str = "exact"

    def __post_init__(self) -> None:
        if self.length < 1 or self.vocab_size < 2:
            raise ValueError(f"random-ids needs length >= 1 and vocab_size >= 2, got {self.length}, {self.vocab_size}")

    def sample(self, rng: random.Random) -> PromptRecord:
        ids = [rng.randrange(1, self.vocab_size - 1) for _ in range(self.length + 1)]  # no pad / eos ids
        return PromptRecord(prompt=" ".join(map(str, ids[:-1])), answer=str(ids[-1]), meta={"task": self.name})


TASKS: dict[str, type] = {
    "arithmetic": ArithmeticTask,
    "random-ids": RandomIdsTask,
    "countdown": CountdownTask,
    "sum-mod10": SumMod10Task,
}


def get_task(name: str, **params) -> Task:
    """A procedural task by name, e.g. get_task("arithmetic", digits=3, ops="+-")."""
    if name not in TASKS:
        close = difflib.get_close_matches(name, list(TASKS), n=1, cutoff=0.0)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"unknown task {name!r}{hint} (tasks: {', '.join(sorted(TASKS))})")
    cls = TASKS[name]
    allowed = {f.name for f in dataclasses.fields(cls) if f.name not in ("name", "reward", "alphabet")}
    unknown = set(params) - allowed
    if unknown:
        raise ValueError(f"task {name!r} has no parameter(s) {sorted(unknown)}; it takes {sorted(allowed)}")
    return cls(**params)


def is_procedural(source: str) -> bool:
    """True for a data source that generates prompts from a seed ("task:<name>", "rg:...")."""
    return source.startswith(("task:", "rg:"))


def make_task(source: str, params: dict) -> Task:
    """The procedural task of a data source: "task:<name>" (built in) or "rg:<dataset>" / "rg:mix:..." (reasoning-gym)."""
    if source.startswith("task:"):
        return get_task(source.removeprefix("task:"), **params)
    if source.startswith("rg:"):
        from slipstream.data.reasoning_gym import RGTask  # reasoning-gym itself is imported only when used

        return RGTask(source, dict(params))
    raise ValueError(f"{source!r} is not a procedural source (task:<name> or rg:<dataset>)")
