"""The checksums of committed blocks, computed on threads behind the stores.

A block's record is committed when its copy completes (kvoffd/cache/restart/mirror.py); its checksum is filled
in later, by ``Sealer``: the blocks of each commit are cut into tasks of ``TASK_BYTES`` and summed on the
checksum threads (kvoffd/cache/checksum.py: numpy releases the GIL, so the threads run in parallel),
each task's sums handed back to the loop, which fills in the records of the blocks still alive. Stores
never wait for it; what it lags by is the **backlog**: blocks committed whose checksum is not in their
record yet, counted from the commit until the sums are back on the loop (in the queue, on a thread, or
posted: every state in between, so a backlog of 0 means every record has its checksum).

Why the backlog is bounded: a block is in it at most once, from its commit until its sums land or it
is freed (``forget``, from the keeper's ``freeing``: its record is gone, its task skips it without
reading it), so it never holds more than the pool's resident blocks (nothing is copied: the queued
tasks hold references), and it costs no durability: a block in the backlog is adopted after a crash all the same, without a
checksum (docs/architecture.md, "Crash consistency"). What it costs is the window during which a stray
write into such a block could not be detected; ``stats`` shows it (blocks, bytes, the oldest's age) in
STATS, ``kvoffctl status`` and ``kvoffd_seal_backlog_*``.

``KVOFFD_TEST_HOLD_SEALING`` (tests only): ``until_stop`` holds every task back until the daemon stops
(SIGTERM then seals them), ``always`` for good (SIGTERM leaves them committed without a checksum): the
explicit gate a test holds the checksum work back with while STOREs are acknowledged.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future

import numpy as np

from kvoffd.cache.checksum import NONE, sums_at
from kvoffd.cache.entries import Entry

log = logging.getLogger(__name__)

TASK_BYTES = 64 << 20  # blocks summed per task: a 2 GiB commit is spread over 32 tasks, so over every thread
HOLD_ENV = "KVOFFD_TEST_HOLD_SEALING"

Deliver = Callable[[list[Entry], list[int]], None]


class Sealer:
    """Sums committed blocks on ``executor`` and hands them to ``deliver`` on the loop. Loop thread only,
    but for the tasks themselves."""

    def __init__(self, buffer: np.ndarray, executor: Executor, deliver: Deliver):
        self._buf = buffer
        self._executor = executor
        self._deliver = deliver
        self._loop: asyncio.AbstractEventLoop | None = None
        self._hold = os.environ.get(HOLD_ENV, "")  # "", "until_stop" or "always" (tests)
        self._held: deque[tuple[list[Entry], int]] = deque()  # tasks the gate holds back
        self._started: OrderedDict[int, float] = OrderedDict()  # task -> when, until its sums land
        self._pending: set[Entry] = set()  # the backlog: alive, committed, checksum not in the record yet
        self._next = 0
        self._empty: asyncio.Event | None = None
        self.bytes = 0  # of the backlog
        self.summed = 0  # blocks summed and handed back, in all

    @property
    def blocks(self) -> int:
        """The backlog's blocks: never more than the resident ones (a freed block leaves it at once)."""
        return len(self._pending)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._empty = asyncio.Event()
        self._empty.set()

    def submit(self, entries: Sequence[Entry]) -> None:
        """Queue the sums of ``entries`` (committed, their records written without a checksum)."""
        if not entries:
            return
        per = max(1, TASK_BYTES // max(1, entries[0].table.slot_bytes))
        for i in range(0, len(entries), per):
            part = list(entries[i:i + per])
            task = self._next
            self._next += 1
            self._started[task] = time.monotonic()
            self._pending.update(part)
            self.bytes += sum(e.table.slot_bytes for e in part)
            if self._empty is not None:
                self._empty.clear()
            if self._hold:
                self._held.append((part, task))
            else:
                self._run(part, task)

    def _run(self, part: list[Entry], task: int) -> None:
        try:
            fut = self._executor.submit(self._sums, part)
        except RuntimeError:  # the executor is shut down (the daemon is stopping): left without a checksum
            self._done(task)
            return
        fut.add_done_callback(lambda f: self._post(part, task, f))

    def _sums(self, part: list[Entry]) -> list[int]:
        """On a checksum thread: each block's checksum (NONE for a block freed meanwhile: the loop checks
        again before it writes anything, since a freed slot may hold another block by then), by runs of
        neighbouring slots (a few numpy calls per run, not per block)."""
        alive = [j for j, e in enumerate(part) if not e.dead]
        out = [NONE] * len(part)
        got = sums_at(self._buf, [part[j].slot for j in alive], [part[j].table.slot_bytes for j in alive])
        for j, c in zip(alive, got, strict=True):
            out[j] = c
        return out

    def _post(self, part: list[Entry], task: int, fut: Future) -> None:
        if fut.cancelled():
            sums = [NONE] * len(part)
        else:
            try:
                sums = fut.result()
            except Exception:  # a bug: those records stay without a checksum (adopted all the same)
                log.exception("checksum task failed")
                sums = [NONE] * len(part)
        try:
            self._loop.call_soon_threadsafe(self._landed, part, task, sums)
        except RuntimeError:  # the loop is gone (the process is ending): the records stay as they are
            pass

    def _landed(self, part: list[Entry], task: int, sums: list[int]) -> None:
        self.forget(part)
        self._done(task)
        self.summed += len(part)
        self._deliver(part, sums)

    def _done(self, task: int) -> None:
        self._started.pop(task)
        if not self._pending and self._empty is not None:
            self._empty.set()

    def forget(self, entries: Sequence[Entry]) -> None:
        """These leave the backlog (summed, or freed: a task skips a freed block without reading it)."""
        pending = self._pending
        if pending:
            for e in entries:
                if e in pending:
                    pending.discard(e)
                    self.bytes -= e.table.slot_bytes
            if not pending and self._empty is not None:
                self._empty.set()

    def oldest_s(self) -> float:
        """Age of the oldest task whose sums have not landed (0: none)."""
        for when in self._started.values():
            return time.monotonic() - when
        return 0.0

    async def drain(self, budget_s: float) -> int:
        """At stop: the backlog summed and delivered within ``budget_s`` (the held tasks too, unless the
        gate holds them for good). Returns the blocks left without a checksum."""
        if self._hold != "always":
            self._hold = ""
            while self._held:
                self._run(*self._held.popleft())
        if self.blocks and not self._held and self._empty is not None:
            try:
                await asyncio.wait_for(self._empty.wait(), budget_s)
            except asyncio.TimeoutError:
                pass
        return self.blocks

    def stats(self) -> dict:
        return {"seal_backlog_blocks": self.blocks, "seal_backlog_bytes": self.bytes,
                "seal_backlog_oldest_s": round(self.oldest_s(), 3), "summed_blocks": self.summed,
                "seal_held": bool(self._held)}
