"""The async loop's producer: a background thread that generates and scores the batches of future steps.

Batch j is the j-th step's prompts (drawn from the data stream in order, as the sync loop draws
them). The producer starts batch j only once the trainer holds version j - max_staleness
(AReaL's admission rule): every token of batch j is then sampled by weights of version
>= j - max_staleness, and the trainer, which trains batch j at version j, never sees a token
staler than max_staleness. With max_staleness 0 the producer waits for each weight sync and the
run is the sync loop's, step for step.

Within a batch, groups are generated with continuous batching next to the requests of later
batches. A weight sync does not wait for them: the trainer's `update_weights` takes the engine
lock between two engine steps, copies the weights in place, and in-flight samples continue (their
next tokens carry the new version). A group is scored as soon as its last sample finishes; with
dynamic sampling (controller/dynamic_sampling.py) a group whose rewards are all equal is dropped
there and the next spare prompt of the stream takes its place.

On a GPU the producer thread issues its work on a CUDA stream of its own, at high priority: the
rollout's decode (memory-bound) and the trainer's passes (compute-bound) can then run on the device
at the same time instead of queueing behind each other on the default stream. The two streams meet
only where the engine changes hands: a weight update (the copy waits for the rollout's work, the
rollout's next step waits for the copy) and an eval's pause (the eval waits for the rollout's work,
the rollout's next step waits for the eval's).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from dataclasses import dataclass, field

import torch

from slipstream.batching.records import Sample
from slipstream.controller.dynamic_sampling import DynamicSampling, SparePrompts
from slipstream.controller.prompts import PromptSource
from slipstream.controller.stages import Stages, label_group

log = logging.getLogger(__name__)


@dataclass
class _Batch:
    """What the producer knows of one step's batch."""

    stream_start: int
    """Data-stream position of the batch's first prompt (the resume point when this batch is next)."""
    needed: int
    """Groups this rank must deliver."""
    pending: dict[int, list] = field(default_factory=dict)
    """group id -> (record, samples finished so far)."""
    done: list[list[Sample]] = field(default_factory=list)
    dynamic: DynamicSampling | None = None
    """The batch's dynamic-sampling filter (None: every group is trained)."""


