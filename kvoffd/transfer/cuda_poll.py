"""The CUDA backend's job type and its poller thread.

One thread watches two kinds of CUDA event for every engine and GPU, with queries only (never a
blocking wait, never a device-side wait):

* *gates*: a job that must not start before an event of the engine's interprocess ring fired (the
  step's forward wrote its blocks). Gating on the host, not with ``cuStreamWaitEvent``, is what lets
  a dead engine's jobs fail instead of hanging the daemon's stream forever (docs/cuda.md).
* *completions*: the event recorded behind a job's last copy; once it fired, the job's future is
  resolved on its event loop.

Why a thread: uvloop's timers tick in milliseconds, so polling from the loop would add up to 1 ms per
job; a thread sleeping ``poll_s`` between sweeps that found nothing adds far less. The poller knows
nothing of streams, mappings or descriptors: it gets plain values (event handles, device ordinals,
deadlines) and calls back (``start`` a gated job, ``recycle`` a completion event), so it never
imports ``cuda.py``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

import numpy as np

from kvoffd.transfer import cuda_driver as cudart
from kvoffd.transfer.base import Direction, JobExpired, MappedMemory, Runs, past

log = logging.getLogger(__name__)


@dataclass(eq=False)
class CudaJob:
    """One ``submit``: which blocks move which way, by when it must have started, whom to answer."""

    direction: Direction
    mapped: MappedMemory  # a cuda.CudaMapping (named by its base here: this module never imports cuda.py)
    block_ids: np.ndarray
    slots: np.ndarray
    expires_ns: int  # CLOCK_MONOTONIC ns after which no part of the job may start; 0: none
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    runs: Runs  # which runs of each block move (the whole block, or one part of a job in parts)

    def expired(self) -> bool:
        return past(self.expires_ns)

    def resolve(self, err: BaseException | None = None) -> None:
        """Complete the job's future on its loop (from any thread); a no-op once it is done."""
        resolve(self.loop, self.future, err)


class Detachable(Protocol):
    """What owns a gated job (the engine's mapping): once ``closed``, its gates fail instead of starting."""

    closed: bool


@dataclass(eq=False)
class _Gate:
    job: CudaJob
    owner: Detachable
    event: int  # the engine's event (opened here) the job waits for
    device: int
    deadline: float  # time.monotonic(): fail the job, never start it, once past


@dataclass(eq=False)
class _Completion:
    job: CudaJob
    event: int  # recorded behind the job's last copy
    device: int
    error: BaseException | None  # the job failed, but only once what it enqueued is done


