"""Assertions shared by the engine tests (LocalEngine, FSDPEngine, MegatronEngine)."""

from __future__ import annotations

import torch


def assert_weights_close(got: dict, want: dict, atol: float) -> None:
    """Same HF-named tensors on both sides, each within `atol`."""
    assert sorted(got) == sorted(want)
    for name in want:
        torch.testing.assert_close(got[name], want[name], atol=atol, rtol=0, msg=name)
