"""Checksums on the data path (kvoffd/cache/checksum.py): ``--verify`` (every STORE's slots summed, every
LOAD's checked) and the first LOAD of a block adopted at a warm restart (checked once,
kvoffd/cache/restart/persistence.py). A LOAD that
checks first copies only once its sums passed; a corrupt block is unlinked and reported failed
(``checksum_mismatch``), the rest are copied.

``LoadVerify`` is a base of ``Jobs``: it uses the jobs' ``pool``, ``persist``, ``verify``, ``index`` and
``metrics``. The sums run in an executor (numpy releases the GIL).
"""

from __future__ import annotations

import asyncio
import logging
from typing import TYPE_CHECKING

import numpy as np

from kvoffd.cache.checksum import NONE, block_sum, matches
from kvoffd.cache.index import Entry, Index
from kvoffd.server.job import Job
from kvoffd.transfer.base import Direction, JobExpired, past
from kvoffd_client.protocol import NoticeCode

if TYPE_CHECKING:
    from kvoffd.cache.restart.keeper import Keeper
    from kvoffd.metrics import Metrics
    from kvoffd.pool.allocator import Pool

log = logging.getLogger(__name__)


class LoadVerify:
    pool: Pool
    persist: Keeper
    verify: bool
    index: Index
    metrics: Metrics

    async def _verified_load(self, job: Job) -> tuple[list[int], str, str, int]:
        """Check the slots' checksums (in an executor: every slot with --verify, else the adopted ones not
        checked yet), unlink and report the corrupt ones, copy the rest. Returns (failed, code, text,
        blocks copied)."""
        eng, msg, entries = job.engine, job.msg, job.entries
        failed, code, text = job.failed, job.code, ""
        ids, slots = job.block_ids, job.slots
        bad = await asyncio.get_running_loop().run_in_executor(None, self._corrupt, entries)
        self.persist.checked(entries)
        if bad:
            log.error("engine %s: %d blocks failed their checksum; reporting them failed", eng.engine_id, len(bad))
            self.metrics.checksum_failures.inc(len(bad))
            for j in bad:
                self.index.discard(entries[j])
            failed = sorted(failed + [job.idx[j] for j in bad])
            code, text = NoticeCode.CHECKSUM_MISMATCH.value, f"{len(bad)} blocks corrupt in the pool"
            keep = np.ones(len(entries), dtype=bool)
            keep[bad] = False
            ids, slots = ids[keep], slots[keep]
        if past(msg.expires_ns):  # checksums took too long
            raise JobExpired("deadline passed before the copy could start")
        if len(ids):
            await eng.backend.submit(Direction.LOAD, eng.mapped, ids, slots, msg.event, msg.expires_ns)
        return failed, code, text, len(ids)

    def _checksums(self, entries: list[Entry]) -> list[int]:
        """The checksum of each slot (--verify; kvoffd/cache/checksum.py, the one the pool file's records
        hold). Runs in an executor: numpy releases the GIL."""
        buf = self.pool.buffer
        return [block_sum(buf[e.slot:e.slot + e.table.slot_bytes]) for e in entries]

    def _corrupt(self, entries: list[Entry]) -> list[int]:
        """Positions of the entries whose bytes fail their checksum (in an executor): all of them with
        --verify (but a block adopted without one, which has nothing to be checked against), else the
        adopted ones not checked yet."""
        if not self.verify:
            return self.persist.corrupt(entries)
        buf = self.pool.buffer
        return [j for j, e in enumerate(entries)
                if e.checksum != NONE and not matches(buf[e.slot:e.slot + e.table.slot_bytes], e.checksum)]
