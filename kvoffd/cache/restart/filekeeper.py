"""Warm restart: the keeper of a pool that lives in a file (kvoffd/pool/file.py).

``FileKeeper`` is an ``IndexObserver`` (kvoffd/cache/observer.py: it overrides the moments below; an
evicted block's slot is one more ``freeing``) and composes the parts of a warm restart, each owning
its state:

* ``RecordMirror`` (kvoffd/cache/restart/mirror.py): the slot records and namespace facts
  (kvoffd/cache/restart/records.py) kept true from the index's moments, the checksums behind the
  stores (kvoffd/cache/restart/sealing.py) and the last-use stamps, flushed every ``FLUSH_S``;
* ``AdoptedSlices`` (kvoffd/cache/restart/slices.py): a previous daemon's blocks entering the index
  once the daemon serves, a slice per loop turn, or at once when a LOOKUP asks for them;
* ``AdoptedChecks`` (kvoffd/cache/restart/verifier.py): their bytes verified lazily, by their first
  LOAD or a background pass; the end of that pass is "full adoption" (``stats()['verified_s']``). A
  block adopted without a checksum has nothing to be checked against: it is summed instead, and its
  record filled in, so that the next restart can check it;
* ``Allocation``: the file's data allocated on threads while the daemon serves.

``adopt`` (at start, before the daemon serves) checks the sealed records and takes their slots in the
pool (kvoffd/cache/restart/plan.py). Unlinked blocks (CLEARed or found corrupt while a LOAD or a lease
holds them) lose their records at once. The keeper's figures are STATS' ``persistence`` section.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

import numpy as np

from kvoffd.cache.checksum import NONE
from kvoffd.cache.identity import EventIdentity
from kvoffd.cache.index import Entry, Index, IndexObserver
from kvoffd.cache.restart.mirror import RecordMirror
from kvoffd.cache.restart.plan import plan_adoption
from kvoffd.cache.restart.slices import AdoptedSlices
from kvoffd.cache.restart.verifier import AdoptedChecks
from kvoffd.pool.allocator import Pool
from kvoffd.pool.file import ALLOCATE_THREADS, PoolFile
from kvoffd.pool.shards import bind_thread_near

log = logging.getLogger(__name__)

# SIGTERM: summing what is left may take this long (docker stop waits 10 s); what is left after it is
# kept all the same, without a checksum
SEAL_ON_STOP_S = 5.0
FLUSH_S = 1.0  # touched stamps and the header's "updated" are written this often
# The checksum threads: the sums behind the stores (kvoffd/cache/restart/sealing.py) and the background pass
# of a restart. Both are bound by memory bandwidth past a few threads (bench/checksum.py); they may
# take every core but two (the loop, and the copies' or the pinning's threads): 16 at most.
CHECKSUM_THREADS = max(1, min(16, len(os.sched_getaffinity(0)) - 2))
CHECKSUM_NICE = 10  # how far the checksum threads stand back (they only lag: nothing waits for them)


def _background() -> None:
    """A checksum thread yields its core to the loop and to the copies (a CPU engine's copies run on
    threads too): it is niced, which any thread may do to itself."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), CHECKSUM_NICE)
    except OSError:
        pass


class Allocation:
    """The pool file's data allocated on a thread while the daemon serves (stores use each part as it
    lands); stopped at SIGTERM."""

    def __init__(self, pf: PoolFile, pool: Pool):
        self._pf = pf
        self._pool = pool
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        if self._pf.allocated >= self._pool.nbytes:
            return
        pool = self._pool
        provisioned = pool.provisioned

        def progress(n: int) -> None:
            provisioned.advance(n)  # the pinning threads may touch it from here
            try:
                loop.call_soon_threadsafe(pool.set_allocated_bytes, n)  # stores may use it from here
            except RuntimeError:
                pass

        def near(offset: int) -> None:
            bind_thread_near(pool.shards, pool.chunk_bytes, offset)

        def allocate() -> None:
            try:
                self._pf.allocate(progress, self._stop, near, threads=ALLOCATE_THREADS)
            finally:
                provisioned.end()

        self._thread = threading.Thread(target=allocate, name="kvoffd-allocate", daemon=True)
        self._thread.start()

    def halt(self) -> None:
        self._stop.set()

    async def join(self) -> None:
        if self._thread is not None:
            await asyncio.get_running_loop().run_in_executor(None, self._thread.join)


