"""Peer frameworks in the benchmark matrix: which are installed, and how to install the rest.

Each adapter (trl_adapter.py, verl_adapter.py) drives the peer's own installed package on the
same pre-built batch as slipstream. This module only answers "is it there, which version, and
if not, what would install it", without importing the (heavy) peer packages.
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
from dataclasses import dataclass


@dataclass(frozen=True)
class PeerInfo:
    """What the matrix needs to know about one peer before running it."""

    name: str
    """Framework name as written in a matrix spec ("trl", "verl")."""
    module: str
    """Top-level import name of the package."""
    install: str
    """The pip command a user would run to make the peer available."""
    note: str = ""
    """Known constraints of installing it next to slipstream."""


PEERS: dict[str, PeerInfo] = {
    "trl": PeerInfo(
        name="trl",
        module="trl",
        # Pinning torch keeps pip from replacing the installed (CUDA) build while resolving trl.
        install="pip install trl==1.16.0 'torch==<installed version>'",
        note="trl 1.16.0 needs transformers>=4.56.2 and accelerate; developed against trl 1.16.0.",
    ),
    "liger-kernel": PeerInfo(
        name="liger-kernel",
        module="liger_kernel",
        # A 0.9 MB pure-Python + Triton wheel; the GPU machine gets it carried (benchmarks/gpu_setup.sh).
        install="pip install --no-deps liger-kernel==0.8.5",
        note="TRL's use_liger_kernel=True needs it; its kernels are Triton, so the cell runs on a GPU only.",
    ),
    "verl": PeerInfo(
        name="verl",
        module="verl",
        install=(
            "bash benchmarks/gpu_setup.sh download, carry .whl, then on the GPU machine: source benchmarks/gpu_setup.sh install "
            "(sets SLIPSTREAM_VERL_SITE); for this python: bash benchmarks/gpu_setup.sh verl-local DIR"
        ),
        note=(
            "verl 0.9.1 pins transformers<5.11 and tensordict<=0.10, which conflict with slipstream's "
            "transformers 5.x: it runs in a subprocess from its own site directory (peers.verl.site_dir or "
            "SLIPSTREAM_VERL_SITE), with import-only stand-ins for ray, uvicorn, fastapi and pydantic."
        ),
    ),
}


def peer_version(name: str) -> str | None:
    """Installed version of peer `name` (from package metadata, without importing it), or None."""
    info = PEERS.get(name)
    if info is None:
        raise ValueError(f"unknown peer {name!r}; known peers: {', '.join(PEERS)}")
    if importlib.util.find_spec(info.module) is None:
        return None
    try:
        return importlib.metadata.version(info.module)
    except importlib.metadata.PackageNotFoundError:
        # Importable but without metadata (e.g. a source checkout on PYTHONPATH).
        return "unknown"


def peer_versions() -> dict[str, str | None]:
    """Installed version (or None) of every known peer and of accelerate, which TRL runs on."""
    versions = {name: peer_version(name) for name in PEERS}
    try:
        versions["accelerate"] = importlib.metadata.version("accelerate")
    except importlib.metadata.PackageNotFoundError:
        versions["accelerate"] = None
    return versions


def install_command(name: str) -> str:
    """The command that installs peer `name`, with the running torch version filled in."""
    import torch  # only for its version string

    return PEERS[name].install.replace("<installed version>", torch.__version__.split("+")[0])


def missing_result(name: str, reason: str | None = None) -> dict:
    """Cell result of a peer that is not installed: says so and how to install it; no numbers."""
    info = PEERS[name]
    return {
        "status": "missing",
        "reason": reason or f"{name} is not installed (no importable module {info.module!r}). {info.note}".strip(),
        "install": install_command(name),
    }