class Poller:
    """The thread that starts gated jobs and resolves finished ones.

    ``start(job)`` is called (on this thread) for a gated job whose event fired; it must put the job
    on its stream and check the job's deadline first. ``recycle(device, event)`` gets back a
    completion event that fired, for reuse. Sleeps on a condition while nothing is watched.
    """

    def __init__(self, *, poll_s: float, start: Callable[[CudaJob], None],
                 recycle: Callable[[int, int], None]):
        self.poll_s = poll_s
        self._start_job = start
        self._recycle = recycle
        self._gates: list[_Gate] = []
        self._completions: list[_Completion] = []
        self._cond = threading.Condition()
        self._stopping = False
        self._thread: threading.Thread | None = None
        self._current = -1  # the device made current on this thread last

    @property
    def lock(self) -> threading.Condition:
        """Held by every sweep while it takes its snapshot (a test holds it to freeze the poller)."""
        return self._cond

    def start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kvoffd-cuda-poll", daemon=True)
            self._thread.start()

    def stop(self, timeout: float = 5.0) -> None:
        """Fail the gated jobs ("the daemon is stopping"), let the ones on a stream finish, then end."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout)

    def gate(self, job: CudaJob, owner: Detachable, event: int, device: int, deadline: float) -> None:
        with self._cond:
            self._gates.append(_Gate(job, owner, event, device, deadline))
            self._cond.notify()

    def watch(self, job: CudaJob, event: int, device: int, error: BaseException | None) -> None:
        with self._cond:
            self._completions.append(_Completion(job, event, device, error))
            self._cond.notify()

    def cancel(self, owner: Detachable, error: BaseException) -> int:
        """Fail every gated job of ``owner`` (its engine is gone); returns how many."""
        with self._cond:
            dead = [g for g in self._gates if g.owner is owner]
            self._gates = [g for g in self._gates if g.owner is not owner]
        for g in dead:
            g.job.resolve(error)
        return len(dead)

    # --- the thread ---------------------------------------------------------------------------------
    def _run(self) -> None:
        drv = None
        while True:
            with self._cond:
                while not self._completions and not self._gates and not self._stopping:
                    self._cond.wait()
                if self._stopping and not self._completions:
                    gates, self._gates = self._gates, []
                    for g in gates:
                        g.job.resolve(RuntimeError("the daemon is stopping"))
                    return
                gates, completions = list(self._gates), list(self._completions)
            if drv is None:
                drv = cudart.driver()
            progressed = self._sweep_gates(drv, gates) if gates else False
            progressed = self._sweep_completions(drv, completions) or progressed
            if not progressed:
                time.sleep(self.poll_s)

    def _use(self, drv: cudart.Driver, device: int) -> None:
        if device != self._current:
            drv.use_device(device)
            self._current = device

    def _sweep_gates(self, drv: cudart.Driver, gates: list[_Gate]) -> bool:
        """Start the gated jobs whose event fired; fail those detached or past their deadline."""
        ready: list[_Gate] = []
        failed: list[tuple[_Gate, BaseException]] = []
        now = time.monotonic()
        for g in gates:
            try:
                self._use(drv, g.device)
                if g.owner.closed:
                    failed.append((g, RuntimeError("the engine was detached")))
                elif drv.event_query(g.event):
                    ready.append(g)
                elif now > g.deadline:
                    kind = JobExpired if g.job.expired() else TimeoutError
                    failed.append((g, kind("the engine's event did not fire before the job's deadline; not started")))
            except cudart.CudaError as e:
                failed.append((g, e))
        if not ready and not failed:
            return False
        gone = {id(g) for g in ready} | {id(g) for g, _ in failed}
        with self._cond:
            self._gates = [g for g in self._gates if id(g) not in gone]
        for g in ready:
            try:
                self._start_job(g.job)  # checks the deadline again: this sweep may have been frozen
            except Exception as e:  # noqa: BLE001 - the job fails, never the poller (every job would hang)
                log.exception("starting a gated job")
                g.job.resolve(e)
            self._current = -1  # start() may have made another device current on this thread
        for g, err in failed:
            g.job.resolve(err)
        return True

    def _sweep_completions(self, drv: cudart.Driver, completions: list[_Completion]) -> bool:
        """Resolve the jobs whose completion event fired (with their error, if they failed)."""
        finished: list[tuple[_Completion, BaseException | None]] = []
        for c in completions:
            try:
                self._use(drv, c.device)
                if drv.event_query(c.event):
                    finished.append((c, None))
            except cudart.CudaError as e:
                finished.append((c, e))
        if not finished:
            return False
        gone = {id(c) for c, _ in finished}
        with self._cond:
            self._completions = [c for c in self._completions if id(c) not in gone]
        for c, err in finished:
            if err is None:
                self._recycle(c.device, c.event)
            c.job.resolve(err or c.error)
        return True


def resolve(loop: asyncio.AbstractEventLoop, fut: asyncio.Future, err: BaseException | None) -> None:
    """Complete ``fut`` on ``loop`` from any thread; nothing if it is done or the loop is closed."""
    def done() -> None:
        if fut.done():
            return
        if err is None:
            fut.set_result(None)
        else:
            fut.set_exception(err)

    try:
        if _in_loop(loop):
            done()
        else:
            loop.call_soon_threadsafe(done)
    except RuntimeError:  # the loop is closed (daemon stopping)
        pass


def _in_loop(loop: asyncio.AbstractEventLoop) -> bool:
    try:
        return asyncio.get_running_loop() is loop
    except RuntimeError:
        return False