class FileKeeper(IndexObserver):
    """The pool file's keeper (one per daemon; only when the pool lives in a file)."""

    def __init__(self, pf: PoolFile, pool: Pool, index: Index, verify_threads: int = 0):
        self.pf, self.pool, self.index = pf, pool, index
        self._t0 = time.monotonic()
        self._checks = ThreadPoolExecutor(verify_threads or CHECKSUM_THREADS, thread_name_prefix="kvoffd-sum",
                                          initializer=_background)
        self.mirror = RecordMirror(pf, pool.buffer, index, self._checks)
        self.checks = AdoptedChecks(pool.buffer, index, self._checks, self._settled)
        self.slices = AdoptedSlices(pool, index, self._indexed, self._settled, self._t0)
        self._allocation = Allocation(pf, pool)
        self._adopted: list[Entry] | None = []  # slices indexed before ``take_adopted`` (None after it)
        self.on_adopted: Callable[[list[Entry]], None] | None = None  # each slice after (the KV events)
        self._stopping = False
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.adopted_from = 0.0  # when the previous daemon last stamped the pool
        self.adopt_s = 0.0  # checking the records and taking their slots, before serving
        self.adopted_unchecked = 0  # adopted without a checksum (summed since, not checked)
        self.unsealed_at_stop = 0
        pool.set_allocated_bytes(pf.allocated)

    # --- start ------------------------------------------------------------------------------------------
    def adopt(self) -> None:
        """Take over the previous daemon's blocks (none if the file was made new). Never raises for
        a damaged file: what cannot be trusted is not adopted, with one log line."""
        prev = self.pf.previous
        self.pf.write_header()
        if prev is None:
            return
        self.adopted_from = prev.updated
        mirror = self.mirror
        mirror.namespaces.load()
        t0 = time.monotonic()
        try:
            plan = plan_adoption(mirror.records.scan(), mirror.namespaces.by_id, self.pool, self.index)
        except (ValueError, KeyError) as e:  # a bug or a damaged file: cold, not a crash loop
            log.error("pool file %s: cannot adopt its blocks (%s); starting cold", self.pf.path, e)
            mirror.wipe()
            return
        mirror.keep(plan)
        self.slices.begin(plan)
        self.adopt_s = time.monotonic() - t0
        log.info("pool file %s: adopting %d blocks (%.1f MiB) of %d namespaces (checked in %.3f s; in the index "
                 "newest first, a slice per loop turn), written until %s by pid %d; %d records not adopted%s",
                 self.pf.path, self.slices.adopted, self.slices.adopted_bytes / (1 << 20),
                 len(set(plan.table_ids.values())), self.adopt_s,
                 time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(prev.updated)), prev.pid,
                 plan.not_adopted, f" ({plan.why})" if plan.why else "")

    def adopt_asked(self, namespace: str, keys: bytes) -> bool:
        """A LOOKUP missed ``keys`` while adoption is still indexing (``AdoptedSlices.asked``)."""
        return self.slices.asked(namespace, keys)

    def _indexed(self, entries: list[Entry], gone: np.ndarray) -> None:
        """Adopted blocks just entered the index: their verification queued (or, for those adopted
        without a checksum, their sums: nothing to check them against), the KV events told."""
        self.mirror.records.invalidate(gone)
        checked = [e for e in entries if e.checksum != NONE]
        if len(checked) < len(entries):
            unchecked = [e for e in entries if e.checksum == NONE]
            self.adopted_unchecked += len(unchecked)
            self.mirror.sealer.submit(unchecked)
        self.checks.track(checked)
        if self.on_adopted is not None:
            self.on_adopted(entries)
        elif self._adopted is not None:
            self._adopted += entries
        if checked:
            self.checks.queue(checked)

    def _settled(self) -> None:
        """Full adoption is reached once every adopted block is in the index and verified."""
        if self.slices.adopted and not self.slices.pending:
            self.checks.settle(self._t0)

    def take_adopted(self) -> tuple[list[Entry], dict[str, EventIdentity]]:
        """The adopted entries in the index so far (once: the caller keeps them from here; the later
        slices go to ``on_adopted``, if set) and the KV-event identities the file kept for their
        namespaces (no pass over the entries, which may be millions)."""
        entries, self._adopted = self._adopted or [], None
        return entries, self.mirror.identities()

    def note_identity(self, namespace: str, ident: EventIdentity | None) -> None:
        self.mirror.note_identity(namespace, ident)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """The checksums behind the stores, the file's allocation, the adopted blocks' slices and
        background verification, the periodic flush."""
        self._loop = loop
        self.mirror.sealer.start(loop)
        self.checks.start(loop)
        self._allocation.start(loop)
        if not self.slices.start(loop):  # once serving (a lookup takes what it asks at once)
            self.checks.settle(self._t0, quiet=True)
        self._timer = loop.call_later(FLUSH_S, self._flush)

    # --- the observer ------------------------------------------------------------------------------------
    def committed(self, entries: Sequence[Entry]) -> None:
        self.mirror.committed(entries)

    def freeing(self, slot_bytes: int, entries: Sequence[Entry]) -> None:
        self.checks.forget(entries)
        self.mirror.freeing(slot_bytes, entries)

    def cleared(self, namespace: str) -> None:
        """A CLEAR of ``namespace``: its adopted blocks not yet in the index go too (slots and records)."""
        if self.slices.pending:
            self.mirror.records.invalidate(self.slices.forget(namespace))

    def unlinked(self, entries: Sequence[Entry]) -> None:
        """CLEARed (or found corrupt) while held: the record goes at once, so a crash before the last ref
        drops cannot bring the block back."""
        self.freeing(entries[0].table.slot_bytes, entries)

    def touched(self, entries: Sequence[Entry]) -> None:
        """Read by a LOAD: their stamps move at the next flush."""
        self.mirror.touched(entries)

    # --- lazy verification (``AdoptedChecks``) -------------------------------------------------------------
    @property
    def unverified(self) -> set[Entry]:
        return self.checks.unverified

    def must_check(self, entries: Sequence[Entry]) -> bool:
        return self.checks.must_check(entries)

    def corrupt(self, entries: Sequence[Entry]) -> list[int]:
        return self.checks.corrupt(entries)

    intact = staticmethod(AdoptedChecks.intact)

    def checked(self, entries: Sequence[Entry]) -> None:
        self.checks.checked(entries)

    # --- periodic and stop ---------------------------------------------------------------------------------
    def _flush(self) -> None:
        self.mirror.flush_touches()
        self.pf.write_header()
        if self._loop is not None and not self._stopping:
            self._timer = self._loop.call_later(FLUSH_S, self._flush)

    async def close(self) -> None:
        """SIGTERM: sum what is left (at most ``SEAL_ON_STOP_S``), write the last stamps, unlock. Every
        committed block is kept whatever is left: its record is there, without a checksum."""
        if self._timer is not None:
            self._timer.cancel()
        self._allocation.halt()
        self.unsealed_at_stop = await self.mirror.sealer.drain(SEAL_ON_STOP_S)
        self._stopping = True
        self.slices.stop()
        await self._allocation.join()
        self._checks.shutdown(wait=False, cancel_futures=True)
        self.mirror.flush_touches()
        self.pf.write_header()
        held = self.mirror.records.scan()  # what the next daemon will find: the file's records, not this process's
        n_unsummed = int((held.crc == NONE).sum())
        self.pf.close()
        log.info("pool file %s kept: %d blocks for the next daemon to adopt, %d of them without their checksum "
                 "yet (adopted all the same); this process committed %d and summed %d", self.pf.path,
                 len(held.record), n_unsummed, self.mirror.committed_records, self.mirror.sealed)

    def stats(self) -> dict:
        s, c, m = self.slices, self.checks, self.mirror
        return {"path": self.pf.path, "adopted_blocks": s.adopted, "adopted_bytes": s.adopted_bytes,
                "adopted_from": self.adopted_from, "adopt_s": round(self.adopt_s, 6),
                "indexed_s": round(s.indexed_s, 6), "indexing_blocks": s.waiting,
                "adopted_on_demand": s.adopted_on_demand,
                "verified_s": round(c.verified_s, 6), "unverified_blocks": len(c.unverified),
                "verify_failures": c.failures, "committed_blocks": m.committed_records,
                "sealed_blocks": m.sealed, "unsealed_blocks": m.sealer.blocks,
                "adopted_unchecked": self.adopted_unchecked, **m.sealer.stats()}
