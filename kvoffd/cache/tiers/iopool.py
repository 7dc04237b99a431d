"""Threads that run a tier's blocking I/O, reads before writes, results delivered on the event loop.

Why threads and not io_uring: ``os.preadv``/``os.pwritev`` release the GIL for the whole system call,
so a few threads keep an NVMe queue busy at large block sizes (bench/disk_tier.py measures it against
``dd``), and they need nothing outside the standard library. Why a priority queue: a promotion is on
the critical path of a request (its LOAD waits for it), a spill is not; when the disk is busy the
queued reads overtake the queued writes.
"""

from __future__ import annotations

import asyncio
import itertools
import logging
import queue
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)

READ, WRITE = 0, 1  # priorities: lower first


class IoPool:
    def __init__(self, threads: int, name: str):
        self._q: queue.PriorityQueue = queue.PriorityQueue()
        self._seq = itertools.count()
        self._threads = [threading.Thread(target=self._run, name=f"{name}-{i}", daemon=True) for i in range(threads)]
        self._loop: asyncio.AbstractEventLoop | None = None
        self.queued_writes = 0  # write tasks queued or running (the loop thread reads it)
        self._lock = threading.Lock()
        self.write_gate: threading.Event | None = None  # tests: writes wait for it (a deterministic "slow disk")

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        for t in self._threads:
            t.start()

    def submit(self, prio: int, fn: Callable[[], Any], done: Callable[[Any], None]) -> None:
        """Run ``fn()`` on a thread; ``done(result)`` runs on the loop (``result`` may be the exception
        ``fn`` raised: ``fn`` should catch its own errors, this is the last guard)."""
        if prio == WRITE:
            with self._lock:
                self.queued_writes += 1
        self._q.put((prio, next(self._seq), fn, done))

    def _run(self) -> None:
        while True:
            prio, _, fn, done = self._q.get()
            if fn is None:
                return
            gate = self.write_gate
            if prio == WRITE and gate is not None:
                gate.wait()
            try:
                res = fn()
            except Exception as e:  # a bug in a task: reported to its caller as a failure, never fatal
                log.exception("tier I/O task failed")
                res = e
            if prio == WRITE:
                with self._lock:
                    self.queued_writes -= 1
            loop = self._loop
            if loop is not None and not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(done, res)
                except RuntimeError:  # the loop closed meanwhile (shutdown)
                    pass

    def close(self) -> None:
        """Let queued work finish (spills of a clean shutdown), then stop the threads."""
        for _ in self._threads:
            self._q.put((2, next(self._seq), None, None))
        for t in self._threads:
            if t.is_alive():
                t.join(timeout=30)
