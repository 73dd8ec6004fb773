"""Sandboxed reward scoring: worker processes with a per-item timeout and hung-worker replacement.

Each worker is a "spawn" process that resolves the reward specs once, then scores the items
it is sent (a few queued at a time) over its own pipe, replying once per item. The parent
times the item each worker is on; a worker that overruns is killed and replaced and the items
queued behind the stuck one go back to the pool, so one hanging or crashing reward never
stalls or kills the training run. Workers are reused across `score` calls.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import pickle
import signal
import sys
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass, field
from multiprocessing.connection import Connection, wait
from typing import Sequence

from slipstream.rewards.registry import BUILTIN_REWARDS, FILE_MODULE_PREFIX, REWARDS, CombinedReward, RewardSpec

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 120.0  # spawn + imports of user reward modules; generous for slow filesystems
_LOG_COMPLETION_CHARS = 200
# Items queued per worker: the worker goes on to the next item without a round trip to the
# parent, which matters when a reward takes microseconds and the pipe latency does not.
_MAX_INFLIGHT = 8

Item = tuple[str, "str | None", str]  # (completion, answer, prompt)


class RewardError(RuntimeError):
    """A reward raised or timed out while the runner was configured with on_error="raise"."""


def _worker_main(conn: Connection, specs: list[tuple[RewardSpec, float]], names: list[str]) -> None:
    """Worker loop: resolve the rewards once, then score lists of (task_id, item) until None.

    One reply per item (not per list), so the parent can time each item separately.
    """
    # Ctrl-C goes to the whole process group; the parent decides when workers stop.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        reward = CombinedReward(specs, names)
    except BaseException as e:  # noqa: BLE001 - reported to the parent, which raises
        conn.send(("init_error", f"{type(e).__name__}: {e}", traceback.format_exc()))
        return
    conn.send(("ready",))
    while True:
        try:
            tasks = conn.recv()
        except EOFError:
            return
        if tasks is None:
            return
        for task_id, (completion, answer, prompt) in tasks:
            try:
                score, info = reward.score(completion, answer, prompt)
                reply = (task_id, "ok", score, info)
            except Exception as e:  # noqa: BLE001 - any reward failure is reported, never fatal
                reply = (task_id, "error", f"{type(e).__name__}: {e}", traceback.format_exc())
            try:
                conn.send(reply)
            except Exception as e:  # noqa: BLE001 - e.g. an unpicklable info value
                conn.send((task_id, "error", f"reward result could not be sent: {type(e).__name__}: {e}", None))


@dataclass(eq=False)
class _Worker:
    process: mp.process.BaseProcess
    conn: Connection
    started_at: float
    ready: bool = False
    inflight: deque = field(default_factory=deque)
    """(task_id, item index) sent and not yet answered, in the order the worker scores them."""
    deadline: float = 0.0
    """When the head of `inflight` times out."""


def _stop_workers(workers: list[_Worker]) -> None:
    """Ask workers to exit, then kill any that do not (also used as the GC finalizer)."""
    for w in workers:
        try:
            w.conn.send(None)
        except (OSError, ValueError):
            pass
    deadline = time.monotonic() + 1.0
    for w in workers:
        w.process.join(timeout=max(0.0, deadline - time.monotonic()))
        if w.process.is_alive():
            w.process.kill()
            w.process.join(timeout=1.0)
        w.conn.close()
    workers.clear()


class RewardRunner:
    """Scores (completion, answer, prompt) items with a weighted sum of rewards.

    num_workers=0 scores inline in this process: exceptions are still caught, but `timeout_s`
    is NOT enforced (a hanging reward hangs the caller). With num_workers>0 each item has
    `timeout_s` seconds once a worker has it; overruns are killed and scored `error_score`.
    Rewards given as callables must be picklable (module-level); rewards from a file are
    given as "path/file.py:function" so that each worker imports the file itself.
    """

    def __init__(
        self,
        specs_with_weights: Sequence[tuple[RewardSpec, float]] | RewardSpec,
        num_workers: int = 0,
        timeout_s: float = 10.0,
        on_error: str = "zero",
        error_score: float = 0.0,
    ):
        if isinstance(specs_with_weights, str) or callable(specs_with_weights):
            specs_with_weights = [(specs_with_weights, 1.0)]
        if on_error not in ("zero", "raise"):
            raise ValueError(f"on_error must be 'zero' or 'raise', got {on_error!r}")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an integer >= 0, got {num_workers!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        # Resolving here validates every spec (unknown names, bad imports) before any worker starts.
        self._reward = CombinedReward(list(specs_with_weights))
        self.names = list(self._reward.names)
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.on_error = on_error
        self.error_score = float(error_score)
        self._task_counter = 0
        self._workers: list[_Worker] = []
        self._finalizer = weakref.finalize(self, _stop_workers, self._workers)
        if num_workers > 0:
            self._worker_specs = [(self._portable(s), float(w)) for s, w in specs_with_weights]
            self._ctx = mp.get_context("spawn")
            # Started now without waiting: the spawn cost overlaps with whatever the caller does next.
            for _ in range(num_workers):
                self._workers.append(self._start_worker())

    @staticmethod
    def _portable(spec: RewardSpec) -> RewardSpec:
        """What a worker needs to rebuild `spec`: the string itself, or the picklable function."""
        if isinstance(spec, str):
            if ":" in spec or spec in BUILTIN_REWARDS:
                return spec
            spec = REWARDS[spec]  # registered at runtime in this process only: send the function
        module = sys.modules.get(getattr(spec, "__module__", None) or "")
        if module is not None and module.__name__.startswith(FILE_MODULE_PREFIX):
            # Loaded from a file: workers cannot import it by module name, but can by path.
            return f"{module.__file__}:{spec.__name__}"
        try:
            pickle.dumps(spec)
        except Exception as e:
            raise ValueError(
                f"reward {spec!r} cannot be sent to worker processes ({e}); define it at module level "
                "and pass 'package.module:function' or 'path/file.py:function', or use num_workers=0"
            ) from e
        return spec

    def _start_worker(self) -> _Worker:
        parent_conn, child_conn = self._ctx.Pipe(duplex=True)
        process = self._ctx.Process(
            target=_worker_main, args=(child_conn, self._worker_specs, self.names), daemon=True, name="slipstream-reward"
        )
        process.start()
        # Close our copy of the child's end so that a dead worker shows up as EOF on parent_conn.
        child_conn.close()
        return _Worker(process=process, conn=parent_conn, started_at=time.monotonic())

    def _replace_worker(self, worker: _Worker) -> None:
        worker.process.kill()
        worker.process.join(timeout=5.0)
        worker.conn.close()
        self._workers[self._workers.index(worker)] = self._start_worker()

    # -----------------------------------------------------------------------------------------

    def score(self, items: Sequence[Item]) -> list[tuple[float, dict]]:
        """(reward, info) for every (completion, answer, prompt) item, in order."""
        if not self._finalizer.alive:
            raise RuntimeError("RewardRunner is closed")
        if self.num_workers == 0:
            return [self._score_inline(item) for item in items]
        return self._score_parallel(list(items))

    def _score_inline(self, item: Item) -> tuple[float, dict]:
        try:
            return self._reward.score(*item)
        except Exception as e:  # noqa: BLE001 - reward failures are data, not crashes
            return self._on_failure(item, f"{type(e).__name__}: {e}", traceback.format_exc())

    def _on_failure(self, item: Item, error: str, tb: str | None) -> tuple[float, dict]:
        completion = item[0]
        shown = completion[:_LOG_COMPLETION_CHARS] + ("..." if len(completion) > _LOG_COMPLETION_CHARS else "")
        if self.on_error == "raise":
            raise RewardError(f"reward {'+'.join(self.names)} failed: {error} (completion: {shown!r})")
        logger.warning("reward %s failed, scored %s: %s; completion: %r",
                       "+".join(self.names), self.error_score, error, shown)
        if tb:
            logger.debug("reward traceback:\n%s", tb)
        return self.error_score, {"error": error}

    def _score_parallel(self, items: list[Item]) -> list[tuple[float, dict]]:
        results: list[tuple[float, dict] | None] = [None] * len(items)
        pending = deque(range(len(items)))
        first_error: RewardError | None = None

        def fail(index: int, error: str, tb: str | None) -> None:
            nonlocal first_error
            try:
                results[index] = self._on_failure(items[index], error, tb)
            except RewardError as e:
                # Stop handing out work, but let in-flight items finish so the workers are
                # idle (and their pipes empty) before raising.
                first_error = first_error or e
                pending.clear()

        def drop_worker(w: _Worker, error: str) -> None:
            # The head item is the one the worker was stuck on; the rest were never started.
            if w.inflight:
                _, index = w.inflight.popleft()
                if first_error is None:
                    pending.extendleft(reversed([i for _, i in w.inflight]))
                fail(index, error, None)
            self._replace_worker(w)

        while pending or any(w.inflight for w in self._workers):
            idle = [w for w in self._workers if w.ready and len(w.inflight) <= _MAX_INFLIGHT // 2]
            for n, w in enumerate(idle):
                # Split what is left evenly over the idle workers, a few items at a time.
                share = -(-len(pending) // (len(idle) - n))
                tasks = []
                for _ in range(min(share, _MAX_INFLIGHT - len(w.inflight))):
                    index = pending.popleft()
                    self._task_counter += 1
                    tasks.append((self._task_counter, items[index]))
                    w.inflight.append((self._task_counter, index))
                if tasks:
                    if len(w.inflight) == len(tasks):
                        w.deadline = time.monotonic() + self.timeout_s
                    try:
                        w.conn.send(tasks)
                    except OSError:  # died since its last reply; the head item is charged for it
                        drop_worker(w, f"reward worker died (exit code {w.process.exitcode})")
            # Sleep until a message arrives or the earliest deadline passes.
            deadlines = [w.deadline for w in self._workers if w.inflight]
            deadlines += [w.started_at + _STARTUP_TIMEOUT_S for w in self._workers if not w.ready]
            wait([w.conn for w in self._workers], timeout=max(0.0, min(deadlines) - time.monotonic()))
            for w in list(self._workers):
                while w.conn.poll():
                    try:
                        msg = w.conn.recv()
                    except (EOFError, OSError):
                        # The worker died (os._exit, segfault, OOM kill): score its item, replace it.
                        if not w.ready:
                            self.close()
                            raise RuntimeError(f"reward worker died at start-up (exit code {w.process.exitcode})")
                        drop_worker(w, f"reward worker died (exit code {w.process.exitcode})")
                        break
                    if msg[0] == "ready":
                        w.ready = True
                    elif msg[0] == "init_error":
                        self.close()
                        raise RuntimeError(f"reward worker failed to load the rewards: {msg[1]}\n{msg[2]}")
                    else:
                        task_id, index = w.inflight.popleft()
                        assert msg[0] == task_id, "reply does not match the task sent"
                        # The worker starts on its next queued item as soon as it replies.
                        w.deadline = time.monotonic() + self.timeout_s
                        if msg[1] == "ok":
                            results[index] = (msg[2], msg[3])
                        else:
                            fail(index, msg[2], msg[3])
            now = time.monotonic()
            for w in list(self._workers):
                if w.inflight and now >= w.deadline:
                    drop_worker(w, f"timeout after {self.timeout_s:g}s")
                elif not w.ready and now >= w.started_at + _STARTUP_TIMEOUT_S:
                    self.close()
                    raise RuntimeError(f"reward worker did not start within {_STARTUP_TIMEOUT_S:g}s")
        if first_error is not None:
            raise first_error
        assert all(r is not None for r in results)
        return results  # type: ignore[return-value]

    # -----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        self._finalizer()

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
