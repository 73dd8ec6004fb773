"""Per-phase wall time and peak memory of an RL step, and the `perf/` metrics derived from them.

The controller wraps each phase of a step:

    timer = PhaseTimer(device)
    with timer.phase("step"):
        with timer.phase("rollout"): ...
        with timer.phase("actor_train"): ...
    logger.log(step, timer.summary() | perf_metrics(cfg, seq_lens, timer.times, ...))
    timer.reset()

Phase names used by the controller: "rollout", "reward", "old_log_probs", "ref_log_probs",
"actor_train", "update_weights", "step"; each becomes `perf/<name>_time` (seconds, summed over
every entry of that phase since the last reset).
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from typing import Callable, Iterator, Mapping, Sequence

import torch

from slipstream.models.config import ModelConfig
from slipstream.perf.flops import forward_flops, train_flops

_GIB = float(2**30)

# Phases in which the trainer itself works; everything else in a step is the trainer waiting
# (for generation, rewards, or the host). See `perf_metrics` for the wait-time ratio.
TRAINER_PHASES: tuple[str, ...] = ("old_log_probs", "ref_log_probs", "actor_train", "update_weights")


class CudaMemoryProbe:
    """Synchronises a CUDA device and reads / resets its allocator's peak-memory counter."""

    def __init__(self, device: torch.device) -> None:
        assert device.type == "cuda"
        self.device = device

    def synchronize(self) -> None:
        torch.cuda.synchronize(self.device)

    def reset_peak(self) -> None:
        torch.cuda.reset_peak_memory_stats(self.device)

    def peak_bytes(self) -> int:
        return torch.cuda.max_memory_allocated(self.device)


