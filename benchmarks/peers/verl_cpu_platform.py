"""A CPU platform for verl 0.9.1, used only to check the verl cell's path on a machine without a GPU.

verl 0.9.1 cannot run on the CPU as shipped: its platform layer (verl/plugin/platform) knows
CUDA, NPU and ROCm only and falls back to "nvidia" when none is present, so every
`get_device_name()` says "cuda" and `init_device_mesh("cuda")` calls `torch.cuda.set_device`; and
its FSDP engine is registered for the devices "cuda" and "npu" only (EngineRegistry). verl has a
hook for exactly this (`set_platform` / PlatformRegistry: "add a new platform"), so this module
plugs in a CPU platform with gloo collectives and zero device memory. The runner installs it only
when the requested device is the CPU (tests); a GPU run uses verl's own CUDA platform untouched.
Importing this module needs verl (the verl site directory on sys.path).
"""

from __future__ import annotations

import contextlib
import os
import types

import torch
from verl.plugin.platform.platform_base import PlatformBase
from verl.plugin.platform.platform_manager import set_platform


def _device_module() -> types.ModuleType:
    """What verl calls on `get_torch_device()`: torch.cuda's names, answered for the CPU."""
    module = types.ModuleType("slipstream_verl_cpu_device")
    for name in ("max_memory_allocated", "max_memory_reserved", "memory_allocated", "memory_reserved"):
        setattr(module, name, lambda *args, **kwargs: 0)
    for name in ("empty_cache", "reset_peak_memory_stats", "set_device", "synchronize", "manual_seed_all"):
        setattr(module, name, lambda *args, **kwargs: None)
    module.manual_seed = torch.manual_seed
    module.is_available = lambda: True
    # verl moves batches with `.to(get_device_id())`: "cpu" keeps them here (an int would mean cuda:N).
    module.current_device = lambda: "cpu"
    module.device_count = lambda: 1
    module.get_device_name = lambda *args: "CPU"  # verl's MFU then divides by an unknown (inf) peak
    module.mem_get_info = lambda *args: (0, 0)
    return module


class CPUPlatform(PlatformBase):
    """verl's platform interface answered for the CPU with gloo (world size 1)."""

    _module = _device_module()

    @property
    def device_name(self) -> str:
        return "cpu"

    @property
    def vendor_name(self) -> str:
        return "cpu"

    @property
    def device_module(self) -> types.ModuleType:
        return self._module

    def is_available(self) -> bool:
        return True

    def current_device(self) -> str:  # type: ignore[override]  # see _device_module
        return "cpu"

    def device_count(self) -> int:
        return 1

    def set_device(self, device_index: int) -> None:
        pass

    def synchronize(self, device_index: int | None = None) -> None:
        pass

    def manual_seed(self, seed: int) -> None:
        torch.manual_seed(seed)

    def manual_seed_all(self, seed: int) -> None:
        torch.manual_seed(seed)

    def set_allocator_settings(self, settings: str) -> None:
        pass

    def empty_cache(self) -> None:
        pass

    def get_device_capability(self, device_index: int = 0) -> tuple[int | None, int | None]:
        return (None, None)

    def communication_backend_name(self) -> str:
        return "gloo"

    def visible_devices_envvar(self) -> str:
        return "CUDA_VISIBLE_DEVICES"

    @contextlib.contextmanager
    def nvtx_range(self, msg: str):
        yield

    def profiler_start(self) -> None:
        pass

    def profiler_stop(self) -> None:
        pass

    def ray_resource_name(self) -> str:
        return "CPU"

    def ray_noset_envvars(self) -> list[str]:
        return []

    def is_ipc_supported(self) -> bool:
        return False

    def cudart(self) -> None:
        return None


def install_cpu_platform() -> None:
    """Make verl run on the CPU; call before verl.workers is imported (modules cache the device name)."""
    set_platform(CPUPlatform())
    # EngineRegistry keys the FSDP engine by device ("cuda" / "npu"); the engine itself then asks
    # the platform above for its device, so it runs on the CPU.
    os.environ["VERL_ENGINE_DEVICE"] = "cuda"
