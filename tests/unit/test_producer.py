"""The async producer's pause (used by evals): it holds the engine only once the producer thread has parked,
so no batch that the thread decided to start before the pause lands in the engine during the eval."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace

import pytest
import torch

from slipstream.controller import producer as producer_mod
from slipstream.controller.producer import RolloutProducer


class GatedRollout:
    """An engine whose submit blocks until `gate` is set (a producer thread caught inside submit, its
    requests not yet in flight); step() finishes everything in flight."""

    def __init__(self, n: int) -> None:
        self.n, self.queue = n, []
        self.gate, self.entered = threading.Event(), threading.Event()

    @property
    def has_work(self) -> bool:
        time.sleep(0.01)  # lets a thread waiting for the engine lock take it between submit and step
        return bool(self.queue)

    def submit(self, prompts, sampling, keys, tags, budgets=None) -> None:
        self.entered.set()
        assert self.gate.wait(timeout=10)
        self.queue.extend(tags)

    def step(self) -> list:
        done = [(tag, i, SimpleNamespace(tag=tag, i=i)) for tag in self.queue for i in range(self.n)]
        self.queue = []
        return done


def _producer(rollout: GatedRollout, groups: int) -> RolloutProducer:
    records = [SimpleNamespace(prompt_ids=[1, 2], index=i) for i in range(groups)]
    data = SimpleNamespace(position=0)
    prompts = SimpleNamespace(dataset=data, next_batch=lambda: records)
    stages = SimpleNamespace(
        rollout=rollout, sampling=SimpleNamespace(n=rollout.n), my_share=lambda rs: (0, rs),
        budgets_for=lambda gids: None, score=lambda samples: samples, has_signal=lambda samples: True,
        cfg=SimpleNamespace(rollout=SimpleNamespace(prompts_per_step=groups), trainer=SimpleNamespace(async_stream=True)),
        engine=SimpleNamespace(device=torch.device("cpu")),
    )  # fmt: skip
    return RolloutProducer(stages, prompts, max_staleness=0, first_step=0)


def test_pause_waits_for_a_submit_in_progress(monkeypatch):
    monkeypatch.setattr(producer_mod, "label_group", lambda samples, group_id, record: [
        SimpleNamespace(**vars(s), group_id=group_id) for s in samples])
    rollout = GatedRollout(n=2)
    producer = _producer(rollout, groups=3)
    producer.start()
    try:
        assert rollout.entered.wait(timeout=10)  # the thread is inside submit; nothing in flight yet
        assert not rollout.has_work
        threading.Timer(0.2, rollout.gate.set).start()
        with producer.paused():
            # the eval's turn: the batch started before the pause has been generated, nothing is in flight
            assert not rollout.has_work
            assert producer._complete(0)
        samples, _ = producer.take(0)
        assert len(samples) == 3 * 2
    finally:
        rollout.gate.set()
        producer.stop()


def test_pause_surfaces_a_producer_failure(monkeypatch):
    rollout = GatedRollout(n=1)

    def broken(*args, **kwargs):
        raise OSError("engine gone")

    rollout.submit = broken
    producer = _producer(rollout, groups=1)
    producer.start()
    try:
        with pytest.raises(RuntimeError, match="producer failed"):
            with producer.paused():
                pass
    finally:
        producer.stop()
