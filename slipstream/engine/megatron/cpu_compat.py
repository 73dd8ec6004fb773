"""Run megatron-core's (0.16 to 0.19) DDP, distributed optimizer and schedules on the CPU (tests, `bench --preset tiny`).

Those modules hard-code CUDA in a handful of places that carry no CUDA-specific logic:
  * scalars created with `device="cuda"` (the schedule's token counter, the optimizer's
    overflow / scale buffers, clip_grads' dummy buffer) and `Tensor.cuda()` copies;
  * `torch.cuda.current_device()` as a device argument (grad buffers, RoPE tables);
  * dtype checks written as `param.type() in ['torch.cuda.FloatTensor', ...]`;
  * activation recompute saving the CUDA RNG state (`torch.cuda.get_rng_state`);
  * (0.19) the gradient sync waiting on the current CUDA stream for CUDA-graph events.
`cuda_calls_on_cpu()` redirects exactly these for the duration of a block: a TorchFunctionMode
rewrites CUDA device arguments to the CPU, makes `.cuda()` an identity and reports CPU tensor
types under their CUDA names, `torch.cuda.current_device` returns "cpu", and
`torch.cuda.current_stream` a stream whose waits do nothing (the CPU runs in program order). MegatronEngine
enters it around its own calls when its device is the CPU, so the CPU runs the code the GPU runs;
on CUDA it is never entered.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch
from torch.overrides import TorchFunctionMode


class _CudaToCpu(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = dict(kwargs or {})
        device = kwargs.get("device")
        if device is not None and str(device).startswith("cuda"):
            kwargs["device"] = "cpu"
        if func is torch.Tensor.cuda:
            return args[0]
        if func is torch.Tensor.type and len(args) == 1 and not kwargs:
            return func(*args).replace("torch.", "torch.cuda.", 1)
        return func(*args, **kwargs)


class _CpuStream:
    """The CPU's one stream: work runs in program order, so there is nothing to wait for."""

    def wait_event(self, event) -> None:
        pass

    def wait_stream(self, stream) -> None:
        pass


@contextlib.contextmanager
def cuda_calls_on_cpu() -> Iterator[None]:
    """Redirect megatron-core's hard-coded CUDA calls (module docstring) to the CPU inside the block."""
    saved = torch.cuda.current_device, torch.cuda.random.get_rng_state, torch.cuda.current_stream
    torch.cuda.current_device = lambda: "cpu"
    torch.cuda.current_stream = lambda device=None: _CpuStream()
    # activation recompute saves the CUDA RNG state next to the CPU one; there is none here
    # (restoring it goes through torch.cuda._lazy_call, which only queues work without CUDA)
    torch.cuda.random.get_rng_state = lambda device="cuda": torch.empty(0, dtype=torch.uint8)
    try:
        with _CudaToCpu():
            yield
    finally:
        torch.cuda.current_device, torch.cuda.random.get_rng_state, torch.cuda.current_stream = saved