class PhaseTimer:
    """Accumulates wall time per named phase; on CUDA also the peak allocated memory per phase.

    On CUDA the timer synchronises the device at phase boundaries, and only there: a phase's
    kernels are launched asynchronously, so without the sync its time would leak into the next
    phase. Phase boundaries are where the host waits for results anyway (log-probs before the
    loss, gradients before the weight sync), so the sync costs nothing in the hot path.

    Peak memory is reset at the start of each phase, so `perf/max_memory_allocated_gb/<phase>`
    is that phase's own peak (GiB). Phases may nest ("step" around the others); an outer phase's
    peak still covers everything inside it because the peak is folded into every open phase
    before an inner phase resets the counter.
    """

    def __init__(self, device: torch.device | str | None = None, probe: CudaMemoryProbe | None = None):
        if probe is None and device is not None:
            device = torch.device(device)
            if device.type == "cuda":
                if device.index is None and torch.cuda.is_available():
                    device = torch.device("cuda", torch.cuda.current_device())
                probe = CudaMemoryProbe(device)
        # `probe` is None on the CPU: no syncs, and memory metrics are omitted.
        self._probe = probe
        self._times: dict[str, float] = {}
        self._peak_bytes: dict[str, int] = {}
        self._open: list[list] = []  # stack of [name, peak bytes seen so far inside it]

    @contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time the body as phase `name` (time adds up over repeated entries; peak takes the max)."""
        if not name or "/" in name:
            raise ValueError(f"phase name must be non-empty and contain no '/', got {name!r}")
        if any(open_name == name for open_name, _ in self._open):
            raise ValueError(f"phase {name!r} is already open; phases of one name cannot nest")
        probe = self._probe
        if probe is not None:
            probe.synchronize()
            # Fold the peak so far into every enclosing phase before the reset erases it.
            current = probe.peak_bytes()
            for entry in self._open:
                entry[1] = max(entry[1], current)
            probe.reset_peak()
        entry = [name, 0]
        self._open.append(entry)
        start = time.perf_counter()
        try:
            yield
        finally:
            if probe is not None:
                probe.synchronize()
            elapsed = time.perf_counter() - start
            popped = self._open.pop()
            assert popped is entry, "phases must close in the reverse order they opened"
            self._times[name] = self._times.get(name, 0.0) + elapsed
            if probe is not None:
                peak = max(entry[1], probe.peak_bytes())
                self._peak_bytes[name] = max(self._peak_bytes.get(name, 0), peak)
                # The enclosing phases also saw this peak (the counter is not reset on exit).
                for outer in self._open:
                    outer[1] = max(outer[1], peak)

    @property
    def times(self) -> dict[str, float]:
        """Seconds spent in each phase since the last reset, keyed by phase name (a copy)."""
        return dict(self._times)

    def summary(self) -> dict[str, float]:
        """`perf/<phase>_time` for every phase, plus `perf/max_memory_allocated_gb/<phase>` on CUDA."""
        out = {f"perf/{name}_time": seconds for name, seconds in self._times.items()}
        for name, peak in self._peak_bytes.items():
            out[f"perf/max_memory_allocated_gb/{name}"] = peak / _GIB
        return out

    def reset(self) -> None:
        """Forget the accumulated times and peaks (call once per logged step)."""
        if self._open:
            raise RuntimeError(f"cannot reset while phases are open: {[n for n, _ in self._open]}")
        self._times.clear()
        self._peak_bytes.clear()


def perf_metrics(
    cfg: ModelConfig,
    seq_lens: Sequence[int],
    times: Mapping[str, float],
    world_size: int = 1,
    peak_flops: float | None = None,
    *,
    response_lens: Sequence[int] | None = None,
    rollout_num_gpus: int | None = None,
    train_passes: int = 1,
    trainer_phases: Sequence[str] = TRAINER_PHASES,
) -> dict[str, float]:
    """Throughput, TFLOP/s, MFU and wait ratio of one step from its phase times (seconds).

    Inputs:
      seq_lens: prompt + response length of every sequence the actor trained on in this
        step, over all data-parallel ranks (padding excluded).
      times: phase name -> seconds, as from `PhaseTimer.times`.
      world_size: trainer GPUs; TFLOP/s, MFU and tok/s are *per GPU* (total / world_size), so
        MFU = perf/actor_train_tflops * 1e12 / peak_flops.
      peak_flops: dense bf16 FLOP/s of one GPU (`device_peak_flops`); None omits MFU.
      response_lens: response tokens of every rollout sample, for the rollout throughputs.
      rollout_num_gpus: GPUs that generated; defaults to world_size (colocated placement).
      train_passes: how many times each sequence went through forward + backward
        (PPO epochs over the same data).

    Definitions:
      perf/wait_time_ratio = max(0, step - sum of trainer phases) / step, with the trainer phases
        `old_log_probs`, `ref_log_probs`, `actor_train` and `update_weights` (those present). It is
        the fraction of the step the trainer GPUs are not running trainer work: waiting for
        generation and rewards when colocated and synchronous, waiting for the rollout queue when
        asynchronous. Clamped at 0 because the phases are timed separately from the step.
      perf/rollout_tokens_per_gpu_per_s = sum(response_lens) / rollout_time / rollout_num_gpus.
      perf/longest_sample_tokens_per_s = max(response_lens) / rollout_time: the decode speed of
        the straggler, which bounds the rollout when lengths are skewed.
    A metric is omitted when a time it needs is missing or zero.
    """
    if world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    if train_passes < 1:
        raise ValueError(f"train_passes must be >= 1, got {train_passes}")

    def seconds(name: str) -> float | None:
        value = times.get(name)
        return value if value is not None and value > 0 else None

    out: dict[str, float] = {}
    if peak_flops is not None:
        # Say which peak the MFU is against, so numbers from different devices stay readable.
        out["perf/peak_tflops"] = peak_flops / 1e12

    train_time = seconds("actor_train")
    if train_time is not None and seq_lens:
        flops_per_gpu = train_passes * train_flops(cfg, seq_lens) / world_size
        tokens_per_gpu = train_passes * sum(seq_lens) / world_size
        out["perf/actor_train_tflops"] = flops_per_gpu / train_time / 1e12
        out["perf/actor_train_tok_per_s"] = tokens_per_gpu / train_time
        if peak_flops is not None:
            out["perf/actor_train_mfu"] = flops_per_gpu / train_time / peak_flops

    # Log-prob recomputes are forward-only passes over the same sequences.
    for phase, key in (("old_log_probs", "perf/log_probs_tflops"), ("ref_log_probs", "perf/ref_log_probs_tflops")):
        t = seconds(phase)
        if t is not None and seq_lens:
            out[key] = forward_flops(cfg, seq_lens) / world_size / t / 1e12

    step_time = seconds("step")
    if step_time is not None:
        busy = sum(times.get(name, 0.0) for name in trainer_phases)
        out["perf/wait_time_ratio"] = max(0.0, step_time - busy) / step_time

    rollout_time = seconds("rollout")
    if rollout_time is not None and response_lens:
        gpus = rollout_num_gpus if rollout_num_gpus is not None else world_size
        if gpus < 1:
            raise ValueError(f"rollout_num_gpus must be >= 1, got {gpus}")
        out["perf/rollout_tokens_per_gpu_per_s"] = sum(response_lens) / rollout_time / gpus
        out["perf/longest_sample_tokens_per_s"] = max(response_lens) / rollout_time
    return out


# ---------------------------------------------------------------- benchmark timing
# (torch only: the verl bench cell's subprocess uses these without slipstream's engine stack)


def time_once(fn: Callable[[], object], device: torch.device) -> tuple[float, int | None]:
    """(seconds, peak allocated bytes or None) of one call; the peak is reset at the start."""
    if device.type != "cuda":
        start = time.perf_counter()
        fn()
        return time.perf_counter() - start, None
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    return start.elapsed_time(end) / 1000.0, torch.cuda.max_memory_allocated(device)


def repeat_timed(
    fn: Callable[[], object], device: torch.device, repeats: int, warmup: int
) -> tuple[list[float], int | None]:
    """Times of `repeats` calls after `warmup` discarded ones, and the highest phase peak seen."""
    if repeats < 1 or warmup < 0:
        raise ValueError(f"repeats must be >= 1 and warmup >= 0; got {repeats}, {warmup}")
    for _ in range(warmup):
        time_once(fn, device)
    times, peaks = [], []
    for _ in range(repeats):
        seconds, peak = time_once(fn, device)
        times.append(seconds)
        peaks.append(peak)
    return times, (max(peaks) if peaks[0] is not None else None)
