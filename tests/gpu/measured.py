"""Print the measured error of a GPU check before it is asserted (`pytest -s` shows it).

The GPU tests' tolerances are set from measured errors; a check that has no recorded measurement
yet prints its own, so the next GPU run (`slipstream bench suite --gpu --only gpu-tests`) records it.
"""

from __future__ import annotations

import torch


def report(label: str, got, want) -> float:
    """Print and return max |got - want| (tensors or numbers)."""
    diff = float((torch.as_tensor(got).double().cpu() - torch.as_tensor(want).double().cpu()).abs().max())
    print(f"\n| measured | {label} | max|diff| {diff:.3e} |")
    return diff
