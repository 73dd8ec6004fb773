"""Sandboxed reward scoring: worker processes, per-call timeouts, failures summarised once per batch.

Each worker is a "spawn" process that resolves the reward specs once, then runs the calls it is
sent (one call = one reward function on one completion; a few queued at a time) over its own
pipe, replying once per call. The parent times the call each worker is on; a worker that
overruns is killed and replaced and the calls queued behind the stuck one go back to the pool,
so one hanging or crashing reward never stalls or kills the training run. Workers are reused
across `score` calls.

A batch (one `score` call: a step's completions in the sync loop) gives a function that hangs
one timeout, not one per completion: the workers run calls side by side, so their first calls of
a hanging function time out together, and once a call of a function has timed out, the rest of
that function's calls in the batch are not run (scored as timeouts). A function whose every call
timed out in `disable_after` batches in a row is disabled: it is not called again and drops out
of the weighted sum, with a message saying so.
"""

from __future__ import annotations

import logging
import multiprocessing as mp
import pickle
import signal
import sys
import threading
import time
import traceback
import weakref
from collections import deque
from dataclasses import dataclass, field
from multiprocessing import resource_tracker
from multiprocessing.connection import Connection, wait
from typing import Sequence

from slipstream.rewards.registry import (
    BUILTIN_REWARDS, FILE_MODULE_PREFIX, REWARDS, CombinedReward, RewardSpec, to_score,
)  # fmt: skip

logger = logging.getLogger(__name__)

_STARTUP_TIMEOUT_S = 120.0  # spawn + imports of user reward modules; generous for slow filesystems
_LOG_COMPLETION_CHARS = 200
# Calls queued per worker: the worker goes on to the next call without a round trip to the
# parent, which matters when a reward takes microseconds and the pipe latency does not.
_MAX_INFLIGHT = 8

Item = tuple[str, "str | None", str]  # (completion, answer, prompt)
Call = tuple[int, int]  # (item index, function index)


class RewardError(RuntimeError):
    """A reward raised or timed out while the runner was configured with on_error="raise", or every
    reward function has been disabled."""


