"""The lazy verification of adopted blocks: what a warm restart took over is checked after it serves.

An adopted block enters the index unverified (``track``). Two paths check it, whichever comes first:
its first LOAD (``must_check`` → ``corrupt`` in an executor → ``checked``: the ``--verify`` machinery of
kvoffd/server/verify.py), and a background pass (``queue``: ``VERIFY_SLICE`` blocks per task on the
checksum threads, each result back on the loop in ``_verified``). A mismatch drops that block only (a
counted miss, ``failures``). A block freed meanwhile leaves the set at its ``freeing`` (``forget``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Executor, Future

import numpy as np

from kvoffd.cache.checksum import LEGACY_CRC32, matches, sums_at
from kvoffd.cache.index import Entry, Index

log = logging.getLogger(__name__)

VERIFY_SLICE = 64  # adopted blocks checked per background task
#: tests only: no background pass, so a test sees the first LOAD check a block
NO_PASS_ENV = "KVOFFD_TEST_NO_VERIFY_PASS"

Checked = Callable[[list[Entry], list[int]], None]


def _intact(buf: np.ndarray, e: Entry) -> bool:
    return matches(buf[e.slot:e.slot + e.table.slot_bytes], e.checksum)


class AdoptedChecks:
    """The adopted blocks not verified yet, and the work that verifies them. Loop thread only, but for
    ``corrupt`` and ``_recompute`` (an executor's threads; the entries they read are held meanwhile).
    ``settled`` is called whenever the set may have emptied (the keeper decides whether that is the end
    of the pass)."""

    def __init__(self, buffer: np.ndarray, index: Index, executor: Executor, settled: Callable[[], None]):
        self._buf = buffer
        self._index = index
        self._executor = executor
        self._settled = settled
        self._loop: asyncio.AbstractEventLoop | None = None
        self._background = not os.environ.get(NO_PASS_ENV)
        self.unverified: set[Entry] = set()
        self.failures = 0
        self.verified_s = 0.0  # from the keeper's start to the end of the background pass

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop

    def track(self, entries: Sequence[Entry]) -> None:
        """Adopted blocks with a checksum just entered the index: unverified until checked."""
        self.unverified.update(entries)

    def queue(self, entries: list[Entry]) -> None:
        """The background pass over ``entries`` (already tracked), a task per ``VERIFY_SLICE``."""
        if not self._background:
            return
        for i in range(0, len(entries), VERIFY_SLICE):
            part = entries[i:i + VERIFY_SLICE]
            fut = self._executor.submit(self._recompute, part)
            fut.add_done_callback(lambda f, part=part: self._post_future(part, f))

    def forget(self, entries: Sequence[Entry]) -> None:
        """Their slots are being freed: nothing left to verify."""
        if self.unverified:
            for e in entries:
                self.unverified.discard(e)

    def must_check(self, entries: Sequence[Entry]) -> bool:
        u = self.unverified
        return bool(u) and any(e in u for e in entries)

    def corrupt(self, entries: Sequence[Entry]) -> list[int]:
        """Positions of the adopted, unverified ``entries`` whose bytes fail their checksum. Runs in an
        executor (the entries are held by their LOAD: their slots cannot change meanwhile)."""
        buf, u = self._buf, self.unverified
        return [j for j, e in enumerate(entries) if e in u and not _intact(buf, e)]

    @staticmethod
    def intact(data: memoryview, want: int) -> bool:
        """Whether an adopted block's bytes, wherever they are now (its deferred slot, a spill's staging
        copy), still match ``want``, the checksum it was adopted with: ``corrupt``'s test, for a block
        leaving the pool unverified (kvoffd/cache/tiers/manager.py: it is spilled only if so)."""
        return matches(data, want)

    def checked(self, entries: Sequence[Entry]) -> None:
        """Back on the loop after ``corrupt``: these need no more checking."""
        for e in entries:
            self.unverified.discard(e)
        self._settled()

    def _verified(self, part: list[Entry], intact: list[int]) -> None:
        for e, ok in zip(part, intact, strict=True):
            if e not in self.unverified:
                continue  # loaded (and checked) or freed meanwhile
            self.unverified.discard(e)
            if ok == 0 and not e.dead:
                self.failures += 1
                log.error("adopted block of namespace %s rank %d at slot %d fails its checksum; dropped",
                          e.table.namespace, e.table.rank, e.slot)
                self._index.discard(e)
        self._settled()

    def settle(self, t0: float, quiet: bool = False) -> None:
        """The pass is over (nothing left to verify, every adopted block in the index): its time, once
        (``quiet``: at start, where nothing was adopted or no slice runs, without the log line)."""
        if not self.unverified and not self.verified_s:
            self.verified_s = time.monotonic() - t0
            if quiet:
                return
            log.info("adopted blocks verified %.2f s after start (%d failed their checksum)", self.verified_s,
                     self.failures)

    def _recompute(self, entries: list[Entry]) -> list[int]:
        """On a checksum thread: 1 for each block whose bytes still match its checksum, 0 for one that
        does not, -1 for one freed meanwhile (this daemon's checksums by runs of neighbouring slots; an
        older daemon's crc32 one by one)."""
        buf = self._buf
        out = [-1] * len(entries)
        ours = [j for j, e in enumerate(entries) if not e.dead and 0 <= e.checksum < LEGACY_CRC32]
        sums = sums_at(buf, [entries[j].slot for j in ours], [entries[j].table.slot_bytes for j in ours])
        for j, c in zip(ours, sums, strict=True):
            out[j] = int(c == entries[j].checksum)
        for j, e in enumerate(entries):
            if not e.dead and e.checksum >= LEGACY_CRC32:
                out[j] = int(_intact(buf, e))
        return out

    def _post_future(self, part: list[Entry], fut: Future) -> None:
        """A task's result to the loop (dropped if the loop is gone); a task that raised is a bug: its
        blocks stay unverified (checked by their first LOAD)."""
        if fut.cancelled():
            return
        try:
            result = fut.result()
        except Exception:
            log.exception("checksum task failed")
            return
        try:
            self._loop.call_soon_threadsafe(self._verified, part, result)
        except RuntimeError:
            pass
