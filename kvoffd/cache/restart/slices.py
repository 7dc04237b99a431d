"""The adopted blocks on their way into the index, once the daemon serves (kvoffd/cache/restart/plan.py).

Before serving, the keeper checks the records and takes their slots (``begin`` gets that plan); once
serving, the blocks enter the index a slice per loop turn, newest first (``_next_slice``), and a LOOKUP
that misses a block still waiting takes it into the index at once (``asked``), so the first hit comes as
soon as the daemon serves, whatever the pool holds. A CLEAR meanwhile drops its namespace's blocks still
waiting (``forget``). Each batch that entered goes to ``indexed`` (the keeper's: verification, sums,
KV events); the end of the slices goes to ``done``.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Callable

import numpy as np

from kvoffd.cache.index import Entry, Index
from kvoffd.cache.restart.plan import AdoptionPlan
from kvoffd.pool.allocator import Pool

log = logging.getLogger(__name__)

ADOPT_SLICE = 2048  # adopted blocks put into the index per loop turn (a few ms of the loop each)
#: tests only: adopted blocks enter the index only when a LOOKUP asks for them (the gate that holds a
#: restarted daemon mid-indexing for as long as a test needs)
NO_SLICES_ENV = "KVOFFD_TEST_NO_ADOPTION_SLICES"

Indexed = Callable[[list[Entry], np.ndarray], None]


class AdoptedSlices:
    """The plan of the blocks adopted but not yet in the index, and what it took (loop thread only)."""

    def __init__(self, pool: Pool, index: Index, indexed: Indexed, done: Callable[[], None], t0: float):
        self._pool = pool
        self._index = index
        self._indexed = indexed
        self._done = done
        self._t0 = t0
        self._loop: asyncio.AbstractEventLoop | None = None
        self._plan: AdoptionPlan | None = None
        self._stopping = False
        self._slices = not os.environ.get(NO_SLICES_ENV)
        self.adopted = 0
        self.adopted_bytes = 0
        self.adopted_on_demand = 0  # of them, those a LOOKUP asked for before their slice (``asked``)
        self.indexed_s = 0.0  # from start until the last adopted block is in the index

    @property
    def waiting(self) -> int:
        """Adopted blocks not yet in the index."""
        return self._plan.waiting if self._plan else 0

    @property
    def pending(self) -> bool:
        """Whether some adopted blocks have not entered the index (nor been dropped) yet."""
        return self._plan is not None

    def begin(self, plan: AdoptionPlan) -> None:
        self._plan = plan if plan.total else None
        self.adopted = plan.total
        self.adopted_bytes = plan.total_bytes

    def start(self, loop: asyncio.AbstractEventLoop) -> bool:
        """The slices begin at the next loop turn; False if none will run."""
        self._loop = loop
        if self._plan is None or not self._slices:
            return False
        loop.call_soon(self._next_slice)
        return True

    def stop(self) -> None:
        self._stopping = True

    def _next_slice(self) -> None:
        """One slice of the adopted blocks into the index (newest first); then the next slice at the next
        loop turn, so requests are served in between."""
        plan = self._plan
        if plan is None or self._stopping:
            return
        self._indexed(*plan.take(self._index, self._pool, ADOPT_SLICE))
        if plan.left:
            self._loop.call_soon(self._next_slice)
            return
        self._plan = None
        self.indexed_s = time.monotonic() - self._t0
        log.info("adopted blocks all in the index %.2f s after start", self.indexed_s)
        self._done()

    def asked(self, namespace: str, keys: bytes) -> bool:
        """A LOOKUP missed ``keys`` (of ``namespace``) while adoption is still indexing: those of them
        whose slice is not in yet enter the index at once. True if any did (the caller looks up again)."""
        plan = self._plan
        if plan is None or self._stopping:
            return False
        records = plan.asked(namespace, keys)
        if not len(records):
            return False
        self._indexed(*plan.take_records(self._index, self._pool, records))
        self.adopted_on_demand += len(records)
        return True

    def forget(self, namespace: str) -> np.ndarray:
        """A CLEAR of ``namespace``: its blocks still waiting go (their slots freed); returns their records."""
        if self._plan is None:
            return np.zeros(0, dtype=np.int64)
        keep = {t for t in self._plan.tables.values() if t.namespace != namespace}
        return self._plan.forget(self._pool, keep)
