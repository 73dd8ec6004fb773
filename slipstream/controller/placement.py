"""Disaggregated placement: some torchrun ranks generate, the others train.

    torchrun --nproc-per-node N -m slipstream.cli train RECIPE placement.rollout_ranks=R

The last R ranks run a `RolloutWorker`: the builtin engine, the prompt stream and the reward
workers. The first N - R ranks train (`RLTrainer` with a `DisaggregatedLoop`); their collectives
stay among themselves (`engine.distributed.set_data_parallel_group`). Two channels join the sides:

    samples   each rollout rank sends its scored share of batch j to trainer rank 0 (pickled, point
              to point over the CPU backend), which hands the whole batch to the other trainer ranks;
              with it go the rank's seconds waiting for weights and working (perf/rollout_wait_ratio)
    weights   after each step, trainer rank 0 broadcasts the new weights to the rollout ranks in
              flat buckets over a group of {trainer rank 0} + rollout ranks (NCCL on GPUs, gloo on CPUs)

Staleness: a rollout rank starts batch j once it holds version j - eta (eta = trainer.max_staleness
in async mode, 0 in sync mode), so trainer step j never sees a token older than that. The ranks
move in lockstep at these two channels only; generation of batch j + 1 overlaps training of
batch j when eta >= 1.
"""

from __future__ import annotations

import logging
import pickle
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
import torch.distributed as dist

from slipstream.batching.records import Sample
from slipstream.config.schema import Config
from slipstream.engine.distributed import data_parallel_group, init_distributed, set_data_parallel_group

log = logging.getLogger(__name__)

BUCKET_BYTES = 256 * 2**20
"""Weights travel in flat buffers of about this size (fewer, larger broadcasts)."""


@dataclass(frozen=True)
class Placement:
    """Which ranks train and which generate, and the groups that join them."""

    rank: int
    world: int
    trainer_ranks: tuple[int, ...]
    rollout_ranks: tuple[int, ...]
    weights_group: object
    """{trainer rank 0} + the rollout ranks: the weight broadcast."""

    @property
    def role(self) -> str:
        return "rollout" if self.rank in self.rollout_ranks else "trainer"


def staleness_bound(cfg: Config) -> int:
    """Versions a batch may lag behind the trainer: trainer.max_staleness in async mode, 0 in sync mode."""
    return cfg.trainer.max_staleness if cfg.trainer.mode == "async" else 0


def make_placement(cfg: Config, device_type: str) -> Placement:
    """Join the torchrun world and split it: the last placement.rollout_ranks ranks generate."""
    rank, world, _ = init_distributed(device_type)
    num_rollout = cfg.placement.rollout_ranks
    if not 0 < num_rollout < world:
        raise ValueError(
            f"placement.rollout_ranks={num_rollout} needs at least one rollout and one trainer rank among the "
            f"{world} processes (launch with torchrun --nproc-per-node N)"
        )
    trainer_ranks = tuple(range(world - num_rollout))
    rollout_ranks = tuple(range(world - num_rollout, world))
    # every rank creates every group, in the same order (new_group is collective)
    trainer_group = dist.new_group(list(trainer_ranks))
    weights_group = dist.new_group([0, *rollout_ranks])
    if rank in trainer_ranks:
        set_data_parallel_group(trainer_group)
    return Placement(rank, world, trainer_ranks, rollout_ranks, weights_group)


# ---------------------------------------------------------------------- samples
def send_samples(samples: list[Sample], dst: int, stats: dict | None = None) -> tuple[list, tuple[torch.Tensor, torch.Tensor]]:
    """Start sending `samples` (and the sender's `stats`) to rank `dst`; returns the pending works and the
    buffers they read (keep both until the works are waited on)."""
    payload = torch.frombuffer(bytearray(pickle.dumps((samples, stats or {}))), dtype=torch.uint8)
    size = torch.tensor([payload.numel()], dtype=torch.int64)
    return [dist.isend(size, dst), dist.isend(payload, dst)], (size, payload)


def recv_samples(src: int) -> tuple[list[Sample], dict]:
    """(samples, stats) that rank `src` sent."""
    size = torch.zeros(1, dtype=torch.int64)
    dist.recv(size, src)
    payload = torch.empty(int(size[0]), dtype=torch.uint8)
    dist.recv(payload, src)
    return pickle.loads(payload.numpy().tobytes())


# ---------------------------------------------------------------------- weights
def broadcast_weights(named_tensors: Iterable[tuple[str, torch.Tensor]], placement: Placement, device: torch.device) -> None:
    """Trainer side: send every (HF name, tensor) to the rollout ranks, in flat buckets.

    Every trainer rank iterates the export (FSDP gathers each tensor collectively); trainer rank 0
    sends. A header (names, shapes, dtypes) goes first, so the receivers need no model of their own
    to know the layout."""
    if placement.rank != 0:
        for _ in named_tensors:
            pass
        return
    tensors = [(name, t.detach()) for name, t in named_tensors]
    header = [[(name, tuple(t.shape), str(t.dtype).removeprefix("torch.")) for name, t in tensors]]
    dist.broadcast_object_list(header, src=0, group=placement.weights_group)
    for bucket in _buckets(tensors):
        flat = torch.cat([t.reshape(-1).to(device) for _, t in bucket])
        dist.broadcast(flat, src=0, group=placement.weights_group)


