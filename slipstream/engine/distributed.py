"""Process-group helpers for the FSDP2 backend: one data-parallel group over every rank.

Launch with `torchrun --nproc-per-node N` for N ranks; without torchrun's environment a
1-process group is created (FileStore in a temporary directory), so FSDP2 also runs as a
plain `python` process on one GPU or the CPU.

On CUDA the default group has two backends, "cpu:gloo,cuda:nccl": gradients and weights
travel over NCCL, while the per-minibatch loss denominators, counted from CPU-side masks,
are all-reduced over gloo without touching the GPU stream (no host sync in the hot path).
NCCL environment variables are left untouched (the GPU host sets NCCL_NVLS_ENABLE=0).
"""

from __future__ import annotations

import os
import socket
import tempfile
import warnings

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from slipstream.batching.packing import scatter_per_token
from slipstream.batching.records import PackedBatch

_TORCHRUN_VARS = ("RANK", "WORLD_SIZE", "LOCAL_RANK")
_mesh: DeviceMesh | None = None
_dp_group: dist.ProcessGroup | None = None  # the trainer's data-parallel ranks; None: every rank


def _backend(device_type: str) -> str:
    if device_type == "cuda":
        return "cpu:gloo,cuda:nccl"
    if device_type == "cpu":
        return "gloo"
    raise ValueError(f"unsupported device type {device_type!r} for the fsdp backend; expected 'cuda' or 'cpu'")


def warn_if_other_device(requested: torch.device | str, used: torch.device) -> None:
    """Warn when a specific GPU was asked for but the rank trains on another (LOCAL_RANK decides)."""
    requested = torch.device(requested)
    if requested.index is not None and requested != used:
        warnings.warn(
            f"device {requested} was requested but this rank uses {used} (its LOCAL_RANK); "
            "select GPUs with CUDA_VISIBLE_DEVICES instead",
            stacklevel=3,
        )


def init_distributed(device_type: str) -> tuple[int, int, torch.device]:
    """Join (or create) the default process group; returns (rank, world_size, this rank's device).

    Reads torchrun's RANK / WORLD_SIZE / LOCAL_RANK (plus MASTER_ADDR / MASTER_PORT); when they
    are absent, creates a 1-process group. Calling it again returns the existing group.
    """
    backend = _backend(device_type)
    present = [v for v in _TORCHRUN_VARS if v in os.environ]
    if present and len(present) != len(_TORCHRUN_VARS):
        raise ValueError(f"torchrun environment is incomplete: found {present}, need all of {list(_TORCHRUN_VARS)}")
    local_rank = int(os.environ.get("LOCAL_RANK", 0))
    if device_type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError("device type 'cuda' requested but CUDA is not available")
        device = torch.device("cuda", local_rank)
        torch.cuda.set_device(device)
    else:
        device = torch.device("cpu")

    if not dist.is_initialized():
        device_id = device if device_type == "cuda" else None
        if present:
            dist.init_process_group(backend, device_id=device_id)  # env:// rendezvous
        else:
            # One process: a FileStore needs no free port and cannot collide with other jobs.
            store = dist.FileStore(os.path.join(tempfile.mkdtemp(prefix="slipstream_pg_"), "store"), 1)
            dist.init_process_group(backend, store=store, rank=0, world_size=1, device_id=device_id)
    elif device_type == "cuda" and "nccl" not in str(dist.get_backend()):
        raise ValueError(f"a process group with backend {dist.get_backend()!r} exists; CUDA training needs NCCL")
    return dist.get_rank(), dist.get_world_size(), device


def dp_mesh(device_type: str) -> DeviceMesh:
    """The 1-D data-parallel mesh ("dp") over the data-parallel ranks (every rank, or the trainer ranks of a
    disaggregated placement: `set_data_parallel_group`), created once per process."""
    global _mesh
    if _mesh is None or _mesh.device_type != device_type:
        _, world_size, _ = init_distributed(device_type)
        if _dp_group is not None:  # the trainer ranks' own group, already created by every rank
            _mesh = DeviceMesh.from_group(_dp_group, device_type, mesh_dim_names=("dp",))
        else:
            _mesh = init_device_mesh(device_type, (world_size,), mesh_dim_names=("dp",))
    return _mesh


def set_data_parallel_group(group: dist.ProcessGroup | None) -> None:
    """Restrict the trainer's collectives (`all_reduce_`, `world_size`, `rank`, ...) to `group`: with a
    disaggregated placement the rollout ranks are in the world but not in the trainer's reductions."""
    global _dp_group, _mesh
    _dp_group = group
    _mesh = None  # a mesh built before belongs to the old group


def data_parallel_group() -> dist.ProcessGroup | None:
    """The group of the trainer's data-parallel ranks (None: the default group, every rank)."""
    return _dp_group


def world_size() -> int:
    """Number of data-parallel ranks (1 when no process group exists)."""
    return dist.get_world_size(_dp_group) if dist.is_initialized() else 1


def rank() -> int:
    """This process's rank among the data-parallel ranks (0 when no process group exists)."""
    return dist.get_rank(_dp_group) if dist.is_initialized() else 0


def all_reduce_(tensor: torch.Tensor, op: dist.ReduceOp.RedOpType = dist.ReduceOp.SUM) -> torch.Tensor:
    """In-place all-reduce over the default group (a no-op on one process); returns the tensor.

    CPU tensors use the gloo backend, CUDA tensors NCCL (see the module docstring).
    """
    if world_size() > 1:
        dist.all_reduce(tensor, op=op, group=_dp_group)
    return tensor


def gather_per_token(
    values_per_mb: list[torch.Tensor], ids_per_mb: list[tuple[int, ...]], batch: PackedBatch
) -> torch.Tensor:
    """Per-token values (T, ...) of the whole `batch` on every rank, from each rank's micro-batch results.

    Each rank scatters its own sequences (ids from `batching.shard.local_micro_batches`) into a
    zero tensor; every position is covered by exactly one rank, so a SUM all-reduce assembles the
    full batch exactly.
    """
    return all_reduce_(scatter_per_token(values_per_mb, ids_per_mb, batch))


def check_same_on_all_ranks(value: int, what: str) -> None:
    """Raise ValueError unless every rank passes the same `value` (one tiny gloo/CPU all-reduce).

    FSDP2 runs collectives inside every forward, so ranks that disagree on the number of
    micro-batches would hang; this turns that hang into an error.
    """
    if world_size() == 1:
        return
    bounds = all_reduce_(torch.tensor([value, -value], dtype=torch.int64), dist.ReduceOp.MAX)
    high, low = int(bounds[0]), -int(bounds[1])
    if high != low:
        raise ValueError(
            f"ranks disagree on {what}: between {low} and {high}; every rank must get the same number "
            f"(use slipstream.batching.shard.local_micro_batches, which pads with empty micro-batches)"
        )


def free_port() -> int:
    """An unused localhost TCP port (for tests that spawn ranks with MASTER_PORT)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def destroy_distributed() -> None:
    """Tear down the default process group and the cached mesh (tests, end of a run)."""
    global _mesh, _dp_group
    _mesh = _dp_group = None
    if dist.is_initialized():
        dist.destroy_process_group()