def _worker_main(conn: Connection, specs: list[tuple[RewardSpec, float]], names: list[str]) -> None:
    """Worker loop: resolve the rewards once, then run lists of (task_id, fn index, item) until None.

    One reply per call (not per list), so the parent can time each call separately.
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
        for task_id, fn_index, (completion, answer, prompt) in tasks:
            name = reward.names[fn_index]
            try:
                score, extra = to_score(reward.fns[fn_index](completion, answer, prompt), name)
                reply = (task_id, "ok", score, extra)
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
    """(task_id, call) sent and not yet answered, in the order the worker runs them."""
    deadline: float = 0.0
    """When the head of `inflight` times out."""


@dataclass
class _Outcome:
    """What one call gave: a score (and extra info), or an error / timeout message."""

    kind: str  # "ok" | "error" | "timeout"
    score: float = 0.0
    extra: dict = field(default_factory=dict)
    message: str = ""
    traceback: str | None = None


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

    num_workers=0 runs the calls inline in this process: exceptions are still caught, but
    `timeout_s` is NOT enforced (a hanging reward hangs the caller). With num_workers>0 each call
    has `timeout_s` seconds once a worker has started it; an overrun is killed and scored
    `error_score`, and the function's other calls in that batch are not run. Any failing function
    scores the whole completion `error_score`. Rewards given as callables must be picklable
    (module-level); rewards from a file are given as "path/file.py:function" so that each worker
    imports the file itself.

    Failures are summarised in one log line per `score` call (with the first message) and marked
    in each completion's info: `info["error"]` (the first message) and `info["failures"]`
    ({function name: "error" | "timeout"}), which the trainer turns into per-function metrics.
    """

    def __init__(
        self,
        specs_with_weights: Sequence[tuple[RewardSpec, float]] | RewardSpec,
        num_workers: int = 0,
        timeout_s: float = 10.0,
        on_error: str = "zero",
        error_score: float = 0.0,
        disable_after: int = 3,
    ):
        if isinstance(specs_with_weights, str) or callable(specs_with_weights):
            specs_with_weights = [(specs_with_weights, 1.0)]
        if on_error not in ("zero", "raise"):
            raise ValueError(f"on_error must be 'zero' or 'raise', got {on_error!r}")
        if not isinstance(num_workers, int) or num_workers < 0:
            raise ValueError(f"num_workers must be an integer >= 0, got {num_workers!r}")
        if not timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        if not isinstance(disable_after, int) or disable_after < 0:
            raise ValueError(f"disable_after must be an integer >= 0, got {disable_after!r}")
        # Resolving here validates every spec (unknown names, bad imports) before any worker starts.
        self._reward = CombinedReward(list(specs_with_weights))
        self.names = list(self._reward.names)
        self.num_workers = num_workers
        self.timeout_s = float(timeout_s)
        self.on_error = on_error
        self.error_score = float(error_score)
        self.disable_after = disable_after
        self.disabled: set[str] = set()
        """Functions no longer called (they timed out on every call in `disable_after` batches in a row)."""
        self._timeout_streak = dict.fromkeys(self.names, 0)
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
        # SIGINT stays blocked while the child is created: the mask is inherited across exec, so a
        # Ctrl-C sent to the process group while the worker imports its modules cannot reach it
        # (it prints no traceback). The mask is per thread and another thread of this process may
        # take the signal, so the handler is deferred too: a Ctrl-C during start() interrupts this
        # process once start() has returned and the worker is one of its children (killable).
        # multiprocessing's resource tracker starts with the first spawned process, and its start ends
        # with SIG_UNBLOCK of SIGINT in this thread: started inside the window below, it would open the
        # window before the worker is created (a Ctrl-C then reached the worker during interpreter
        # start-up: "Fatal Python error: init_import_site ... KeyboardInterrupt"). Start it first.
        resource_tracker.ensure_running()
        deferred: list[int] = []
        main_thread = threading.current_thread() is threading.main_thread()
        previous = signal.signal(signal.SIGINT, lambda signum, _frame: deferred.append(signum)) if main_thread else None
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
        try:
            process.start()
        finally:
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)
            if main_thread and previous is not None:  # None: a handler installed from C, left in place
                signal.signal(signal.SIGINT, previous)
            # Close our copy of the child's end so that a dead worker shows up as EOF on parent_conn.
            child_conn.close()
        worker = _Worker(process=process, conn=parent_conn, started_at=time.monotonic())
        if deferred:  # the Ctrl-C, now, through whatever handler is back in place; the worker is not leaked
            try:
                signal.raise_signal(signal.SIGINT)
            except BaseException:
                process.kill()
                process.join(timeout=1.0)
                parent_conn.close()
                raise
        return worker

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
        items = list(items)
        active = [f for f, name in enumerate(self.names) if name not in self.disabled]
        calls = [(i, f) for i in range(len(items)) for f in active]
        if self.num_workers == 0:
            outcomes = {call: self._call_inline(items[call[0]], call[1]) for call in calls}
        else:
            outcomes = self._run_parallel(items, calls)
        results = [self._combine(i, active, outcomes) for i in range(len(items))]
        self._summarise(items, active, outcomes)
        return results

    def _call_inline(self, item: Item, fn_index: int) -> _Outcome:
        name = self.names[fn_index]
        try:
            score, extra = to_score(self._reward.fns[fn_index](*item), name)
            return _Outcome("ok", score, extra)
        except Exception as e:  # noqa: BLE001 - reward failures are data, not crashes
            outcome = _Outcome("error", message=f"{type(e).__name__}: {e}", traceback=traceback.format_exc())
        if self.on_error == "raise":
            raise self._raise_error(item, name, outcome)
        return outcome

    def _raise_error(self, item: Item, name: str, outcome: _Outcome) -> RewardError:
        return RewardError(f"reward {name} failed: {outcome.message} (completion: {_shown(item[0])!r})")

    def _combine(self, index: int, active: list[int], outcomes: dict[Call, _Outcome]) -> tuple[float, dict]:
        """The weighted total and info of one item; any failing function makes it `error_score`."""
        total, info, failures, first = 0.0, {}, {}, None
        for f in active:
            name, outcome = self.names[f], outcomes[(index, f)]
            if outcome.kind == "ok":
                total += self._reward.weights[f] * outcome.score
                info[name] = outcome.score
                info.update({f"{name}/{k}": v for k, v in outcome.extra.items()})
            else:
                failures[name] = outcome.kind
                first = first or f"{name}: {outcome.message}"
        if failures:
            return self.error_score, {**info, "error": first, "failures": failures}
        return total, info

    def _summarise(self, items: list[Item], active: list[int], outcomes: dict[Call, _Outcome]) -> None:
        """One log line for the batch's failures; disable functions that timed out on every call for
        `disable_after` batches in a row."""
        parts, first = [], None
        for f in active:
            name = self.names[f]
            mine = [(i, outcomes[(i, f)]) for i in range(len(items))]
            errors = [(i, o) for i, o in mine if o.kind == "error"]
            timeouts = [(i, o) for i, o in mine if o.kind == "timeout"]
            if errors:
                parts.append(f"{name} raised on {len(errors)}/{len(items)}")
            if timeouts:
                parts.append(f"{name} timed out on {len(timeouts)}/{len(items)}")
            failed = errors or timeouts
            if failed and first is None:
                i, outcome = failed[0]
                first = (name, outcome, items[i][0])
            all_timed_out = bool(items) and len(timeouts) == len(items)
            self._timeout_streak[name] = self._timeout_streak[name] + 1 if all_timed_out else 0
        if first is not None:
            name, outcome, completion = first
            logger.warning("rewards of %d completions: %s, scored %s (first: %s: %s; completion: %r)",
                           len(items), ", ".join(parts), self.error_score, name, outcome.message, _shown(completion))
            if outcome.traceback:
                logger.debug("reward traceback:\n%s", outcome.traceback)
        for name, streak in self._timeout_streak.items():
            if self.disable_after and streak >= self.disable_after and name not in self.disabled:
                self.disabled.add(name)
                left = [n for n in self.names if n not in self.disabled]
                logger.error(
                    "reward %s timed out on every call for %d batches (steps) in a row: disabled, it is not called "
                    "again (%s); check it, or raise reward.timeout_s (%gs) or reward.disable_after", name, streak,
                    f"the run goes on scored by {', '.join(left)}" if left else "no reward function is left",
                    self.timeout_s,
                )  # fmt: skip
        if len(self.disabled) == len(self.names):
            raise RewardError(
                f"every reward function is disabled ({', '.join(self.names)} timed out on every call for "
                f"{self.disable_after} batches in a row): nothing is left to score the run with"
            )

    def _run_parallel(self, items: list[Item], calls: list[Call]) -> dict[Call, _Outcome]:
        outcomes: dict[Call, _Outcome] = {}
        pending = deque(calls)
        hung: set[int] = set()  # functions that timed out in this batch: their other calls are not run
        first_error: RewardError | None = None

        def settle(call: Call, outcome: _Outcome) -> None:
            nonlocal first_error
            outcomes[call] = outcome
            if outcome.kind != "ok" and self.on_error == "raise" and first_error is None:
                # Stop handing out work, but let in-flight calls finish so the workers are
                # idle (and their pipes empty) before raising.
                first_error = self._raise_error(items[call[0]], self.names[call[1]], outcome)
                pending.clear()

        def drop_worker(w: _Worker, outcome: _Outcome) -> None:
            # The head call is the one the worker was stuck on; the rest were never started.
            if w.inflight:
                _, call = w.inflight.popleft()
                if first_error is None:
                    pending.extendleft(reversed([c for _, c in w.inflight]))
                settle(call, outcome)
            self._replace_worker(w)

        while pending or any(w.inflight for w in self._workers):
            idle = [w for w in self._workers if w.ready and len(w.inflight) <= _MAX_INFLIGHT // 2]
            for n, w in enumerate(idle):
                # Split what is left evenly over the idle workers, a few calls at a time.
                share = -(-len(pending) // (len(idle) - n))
                tasks = []
                while pending and len(tasks) < min(share, _MAX_INFLIGHT - len(w.inflight)):
                    call = pending.popleft()
                    if call[1] in hung:
                        settle(call, _Outcome("timeout", message="not run: timed out earlier in this batch"))
                        continue
                    self._task_counter += 1
                    tasks.append((self._task_counter, call[1], items[call[0]]))
                    w.inflight.append((self._task_counter, call))
                if tasks:
                    if len(w.inflight) == len(tasks):
                        w.deadline = time.monotonic() + self.timeout_s
                    try:
                        w.conn.send(tasks)
                    except OSError:  # died since its last reply; the head call is charged for it
                        drop_worker(w, _died(w))
            # Sleep until a message arrives or the earliest deadline passes.
            deadlines = [w.deadline for w in self._workers if w.inflight]
            deadlines += [w.started_at + _STARTUP_TIMEOUT_S for w in self._workers if not w.ready]
            if not deadlines:  # what was left was settled without running (calls of a function that timed out)
                continue
            wait([w.conn for w in self._workers], timeout=max(0.0, min(deadlines) - time.monotonic()))
            for w in list(self._workers):
                while w.conn.poll():
                    try:
                        msg = w.conn.recv()
                    except (EOFError, OSError):
                        # The worker died (os._exit, segfault, OOM kill): score its call, replace it.
                        if not w.ready:
                            self.close()
                            raise RuntimeError(f"reward worker died at start-up (exit code {w.process.exitcode})")
                        drop_worker(w, _died(w))
                        break
                    if msg[0] == "ready":
                        w.ready = True
                    elif msg[0] == "init_error":
                        self.close()
                        raise RuntimeError(f"reward worker failed to load the rewards: {msg[1]}\n{msg[2]}")
                    else:
                        task_id, call = w.inflight.popleft()
                        assert msg[0] == task_id, "reply does not match the task sent"
                        # The worker starts on its next queued call as soon as it replies.
                        w.deadline = time.monotonic() + self.timeout_s
                        if msg[1] == "ok":
                            settle(call, _Outcome("ok", msg[2], msg[3]))
                        else:
                            settle(call, _Outcome("error", message=msg[2], traceback=msg[3]))
            now = time.monotonic()
            for w in list(self._workers):
                if w.inflight and now >= w.deadline:
                    hung.add(w.inflight[0][1][1])
                    drop_worker(w, _Outcome("timeout", message=f"timeout after {self.timeout_s:g}s"))
                elif w.inflight and w.inflight[0][1][1] in hung:  # started before its function timed out
                    drop_worker(w, _Outcome("timeout", message="stopped: timed out earlier in this batch"))
                elif not w.ready and now >= w.started_at + _STARTUP_TIMEOUT_S:
                    self.close()
                    raise RuntimeError(f"reward worker did not start within {_STARTUP_TIMEOUT_S:g}s")
        if first_error is not None:
            raise first_error
        assert len(outcomes) == len(calls)
        return outcomes

    # -----------------------------------------------------------------------------------------

    def close(self) -> None:
        """Stop the worker processes (idempotent)."""
        self._finalizer()

    def __enter__(self) -> "RewardRunner":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def _died(worker: _Worker) -> _Outcome:
    return _Outcome("error", message=f"reward worker died (exit code {worker.process.exitcode})")


def _shown(completion: str) -> str:
    return completion[:_LOG_COMPLETION_CHARS] + ("..." if len(completion) > _LOG_COMPLETION_CHARS else "")