def receive_weights(placement: Placement, device: torch.device) -> list[tuple[str, torch.Tensor]]:
    """Rollout side: the (HF name, tensor) list trainer rank 0 broadcast."""
    header = [None]
    dist.broadcast_object_list(header, src=0, group=placement.weights_group)
    layout = [(name, shape, getattr(torch, dtype)) for name, shape, dtype in header[0]]
    out = []
    empty = [(name, torch.empty(shape, dtype=dtype)) for name, shape, dtype in layout]
    for bucket in _buckets(empty):
        flat = torch.empty(sum(t.numel() for _, t in bucket), dtype=bucket[0][1].dtype, device=device)
        dist.broadcast(flat, src=0, group=placement.weights_group)
        offset = 0
        for name, t in bucket:
            out.append((name, flat[offset : offset + t.numel()].view(t.shape)))
            offset += t.numel()
    return out


def _buckets(tensors: list[tuple[str, torch.Tensor]]) -> list[list[tuple[str, torch.Tensor]]]:
    """Consecutive tensors of one dtype, about BUCKET_BYTES per bucket (the same split on both sides)."""
    buckets: list[list] = []
    size = 0
    for name, t in tensors:
        nbytes = t.numel() * t.element_size()
        if not buckets or size + nbytes > BUCKET_BYTES or buckets[-1][-1][1].dtype != t.dtype:
            buckets.append([])
            size = 0
        buckets[-1].append((name, t))
        size += nbytes
    return buckets


class RemoteRollout:
    """The trainer's view of the rollout ranks: `update_weights` broadcasts (Stages.sync_weights calls it)."""

    def __init__(self, placement: Placement, device: torch.device) -> None:
        self.placement, self.device = placement, device
        self.version = 0
        self.broadcast_s = 0.0
        self.wait_ratio = 0.0
        """Share of the last batch's cycle the rollout ranks spent waiting for weights (mean over the ranks)."""

    def update_weights(self, named_tensors, version: int) -> None:
        start = time.perf_counter()
        broadcast_weights(named_tensors, self.placement, self.device)
        self.version = int(version)
        self.broadcast_s += time.perf_counter() - start

    def sleep(self) -> None:
        pass

    def wake(self) -> None:
        pass

    def state_dict(self) -> dict:
        return {"version": self.version}

    def load_state_dict(self, state: dict) -> None:
        self.version = int(state["version"])

    def gather_batch(self) -> list[Sample]:
        """Batch of the current step: every rollout rank's share, on every trainer rank, in group order."""
        samples: list[Sample] = []
        ratios = []
        if self.placement.rank == 0:
            for src in self.placement.rollout_ranks:
                part, stats = recv_samples(src)
                samples += part
                cycle = stats.get("wait_s", 0.0) + stats.get("busy_s", 0.0)
                ratios.append(stats.get("wait_s", 0.0) / cycle if cycle > 0 else 0.0)
            samples.sort(key=lambda s: s.group_id)
        group = data_parallel_group()
        if len(self.placement.trainer_ranks) > 1:
            box = [(samples, ratios)]
            dist.broadcast_object_list(box, src=0, group=group)
            samples, ratios = box[0]
        self.wait_ratio = sum(ratios) / len(ratios) if ratios else 0.0
        return samples


class RolloutWorker:
    """A rollout rank: receive weights, generate and score its share of each batch, send it to the trainer."""

    def __init__(self, cfg: Config, placement: Placement) -> None:
        from slipstream.controller import setup
        from slipstream.controller.prompts import PromptSource

        self.cfg, self.placement = cfg, placement
        self.rank = placement.rank
        self.run_dir = Path(cfg.trainer.run_dir)  # rank 0 (a trainer) owns and checks it
        device = setup.pick_device(cfg.trainer.device)
        if device.type == "cuda":
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.tokenizer = setup.build_tokenizer(cfg)
        _, self.model_cfg = setup.build_policy(cfg, len(self.tokenizer))
        self.rollout = setup.build_rollout(cfg, self.model_cfg, device, setup.DTYPES[cfg.model.dtype])
        self.sampling = setup.build_sampling(cfg, self.tokenizer, self.model_cfg)
        self.prompts = PromptSource(cfg, self.tokenizer, max_context=self.model_cfg.max_position_embeddings)
        self.rewards = setup.build_rewards(cfg, self.prompts.reward_functions())
        self.eta = staleness_bound(cfg)
        self.version = -1

    def _receive(self) -> None:
        self.rollout.update_weights(receive_weights(self.placement, self.device), version=self.version + 1)
        self.version += 1

    def _share(self, records: list) -> tuple[int, list]:
        k, n = self.placement.rollout_ranks.index(self.rank), len(self.placement.rollout_ranks)
        first = k * len(records) // n
        return first, records[first : (k + 1) * len(records) // n]

    def fit(self) -> None:
        """Produce batches 0 .. total_steps - 1, each with weights at most eta versions behind the trainer."""
        from slipstream.controller.stages import generate_groups, score_samples

        total = self.cfg.trainer.total_steps
        # Sends stay pending (their buffers alive) until the end: this rank may only block in the weight
        # broadcasts, which the trainer reaches after receiving the batches sent before them.
        pending = []
        try:
            start = time.perf_counter()
            self._receive()  # the trainer's initial weights, version 0
            for j in range(total):
                while self.version < j - self.eta:
                    self._receive()
                waited = time.perf_counter() - start  # blocked on weights since the last batch was sent
                start = time.perf_counter()
                first, records = self._share(self.prompts.next_batch())
                samples = generate_groups(self.rollout, self.sampling, records, first)
                scored = score_samples(self.tokenizer, self.rewards, samples)
                stats = {"wait_s": waited, "busy_s": time.perf_counter() - start}
                pending = [p for p in pending if not all(w.is_completed() for w in p[0])]  # delivered: free them
                pending.append(send_samples(scored, dst=0, stats=stats))
                start = time.perf_counter()
            while self.version < total:  # the trainer broadcasts once more after its last step
                self._receive()
            for works, _ in pending:
                for work in works:
                    work.wait()
        finally:
            self.rewards.close()