class RolloutProducer:
    """Runs the rollout engine in a thread, `max_staleness` batches ahead of the trainer at most."""

    def __init__(
        self, stages: Stages, prompts: PromptSource, max_staleness: int, first_step: int,
        dynamic_sampling: bool = False,
    ) -> None:  # fmt: skip
        self.stages, self.prompts = stages, prompts
        self.max_staleness = max_staleness
        self.dynamic_sampling = dynamic_sampling
        self.trainer_version = first_step
        self.next_batch = first_step
        self.batches: dict[int, _Batch] = {}
        self.starts: dict[int, int] = {}  # batch -> data-stream position of its first prompt (kept after take)
        self.engine_lock = threading.Lock()  # held for every engine step and every weight update
        self.cond = threading.Condition()
        self.idle_s = 0.0  # producer time with nothing to do (throttled by the staleness bound, or no prompts)
        self.error: BaseException | None = None
        self._stop = False
        self._pause = False
        self._parked = False  # the producer thread waits with nothing in flight (it submits nothing meanwhile)
        self.spares = SparePrompts(prompts)  # dynamic sampling's replacements
        self._thread = threading.Thread(target=self._run, name="rollout-producer", daemon=True)
        device = stages.engine.device
        own = device.type == "cuda" and stages.cfg.trainer.async_stream
        self.stream = torch.cuda.Stream(device, priority=-1) if own else None
        """The producer thread's CUDA stream (None on the CPU or with trainer.async_stream false)."""

    # ------------------------------------------------------------------ trainer side
    def start(self) -> None:
        self._join_streams(to_trainer=False)  # the rollout starts after the trainer's weight sync and evals
        self._thread.start()

    def stop(self) -> None:
        with self.cond:
            self._stop = True
            self.cond.notify_all()
        self._thread.join()
        self._join_streams(to_trainer=True)

    def take(self, step: int) -> tuple[list[Sample], dict[str, float]]:
        """Block until batch `step` is complete; its samples (group order) and producer metrics."""
        with self.cond:
            while not self._complete(step):
                if self.error is not None:
                    raise RuntimeError("the rollout producer failed") from self.error
                self.cond.wait(timeout=1.0)
            batch = self.batches.pop(step)
            idle, self.idle_s = self.idle_s, 0.0
        groups = sorted(batch.done, key=lambda g: g[0].group_id)
        dynamic = batch.dynamic or DynamicSampling(step, 0, 0)  # (nothing dropped)
        metrics = {
            **dynamic.metrics(),
            "async/batches_ahead": float(max(self.next_batch - step - 1, 0)),
            "perf/rollout_idle_time": idle,
        }
        return [s for g in groups for s in g], metrics

    @contextlib.contextmanager
    def paused(self):
        """Hold the engine idle (in-flight work finished, no batch started) for another user: an eval.

        Waits until the producer thread has parked: an engine without work is not enough, since the
        thread may be about to submit a batch it decided to start before the pause (an eval's greedy
        requests would then meet its sampled ones in flight)."""
        with self.cond:
            self._pause = True
            self.cond.notify_all()
            while not self._parked and self._thread.is_alive() and self.error is None:
                self.cond.wait(timeout=0.05)
            if self.error is not None:
                raise RuntimeError("the rollout producer failed") from self.error
        try:
            with self._trainer_holds_engine():
                yield
        finally:
            with self.cond:
                self._pause = False
                self.cond.notify_all()

    def update_weights(self, named_tensors, version: int) -> None:
        """Copy new weights into the engine between two engine steps; admit the batches version allows."""
        with self._trainer_holds_engine():
            self.stages.rollout.update_weights(named_tensors, version=version)
        with self.cond:
            self.trainer_version = version
            self.cond.notify_all()

    @contextlib.contextmanager
    def _trainer_holds_engine(self):
        """The trainer thread uses the engine between two engine steps: the engine lock held, its work
        ordered after the rollout's queued work, and the rollout's next work after it."""
        with self.engine_lock:
            self._join_streams(to_trainer=True)
            try:
                yield
            finally:
                self._join_streams(to_trainer=False)

    def _join_streams(self, to_trainer: bool) -> None:
        """Order the two streams where the engine changes hands (called by the trainer thread, engine lock
        held): to_trainer, the trainer's next work waits for the rollout's; else the reverse."""
        if self.stream is None:
            return
        trainer = torch.cuda.current_stream(self.stream.device)
        if to_trainer:
            trainer.wait_stream(self.stream)
        else:
            self.stream.wait_stream(trainer)

    # ------------------------------------------------------------------ producer thread
    def _complete(self, step: int) -> bool:
        batch = self.batches.get(step)
        return batch is not None and len(batch.done) >= batch.needed and not batch.pending

    def _run(self) -> None:
        stream = torch.cuda.stream(self.stream) if self.stream is not None else contextlib.nullcontext()
        try:
            with stream:
                self._loop()
        except BaseException as err:  # surfaced to the trainer thread by take()
            log.exception("rollout producer failed")
            with self.cond:
                self.error = err
                self.cond.notify_all()

    def _loop(self) -> None:
        while True:
            with self.cond:
                if self._stop:
                    return
                start_batch = not self._pause and self.next_batch <= self.trainer_version + self.max_staleness
            if start_batch:
                self._start_batch()
                continue
            if self.stages.rollout.has_work:
                with self.engine_lock:
                    finished = self.stages.rollout.step()
                self._collect(finished)
                continue
            with self.cond:  # throttled (wait for the next weight sync or stop) or paused
                started = time.perf_counter()
                self._parked = True
                self.cond.notify_all()
                while not self._stop and (self._pause or self.next_batch > self.trainer_version + self.max_staleness):
                    self.cond.wait()
                self._parked = False
                self.idle_s += time.perf_counter() - started

    def _start_batch(self) -> None:
        j = self.next_batch
        stream_start = self.prompts.dataset.position
        first, records = self.stages.my_share(self.prompts.next_batch())
        dynamic = DynamicSampling.for_step(self.stages.cfg, j) if self.dynamic_sampling else None
        batch = _Batch(stream_start=stream_start, needed=len(records), dynamic=dynamic)
        with self.cond:
            self.batches[j] = batch
            self.starts[j] = stream_start
            self.next_batch += 1
        self._submit(j, [(first + g, r) for g, r in enumerate(records)])

    def _submit(self, j: int, groups: list) -> None:
        batch = self.batches[j]
        for group_id, record in groups:
            batch.pending[group_id] = [record, [None] * self.stages.sampling.n]
        with self.engine_lock:
            self.stages.rollout.submit(
                [r.prompt_ids for _, r in groups], self.stages.sampling, keys=[r.index for _, r in groups],
                tags=[(j, gid) for gid, _ in groups], budgets=self.stages.budgets_for([gid for gid, _ in groups]),
            )  # fmt: skip

    def _collect(self, finished: list) -> None:
        """File finished samples under their group; score groups whose samples are all in."""
        for (j, group_id), index, sample in finished:
            record, samples = self.batches[j].pending[group_id]
            samples[index] = sample
            if all(s is not None for s in samples):
                del self.batches[j].pending[group_id]
                self._finish_group(j, group_id, record, samples)

    def _finish_group(self, j: int, group_id: int, record, samples: list[Sample]) -> None:
        scored = self.stages.score(label_group(samples, group_id, record))
        batch = self.batches[j]
        if batch.dynamic is not None:
            replacement = batch.dynamic.admit(scored, self.spares)
            if replacement is not None:  # dropped: generate the next spare prompt in its place
                self._submit(j, [replacement])
                return
        with self.cond:
            batch.done.append(scored)
            self.cond.notify_all()
