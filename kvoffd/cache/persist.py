"""Warm restart: the index's mirror in the pool file, and adoption of a previous daemon's blocks.

``Persistence`` is an ``IndexObserver`` (kvoffd/cache/observer.py: it overrides the moments below; the
index's ``evicted`` and ``cleared`` need nothing more here, since their slots' ``freeing`` follows) of
a pool that lives in a file (kvoffd/cache/pool_file.py), keeping its slot records
(kvoffd/cache/slots_table.py) true:

* **committed** blocks are queued for sealing. A sealer thread computes each slot's crc32 off the
  event loop (zlib releases the GIL on large buffers: stores are never slowed by it) and hands the
  sums back to the loop, which writes the records of the blocks still alive. A block committed but
  not yet sealed when the process dies is simply not adopted (absent, never wrong); on SIGTERM what
  is left is sealed within ``SEAL_ON_STOP_S``.
* **freeing** slots have their records invalidated before the pool may hand them out again, and
  **unlinked** ones (CLEARed or found corrupt while a LOAD or lease holds them) at once.
* blocks read by a LOAD are **touched**: their last-use stamps are rewritten every ``FLUSH_S``
  (batched, on the loop), so the next daemon rebuilds the LRU order.

``adopt`` (at start, before the daemon serves) checks the sealed records and takes their slots in
the pool (kvoffd/cache/adopt.py); once serving, the blocks enter the index a slice per loop turn,
newest first (``_adopt_slice``), and a LOOKUP that misses a block still waiting takes it into the
index at once (``adopt_asked``), so the first hit comes as soon as the daemon serves whatever the pool
holds; a CLEAR meanwhile drops its namespace's blocks still waiting (``cleared``). Their bytes are verified
lazily: the first LOAD of an adopted block checks its crc32 first (the ``--verify`` machinery of
kvoffd/server/verify.py), and a background pass checks the rest, each slice as it enters the index;
a mismatch drops that block only (a counted miss). The end of that pass is "full adoption"
(``stats()['verified_s']``).

The namespace facts also keep each namespace's KV-event identity (``note_identity``, told at every
REGISTER, whether or not this daemon publishes events): so a daemon that adopts the blocks can
announce them to routers at start (``take_adopted``, kvoffd/events/announce.py), before any engine
registers again, rather than leaving the stream blind until one does (an engine may never come back:
a node restarted with new engine processes, or one that now starts later than the daemon). Routers
learn a restarted node's blocks as soon as its daemon is back, and the announcement does not depend on
which engine registers first. The identity is the REGISTER's own word, so it cannot be wrong for blocks
stored under it; when an engine later registers with another one (a changed
``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``), the file takes the new one and the next events use it.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import time
import weakref
import zlib
from collections import OrderedDict, deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from kvoffd.cache.adopt import AdoptionPlan, plan_adoption
from kvoffd.cache.index import Entry, Index, IndexObserver, Table
from kvoffd.cache.pool import Pool
from kvoffd.cache.pool_file import ALLOCATE_THREADS, PoolFile
from kvoffd.cache.slots_table import MAX_NAMESPACE_IDS, NamespaceFacts, NamespaceTable, RankFacts, SlotRecords
from kvoffd.events.wire import EventIdentity
from kvoffd.pool_format import NS_AREA_BYTES
from kvoffd.shards import bind_thread_near

log = logging.getLogger(__name__)

SEAL_ON_STOP_S = 5.0  # SIGTERM: sealing what is left may take this long (docker stop waits 10 s)
FLUSH_S = 1.0  # touched stamps and the header's "updated" are written this often
VERIFY_SLICE = 64  # adopted blocks checked per background task
# The background pass is crc32-bound (2-3 GB/s a thread on the H200 host): on 8 threads a 64 GiB pool
# took 3.9-4.6 s, the long pole of a restart's full adoption. It ends by itself, so it may take every
# core but two (the loop, and the pinning's registrar): 16 at most.
VERIFY_THREADS = max(1, min(16, len(os.sched_getaffinity(0)) - 2))
ADOPT_SLICE = 2048  # adopted blocks put into the index per loop turn (~8 ms on the 2-core VM)


def _crc(buf: np.ndarray, e: Entry) -> int:
    return zlib.crc32(buf[e.slot:e.slot + e.table.slot_bytes])


class Persistence(IndexObserver):
    """The pool file's keeper (one per daemon; only when the pool lives in a file)."""

    def __init__(self, pf: PoolFile, pool: Pool, index: Index, verify_threads: int = 0):
        self.pf, self.pool, self.index = pf, pool, index
        lay = pf.layout
        words = np.frombuffer(pf.map, dtype=np.uint64, count=lay.num_records * 8, offset=lay.records_offset)
        chunks = np.frombuffer(pf.map, dtype=np.uint64, count=lay.num_chunks, offset=lay.chunks_offset)
        self.records = SlotRecords(words.reshape(-1, 8), chunks, lay)
        self.namespaces = NamespaceTable(memoryview(pf.map)[lay.ns_offset:lay.ns_offset + 2 * NS_AREA_BYTES])
        self._ids: weakref.WeakKeyDictionary[Table, int] = weakref.WeakKeyDictionary()
        self.unverified: set[Entry] = set()
        self._adopted: list[Entry] | None = []  # slices indexed before ``take_adopted`` (None after it)
        self.on_adopted: Callable[[list[Entry]], None] | None = None  # each slice after (the KV events)
        self._events: OrderedDict[str, EventIdentity | None] = OrderedDict()  # REGISTER's layout.kv_events
        self._queue: deque[list[Entry]] = deque()
        self._cond = threading.Condition()
        self._stopping = False
        self._busy = False
        self._thread: threading.Thread | None = None
        self._verify = ThreadPoolExecutor(verify_threads or VERIFY_THREADS,
                                          thread_name_prefix="kvoffd-verify")
        self._touched: list[Entry] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self.adopted = 0
        self.adopted_bytes = 0
        self.adopted_from = 0.0  # when the previous daemon last stamped the pool
        self.adopt_s = 0.0  # checking the records and taking their slots, before serving
        self.indexed_s = 0.0  # from start until the last adopted block is in the index
        self._plan: AdoptionPlan | None = None  # adopted blocks not yet in the index
        self.adopted_on_demand = 0  # of them, those a LOOKUP asked for before their slice (adopt_asked)
        # KVOFFD_TEST_NO_VERIFY_PASS: no background pass, so a test sees the first LOAD check a block
        self._no_verify_pass = bool(os.environ.get("KVOFFD_TEST_NO_VERIFY_PASS"))
        # KVOFFD_TEST_NO_ADOPTION_SLICES: adopted blocks enter the index only when a LOOKUP asks for them
        # (the gate that holds a restarted daemon mid-indexing for as long as a test needs)
        self._no_slices = bool(os.environ.get("KVOFFD_TEST_NO_ADOPTION_SLICES"))
        self.verified_s = 0.0  # from start to the end of the background pass
        self.verify_failures = 0
        self.sealed = 0
        self.unsealed_at_stop = 0
        self._t0 = time.monotonic()
        self._stop_allocating = threading.Event()
        self._allocator: threading.Thread | None = None
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
        self.namespaces.load()
        t0 = time.monotonic()
        try:
            plan = plan_adoption(self.records.scan(), self.namespaces.by_id, self.pool, self.index)
        except (ValueError, KeyError) as e:  # a bug or a damaged table: cold, not a crash loop
            log.error("pool file %s: cannot adopt its blocks (%s); starting cold", self.pf.path, e)
            self.records.words[:, 0] = 0
            self.records.chunks[:] = 0
            self.namespaces.keep_only(set())
            return
        for t, i in plan.table_ids.items():
            self._ids[t] = i
        self.namespaces.keep_only(set(plan.table_ids.values()))
        self.records.invalidate(plan.dropped_records)
        self._plan = plan if plan.total else None
        self.adopted = plan.total
        self.adopted_bytes = plan.total_bytes
        self.adopt_s = time.monotonic() - t0
        log.info("pool file %s: adopting %d blocks (%.1f MiB) of %d namespaces (checked in %.3f s; in the index "
                 "newest first, a slice per loop turn), written until %s by pid %d; %d records not adopted%s",
                 self.pf.path, self.adopted, self.adopted_bytes / (1 << 20), len(set(plan.table_ids.values())),
                 self.adopt_s, time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(prev.updated)), prev.pid,
                 plan.not_adopted, f" ({plan.why})" if plan.why else "")

    def _adopt_slice(self) -> None:
        """One slice of the adopted blocks into the index (newest first), their verification queued; then
        the next slice at the next loop turn, so requests are served in between."""
        plan = self._plan
        if plan is None or self._stopping:
            return
        self._indexed(*plan.take(self.index, self.pool, ADOPT_SLICE))
        if plan.left:
            self._loop.call_soon(self._adopt_slice)
            return
        self._plan = None
        self.indexed_s = time.monotonic() - self._t0
        log.info("adopted blocks all in the index %.2f s after start", self.indexed_s)
        self._maybe_verified()

    def adopt_asked(self, namespace: str, keys: bytes) -> bool:
        """A LOOKUP missed ``keys`` (of ``namespace``) while adoption is still indexing: those of them
        whose slice is not in yet enter the index now. True if any did (the caller looks up again)."""
        plan = self._plan
        if plan is None or self._stopping:
            return False
        records = plan.asked(namespace, keys)
        if not len(records):
            return False
        self._indexed(*plan.take_records(self.index, self.pool, records))
        self.adopted_on_demand += len(records)
        return True

    def _indexed(self, entries: list[Entry], gone: np.ndarray) -> None:
        """Adopted blocks just entered the index: their verification queued, the KV events told."""
        self.records.invalidate(gone)
        self.unverified.update(entries)
        if self.on_adopted is not None:
            self.on_adopted(entries)
        elif self._adopted is not None:
            self._adopted += entries
        if entries and not self._no_verify_pass:
            for i in range(0, len(entries), VERIFY_SLICE):
                part = entries[i:i + VERIFY_SLICE]
                fut = self._verify.submit(self._recompute, part)
                fut.add_done_callback(lambda f, part=part: self._post_future(self._verified, part, f))

    def take_adopted(self) -> tuple[list[Entry], dict[str, EventIdentity]]:
        """The adopted entries in the index so far (once: the caller keeps them from here; the later
        slices go to ``on_adopted``, if set) and the KV-event identities the file kept for their
        namespaces (the table holds only adopted namespaces until the first REGISTER: ``adopt`` kept
        those alone; no pass over the entries, which may be millions)."""
        entries, self._adopted = self._adopted or [], None
        return entries, {f.name: f.events for f in self.namespaces.by_id.values() if f.events is not None}

    def note_identity(self, namespace: str, ident: EventIdentity | None) -> None:
        """REGISTER's ``layout.kv_events`` for ``namespace`` (None: absent): kept with its facts."""
        self.namespaces.set_events(namespace, ident)
        self._events[namespace] = ident  # for facts made later (at the namespace's first seal)
        self._events.move_to_end(namespace)
        while len(self._events) > MAX_NAMESPACE_IDS:
            self._events.popitem(last=False)

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        """The sealer thread, the background verification of adopted blocks, the periodic flush."""
        self._loop = loop
        self._thread = threading.Thread(target=self._seal_work, name="kvoffd-seal", daemon=True)
        self._thread.start()
        if self.pf.allocated < self.pool.nbytes:
            provisioned = self.pool.provisioned

            def progress(n: int) -> None:
                provisioned.advance(n)  # the pinning threads may touch it now
                try:
                    loop.call_soon_threadsafe(self.pool.set_allocated_bytes, n)  # stores may use it now
                except RuntimeError:
                    pass

            def near(offset: int) -> None:
                bind_thread_near(self.pool.shards, self.pool.chunk_bytes, offset)

            def allocate() -> None:
                try:
                    self.pf.allocate(progress, self._stop_allocating, near, threads=ALLOCATE_THREADS)
                finally:
                    provisioned.end()

            self._allocator = threading.Thread(target=allocate, name="kvoffd-allocate", daemon=True)
            self._allocator.start()
        if self._plan is not None and not self._no_slices:  # once serving (a lookup takes what it asks at once)
            loop.call_soon(self._adopt_slice)
        elif not self.unverified:
            self.verified_s = time.monotonic() - self._t0
        self._timer = loop.call_later(FLUSH_S, self._flush)

    # --- the observer ------------------------------------------------------------------------------------
    def committed(self, entries: Sequence[Entry]) -> None:
        with self._cond:
            self._queue.append(list(entries))
            self._cond.notify()

    def freeing(self, slot_bytes: int, entries: Sequence[Entry]) -> None:
        if self.unverified:
            for e in entries:
                self.unverified.discard(e)
        slots = np.fromiter((e.slot for e in entries), dtype=np.int64, count=len(entries))
        idx = self.records.index_of(slots, slot_bytes)
        self.records.invalidate(idx[idx >= 0])

    def cleared(self, namespace: str) -> None:
        """A CLEAR of ``namespace``: its adopted blocks not yet in the index go too (slots and records)."""
        if self._plan is not None:
            keep = {t for t in self._plan.tables.values() if t.namespace != namespace}
            self.records.invalidate(self._plan.forget(self.pool, keep))

    def unlinked(self, entries: Sequence[Entry]) -> None:
        """CLEARed (or found corrupt) while pinned: the record goes now, so a crash before the pin
        drops cannot bring the block back."""
        self.freeing(entries[0].table.slot_bytes, entries)

    def touched(self, entries: Sequence[Entry]) -> None:
        """Read by a LOAD: their stamps move at the next flush."""
        self._touched += entries

    # --- lazy verification ---------------------------------------------------------------------------------
    def must_check(self, entries: Sequence[Entry]) -> bool:
        u = self.unverified
        return bool(u) and any(e in u for e in entries)

    def corrupt(self, entries: Sequence[Entry]) -> list[int]:
        """Positions of the adopted, unverified ``entries`` whose bytes fail their checksum. Runs in an
        executor (the entries are pinned by their LOAD: their slots cannot change meanwhile)."""
        buf, u = self.pool.buffer, self.unverified
        return [j for j, e in enumerate(entries) if e in u and _crc(buf, e) != e.checksum]

    def checked(self, entries: Sequence[Entry]) -> None:
        """Back on the loop after ``corrupt``: these need no more checking."""
        for e in entries:
            self.unverified.discard(e)
        self._maybe_verified()

    def _verified(self, part: list[Entry], sums: list[int]) -> None:
        for e, c in zip(part, sums, strict=True):
            if e not in self.unverified:
                continue  # loaded (and checked) or freed meanwhile
            self.unverified.discard(e)
            if c != e.checksum and not e.dead:
                self.verify_failures += 1
                log.error("adopted block of namespace %s rank %d at slot %d fails its checksum; dropped",
                          e.table.namespace, e.table.rank, e.slot)
                self.index.discard(e)
        self._maybe_verified()

    def _maybe_verified(self) -> None:
        if not self.unverified and not self.verified_s and self.adopted and self._plan is None:
            self.verified_s = time.monotonic() - self._t0
            log.info("adopted blocks verified %.2f s after start (%d failed their checksum)", self.verified_s,
                     self.verify_failures)

    def _recompute(self, entries: list[Entry]) -> list[int]:
        buf = self.pool.buffer
        return [-1 if e.dead else _crc(buf, e) for e in entries]

    # --- sealing --------------------------------------------------------------------------------------------
    def _sums(self, entries: list[Entry]) -> list[int]:
        buf = self.pool.buffer
        return [e.checksum if e.checksum >= 0 else -1 if e.dead else _crc(buf, e) for e in entries]

    def _seal_work(self) -> None:
        while True:
            with self._cond:
                while not self._queue and not self._stopping:
                    self._cond.wait()
                if not self._queue:
                    return
                batch = self._queue.popleft()
                self._busy = True
            sums = self._sums(batch)
            self._post(self._write_sealed, batch, sums)
            with self._cond:
                self._busy = False
                self._cond.notify_all()

    def _post_future(self, fn: Callable[[list[Entry], list[int]], None], part: list[Entry], fut: Future) -> None:
        if fut.cancelled():
            return
        try:
            sums = fut.result()
        except Exception:  # a bug: those blocks stay unverified (checked by their first LOAD)
            log.exception("checksum task failed")
            return
        self._post(fn, part, sums)

    def _post(self, fn: Callable[[list[Entry], list[int]], None], part: list[Entry], result: list[int]) -> None:
        """Hand a thread's result to the loop (dropped if the loop is gone: the records stay unwritten)."""
        try:
            self._loop.call_soon_threadsafe(fn, part, result)
        except RuntimeError:
            pass

    def _write_sealed(self, batch: list[Entry], sums: list[int]) -> None:
        by_table: dict[Table, list[tuple[Entry, int]]] = {}
        for e, c in zip(batch, sums, strict=True):
            if not e.dead and c >= 0:
                by_table.setdefault(e.table, []).append((e, c))
        for t, got in by_table.items():
            ns_id = self._ns_id(t)
            if ns_id is None:
                continue
            slots = np.fromiter((e.slot for e, _ in got), dtype=np.int64, count=len(got))
            idx = self.records.index_of(slots, t.slot_bytes)
            keep = idx >= 0
            mine = [g for g, k in zip(got, keep.tolist(), strict=True) if k]
            if not mine:
                continue
            for e, c in mine:
                e.checksum = c
            self.records.seal(idx[keep], ns_id, t.rank, b"".join(e.key for e, _ in mine),
                              np.fromiter((e.stored_at for e, _ in mine), dtype=np.float64, count=len(mine)),
                              np.fromiter((c for _, c in mine), dtype=np.int64, count=len(mine)), t.slot_bytes)
            self.sealed += len(mine)

    def _ns_id(self, t: Table) -> int | None:
        got = self._ids.get(t)
        if got is None:
            ns = self.index.namespaces.get(t.namespace)
            if ns is None or ns.tables.get(t.rank) is not t:
                return None
            facts = NamespaceFacts(t.namespace, ns.world_size, {t.rank: RankFacts(t.slot_bytes, ns.layouts[t.rank])},
                                   ns.replicas, self._events.get(t.namespace))
            got = self.namespaces.id_for(facts)
            if got is not None:
                self._ids[t] = got
        return got

    # --- periodic and stop ---------------------------------------------------------------------------------
    def _flush(self) -> None:
        self._flush_touches()
        self.pf.write_header()
        if self._loop is not None and not self._stopping:
            self._timer = self._loop.call_later(FLUSH_S, self._flush)

    def _flush_touches(self) -> None:
        touched, self._touched = self._touched, []
        by_size: dict[int, set[int]] = {}
        for e in touched:
            if not e.dead:
                by_size.setdefault(e.table.slot_bytes, set()).add(e.slot)
        now = time.time()
        for size, slots in by_size.items():
            idx = self.records.index_of(np.fromiter(slots, dtype=np.int64, count=len(slots)), size)
            self.records.touch(idx[idx >= 0], now)

    async def close(self) -> None:
        """SIGTERM: seal what is queued (at most ``SEAL_ON_STOP_S``), write the last stamps, unlock."""
        loop = asyncio.get_running_loop()
        if self._timer is not None:
            self._timer.cancel()

        def drain() -> int:
            deadline = time.monotonic() + SEAL_ON_STOP_S
            with self._cond:
                while (self._queue or self._busy) and time.monotonic() < deadline:
                    self._cond.wait(0.05)
                left = sum(len(b) for b in self._queue)
                self._queue.clear()
                self._stopping = True
                self._cond.notify_all()
            return left

        self.unsealed_at_stop = await loop.run_in_executor(None, drain)
        self._stop_allocating.set()
        if self._allocator is not None:
            await loop.run_in_executor(None, self._allocator.join)
        await asyncio.sleep(0)  # the sealer's last results, posted to this loop
        self._verify.shutdown(wait=False, cancel_futures=True)
        self._flush_touches()
        self.pf.write_header()
        self.pf.close()
        log.info("pool file %s kept: %d blocks sealed, %d left unsealed (not adopted by the next daemon)",
                 self.pf.path, self.sealed, self.unsealed_at_stop)

    def stats(self) -> dict:
        return {"path": self.pf.path, "adopted_blocks": self.adopted, "adopted_bytes": self.adopted_bytes,
                "adopted_from": self.adopted_from, "adopt_s": round(self.adopt_s, 6),
                "indexed_s": round(self.indexed_s, 6), "indexing_blocks": self._plan.waiting if self._plan else 0,
                "adopted_on_demand": self.adopted_on_demand,
                "verified_s": round(self.verified_s, 6), "unverified_blocks": len(self.unverified),
                "verify_failures": self.verify_failures, "sealed_blocks": self.sealed,
                "unsealed_blocks": sum(len(b) for b in self._queue)}
