"""Checksums on the data path: ``--verify`` (every STORE's slots summed, every LOAD's checked) and the
first LOAD of a block adopted at a warm restart (checked once, kvoffd/cache/restart/filekeeper.py). A
LOAD that checks first copies only once its sums passed; a corrupt block leaves the pool and is
reported failed (``checksum_mismatch``), the rest are copied.

``Verifier`` is held by ``Jobs`` (kvoffd/server/jobs.py); the sums themselves are the keyspace's
(``Keyspace.corrupt``, kvoffd/cache/checksum.py) and run in an executor (numpy releases the GIL).
"""

from __future__ import annotations

import asyncio
import logging

import numpy as np

from kvoffd.cache.keyspace import Keyspace
from kvoffd.metrics import Metrics
from kvoffd.server.job import Job
from kvoffd.transfer.base import Direction, JobExpired, past
from kvoffd_client.protocol import NoticeCode

log = logging.getLogger(__name__)


class Verifier:
    """The LOADs that check their blocks' sums before their copy (``Keyspace.checks_first``)."""

    def __init__(self, keyspace: Keyspace, metrics: Metrics) -> None:
        self.keyspace = keyspace
        self.metrics = metrics

    async def load(self, job: Job) -> tuple[list[int], str, str, int]:
        """Check the slots' checksums (in an executor: every slot with --verify, else the adopted ones not
        checked yet), drop and report the corrupt ones, copy the rest. Returns (failed, code, text,
        blocks copied)."""
        eng, msg, entries = job.engine, job.msg, job.entries
        failed, code, text = job.failed, job.code, ""
        ids, slots = job.block_ids, job.slots
        bad = await asyncio.get_running_loop().run_in_executor(None, self.keyspace.corrupt, entries)
        self.keyspace.checked(entries, bad)  # the corrupt ones leave the pool
        if bad:
            log.error("engine %s: %d blocks failed their checksum; reporting them failed", eng.engine_id, len(bad))
            self.metrics.checksum_failures.inc(len(bad))
            failed = sorted(failed + [job.idx[j] for j in bad])
            code, text = NoticeCode.CHECKSUM_MISMATCH.value, f"{len(bad)} blocks corrupt in the pool"
            keep = np.ones(len(entries), dtype=bool)
            keep[bad] = False
            ids, slots = ids[keep], slots[keep]
        if past(msg.expires_ns):  # checksums took too long
            raise JobExpired("deadline passed before the copy could start")
        if len(ids):
            await eng.backend.submit(Direction.LOAD, eng.mapped, ids, slots, msg.ready_event, msg.expires_ns)
        return failed, code, text, len(ids)
