"""Datasheet peaks and model FLOPs utilisation (MFU).

MFU = achieved model FLOP/s per GPU / the GPU's *dense* bf16 peak. Sparse ("with sparsity")
datasheet numbers are twice the dense ones and are never used here. H100 / H200 SXM use
989 TFLOP/s, the same peak verl and Miles report against, so MFUs are comparable.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)

# (substring of the upper-cased torch.cuda.get_device_name(), dense bf16 FLOP/s).
# Order matters: the first match wins, so more specific names come before their prefixes
# ("H100 PCIE" before "H100", "GB200" before "B200", "H200" before "H20", "L40S" before "L40").
PEAK_BF16_FLOPS: tuple[tuple[str, float], ...] = (
    ("GB200", 2500e12),
    ("B200", 2250e12),
    ("H200", 989e12),
    ("H100 PCIE", 756e12),
    ("H100 NVL", 835e12),
    ("H100", 989e12),  # SXM, reported as "NVIDIA H100 80GB HBM3"
    ("H800", 989e12),
    ("H20", 148e12),
    ("A100", 312e12),  # SXM and PCIe share the bf16 tensor peak
    ("A800", 312e12),
    ("L40S", 362e12),
    ("L40", 181e12),
    ("L4", 121e12),
    ("MI300X", 1307e12),
)


def lookup_device(table: tuple[tuple[str, float], ...], device_name: str) -> float | None:
    """The value of the first key of `table` found in a device name as torch reports it, or None."""
    # Names come as "NVIDIA H100 80GB HBM3", "NVIDIA A100-SXM4-80GB", "NVIDIA H100 PCIe".
    name = device_name.upper().replace("-", " ")
    return next((value for key, value in table if key in name), None)


def lookup_peak_flops(device_name: str) -> float | None:
    """Dense bf16 peak FLOP/s for a device name as torch reports it, or None if unknown."""
    return lookup_device(PEAK_BF16_FLOPS, device_name)


_OVERRIDE = "trainer.peak_flops (slipstream bench: --peak-flops)"


def device_peak_flops(device_name: str | None = None, override: float | None = None) -> float | None:
    """Peak FLOP/s to compute MFU against: `override` if given, else the table entry for the device.

    `device_name=None` asks torch for the current CUDA device; "cpu" is accepted. Returns None (with a warning) on
    the CPU or for a GPU not in the table; callers then omit MFU rather than report a made-up one.
    """
    if override is not None:
        if not override > 0:
            raise ValueError(f"peak FLOP/s override must be positive, got {override}")
        return float(override)
    if device_name is None:
        if not torch.cuda.is_available():
            logger.warning("no CUDA device: MFU is not reported (set %s to report it)", _OVERRIDE)
            return None
        device_name = torch.cuda.get_device_name()
    if device_name.strip().lower() == "cpu":
        logger.warning("no peak FLOP/s for the CPU: MFU is not reported (set %s to report it)", _OVERRIDE)
        return None
    peak = lookup_peak_flops(device_name)
    if peak is None:
        logger.warning(
            "no dense bf16 peak known for device %r: MFU is not reported; set %s to its dense bf16 FLOP/s to report it",
            device_name,
            _OVERRIDE,
        )
    return peak


def mfu(flops: float, seconds: float, peak: float) -> float:
    """Model FLOPs utilisation: `flops` done in `seconds` on one device, over its `peak` FLOP/s."""
    if not seconds > 0:
        raise ValueError(f"seconds must be positive, got {seconds}")
    if not peak > 0:
        raise ValueError(f"peak FLOP/s must be positive, got {peak}")
    return flops / seconds / peak
