"""Timers, FLOPs counting, MFU and per-phase memory: the numbers behind `perf/` metrics."""

from slipstream.perf.flops import flops_per_token, forward_flops, train_flops
from slipstream.perf.mfu import PEAK_BF16_FLOPS, device_peak_flops, lookup_peak_flops, mfu
from slipstream.perf.timers import TRAINER_PHASES, CudaMemoryProbe, PhaseTimer, perf_metrics

__all__ = [
    "PEAK_BF16_FLOPS",
    "TRAINER_PHASES",
    "CudaMemoryProbe",
    "PhaseTimer",
    "device_peak_flops",
    "flops_per_token",
    "forward_flops",
    "lookup_peak_flops",
    "mfu",
    "perf_metrics",
    "train_flops",
]
