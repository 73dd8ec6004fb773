"""Assertions shared by the engine tests (LocalEngine, FSDPEngine, MegatronEngine)."""

from __future__ import annotations

import torch


# callers pass `atol` with their measured max |diff| beside it
def assert_weights_close(got: dict, want: dict, atol: float) -> None:
    """Same HF-named tensors on both sides, each within the given absolute tolerance."""
    assert sorted(got) == sorted(want)
    for name in want:
        # the caller's tolerance (measured value stated at the call)
        torch.testing.assert_close(got[name], want[name], atol=atol, rtol=0, msg=name)
