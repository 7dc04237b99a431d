"""Warm restart: the index's mirror in the pool file, and adoption of a previous daemon's blocks.

``Persistence`` is an ``IndexObserver`` (kvoffd/cache/observer.py: it overrides the moments below; the
index's ``evicted`` and ``cleared`` need nothing more here, since their slots' ``freeing`` follows) of
a pool that lives in a file (kvoffd/pool/file.py), keeping its slot records
(kvoffd/cache/restart/records.py) true:

* **committed** blocks get their records at once, on the loop, in the callback that made them visible
  (after their copy completed): COMMITTED, without a checksum, so a block whose STORE was acknowledged
  is adopted after any crash of the daemon. Their checksums follow behind (kvoffd/cache/restart/sealing.py: on
  ``CHECKSUM_THREADS`` threads, kvoffd/cache/checksum.py's sum) and are filled into the records of the
  blocks still alive; on SIGTERM what is left is summed within ``SEAL_ON_STOP_S``, and what is still
  left then is adopted without a checksum (docs/architecture.md, "Crash consistency", says why that is
  sound).
* **freeing** slots have their records invalidated before the pool may hand them out again, and
  **unlinked** ones (CLEARed or found corrupt while a LOAD or lease holds them) at once.
* blocks read by a LOAD are **touched**: their last-use stamps are rewritten every ``FLUSH_S``
  (batched, on the loop), so the next daemon rebuilds the LRU order.

``adopt`` (at start, before the daemon serves) checks the sealed records and takes their slots in
the pool (kvoffd/cache/restart/plan.py); once serving, the blocks enter the index a slice per loop turn,
newest first (``_adopt_slice``), and a LOOKUP that misses a block still waiting takes it into the
index at once (``adopt_asked``), so the first hit comes as soon as the daemon serves whatever the pool
holds; a CLEAR meanwhile drops its namespace's blocks still waiting (``cleared``). Their bytes are verified
lazily: the first LOAD of an adopted block checks its checksum first (the ``--verify`` machinery of
kvoffd/server/verify.py), and a background pass checks the rest, each slice as it enters the index;
a mismatch drops that block only (a counted miss). The end of that pass is "full adoption"
(``stats()['verified_s']``). A block adopted without a checksum has nothing to be checked against: it
is summed instead, and its record filled in, so that the next restart can check it.

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
from collections import OrderedDict
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from kvoffd.cache.checksum import LEGACY_CRC32, NONE, matches, sums_at
from kvoffd.cache.identity import EventIdentity
from kvoffd.cache.index import Entry, Index, IndexObserver, Table
from kvoffd.cache.restart.plan import AdoptionPlan, plan_adoption
from kvoffd.cache.restart.records import (
    MAX_NAMESPACE_IDS,
    NamespaceFacts,
    NamespaceTable,
    RankFacts,
    SlotRecords,
)
from kvoffd.cache.restart.sealing import Sealer
from kvoffd.pool.allocator import Pool
from kvoffd.pool.file import ALLOCATE_THREADS, PoolFile
from kvoffd.pool.format import NS_AREA_BYTES
from kvoffd.pool.shards import bind_thread_near

log = logging.getLogger(__name__)

# SIGTERM: summing what is left may take this long (docker stop waits 10 s); what is left after it is
# kept all the same, without a checksum
SEAL_ON_STOP_S = 5.0
FLUSH_S = 1.0  # touched stamps and the header's "updated" are written this often
VERIFY_SLICE = 64  # adopted blocks checked per background task
# The checksum threads: the sums behind the stores (kvoffd/cache/restart/sealing.py) and the background pass
# of a restart. Both are bound by memory bandwidth past a few threads (bench/checksum.py); they may
# take every core but two (the loop, and the copies' or the pinning's threads): 16 at most.
CHECKSUM_THREADS = max(1, min(16, len(os.sched_getaffinity(0)) - 2))
CHECKSUM_NICE = 10  # how far the checksum threads stand back (they only lag: nothing waits for them)
ADOPT_SLICE = 2048  # adopted blocks put into the index per loop turn (~8 ms on the 2-core VM)


def _background() -> None:
    """A checksum thread yields its core to the loop and to the copies (a CPU engine's copies run on
    threads too): it is niced, which any thread may do to itself."""
    try:
        os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), CHECKSUM_NICE)
    except OSError:
        pass


def _intact(buf: np.ndarray, e: Entry) -> bool:
    return matches(buf[e.slot:e.slot + e.table.slot_bytes], e.checksum)


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
        self._stopping = False
        self._checks = ThreadPoolExecutor(verify_threads or CHECKSUM_THREADS, thread_name_prefix="kvoffd-sum",
                                          initializer=_background)
        self.sealer = Sealer(pool.buffer, self._checks, self._write_sums)
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
        self.committed_records = 0  # records written at commit (with or without their checksum)
        self.sealed = 0  # records with their checksum
        self.adopted_unchecked = 0  # adopted without a checksum (summed since, not checked)
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
        """Adopted blocks just entered the index: their verification queued (or, for those adopted
        without a checksum, their sums: nothing to check them against), the KV events told."""
        self.records.invalidate(gone)
        checked = [e for e in entries if e.checksum != NONE]
        if len(checked) < len(entries):
            unchecked = [e for e in entries if e.checksum == NONE]
            self.adopted_unchecked += len(unchecked)
            self.sealer.submit(unchecked)
        self.unverified.update(checked)
        if self.on_adopted is not None:
            self.on_adopted(entries)
        elif self._adopted is not None:
            self._adopted += entries
        if checked and not self._no_verify_pass:
            for i in range(0, len(checked), VERIFY_SLICE):
                part = checked[i:i + VERIFY_SLICE]
                fut = self._checks.submit(self._recompute, part)
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
        """The checksums behind the stores, the background verification of adopted blocks, the periodic
        flush."""
        self._loop = loop
        self.sealer.start(loop)
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
        """Their copies completed (this runs in the loop callback that made them visible): their records
        now, without a checksum unless ``--verify`` summed them already; the sums follow behind."""
        by_table: dict[Table, list[Entry]] = {}
        for e in entries:
            by_table.setdefault(e.table, []).append(e)
        for t, mine in by_table.items():
            ns_id = self._ns_id(t)
            if ns_id is None:
                continue
            idx = self.records.index_of(np.fromiter((e.slot for e in mine), dtype=np.int64, count=len(mine)),
                                        t.slot_bytes)
            keep = idx >= 0
            if not keep.all():  # slots past a chunk's records: not persisted
                mine = [e for e, k in zip(mine, keep.tolist(), strict=True) if k]
                idx = idx[keep]
            if not mine:
                continue
            sums = np.fromiter((e.checksum if 0 <= e.checksum < LEGACY_CRC32 else NONE for e in mine),
                               dtype=np.int64, count=len(mine))
            self.records.seal(idx, ns_id, t.rank, b"".join([e.key for e in mine]),
                              np.fromiter((e.stored_at for e in mine), dtype=np.float64, count=len(mine)), sums,
                              t.slot_bytes)
            self.committed_records += len(mine)
            known = sums >= 0
            if known.any():  # --verify: summed before the notice, sealed already
                self.sealed += int(known.sum())
                mine = [e for e, k in zip(mine, known.tolist(), strict=True) if not k]
            self.sealer.submit(mine)

    def freeing(self, slot_bytes: int, entries: Sequence[Entry]) -> None:
        if self.unverified:
            for e in entries:
                self.unverified.discard(e)
        self.sealer.forget(entries)
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
        self._maybe_verified()

    def _verified(self, part: list[Entry], intact: list[int]) -> None:
        for e, ok in zip(part, intact, strict=True):
            if e not in self.unverified:
                continue  # loaded (and checked) or freed meanwhile
            self.unverified.discard(e)
            if ok == 0 and not e.dead:
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
        """On a checksum thread: 1 for each block whose bytes still match its checksum, 0 for one that
        does not, -1 for one freed meanwhile (this daemon's checksums by runs of neighbouring slots; an
        older daemon's crc32 one by one)."""
        buf = self.pool.buffer
        out = [-1] * len(entries)
        ours = [j for j, e in enumerate(entries) if not e.dead and 0 <= e.checksum < LEGACY_CRC32]
        sums = sums_at(buf, [entries[j].slot for j in ours], [entries[j].table.slot_bytes for j in ours])
        for j, c in zip(ours, sums, strict=True):
            out[j] = int(c == entries[j].checksum)
        for j, e in enumerate(entries):
            if not e.dead and e.checksum >= LEGACY_CRC32:
                out[j] = int(_intact(buf, e))
        return out

    # --- results from the checksum threads -------------------------------------------------------------
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

    def _write_sums(self, part: list[Entry], sums: list[int]) -> None:
        """On the loop: the sums of ``part`` (kvoffd/cache/restart/sealing.py) into the records of the blocks
        still alive. A block freed meanwhile is skipped: its record was invalidated at its ``freeing``
        and its slot may hold another block by now (whose own record this must not touch)."""
        by_table: dict[Table, list[tuple[Entry, int]]] = {}
        for e, c in zip(part, sums, strict=True):
            if not e.dead and c >= 0:
                e.checksum = c
                by_table.setdefault(e.table, []).append((e, c))
        for t, got in by_table.items():
            idx = self.records.index_of(np.fromiter((e.slot for e, _ in got), dtype=np.int64, count=len(got)),
                                        t.slot_bytes)
            crcs = np.fromiter((c for _, c in got), dtype=np.int64, count=len(got))
            keep = idx >= 0
            self.sealed += self.records.fill(idx[keep], crcs[keep])

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
        """SIGTERM: sum what is left (at most ``SEAL_ON_STOP_S``), write the last stamps, unlock. Every
        committed block is kept whatever is left: its record is there, without a checksum."""
        loop = asyncio.get_running_loop()
        if self._timer is not None:
            self._timer.cancel()
        self._stop_allocating.set()
        self.unsealed_at_stop = await self.sealer.drain(SEAL_ON_STOP_S)
        self._stopping = True
        if self._allocator is not None:
            await loop.run_in_executor(None, self._allocator.join)
        self._checks.shutdown(wait=False, cancel_futures=True)
        self._flush_touches()
        self.pf.write_header()
        held = self.records.scan()  # what the next daemon will find: the file's records, not this process's
        n_unsummed = int((held.crc == NONE).sum())
        self.pf.close()
        log.info("pool file %s kept: %d blocks for the next daemon to adopt, %d of them without their checksum "
                 "yet (adopted all the same); this process committed %d and summed %d", self.pf.path,
                 len(held.record), n_unsummed, self.committed_records, self.sealed)

    def stats(self) -> dict:
        return {"path": self.pf.path, "adopted_blocks": self.adopted, "adopted_bytes": self.adopted_bytes,
                "adopted_from": self.adopted_from, "adopt_s": round(self.adopt_s, 6),
                "indexed_s": round(self.indexed_s, 6), "indexing_blocks": self._plan.waiting if self._plan else 0,
                "adopted_on_demand": self.adopted_on_demand,
                "verified_s": round(self.verified_s, 6), "unverified_blocks": len(self.unverified),
                "verify_failures": self.verify_failures, "committed_blocks": self.committed_records,
                "sealed_blocks": self.sealed, "unsealed_blocks": self.sealer.blocks,
                "adopted_unchecked": self.adopted_unchecked, **self.sealer.stats()}
