"""LOOKUP, STORE and LOAD, from the request's check to the job's notice.

A STORE or LOAD that passes its checks becomes a :class:`Job`, counted in flight from then until its
notice. Three orderings matter and are kept where they happen:

* **the copy starts first**: ``backend.submit`` runs before the per-key bookkeeping, which then
  runs while the bytes move;
* **notice before commit, in the same callback**: the engine may reuse its blocks once told, and a
  lookup that follows the notice sees the blocks, because nothing interleaves before the commit;
* **answer first, then hold**: LOOKUP replies, then takes the lease's refs; nothing else runs on
  the loop in between, so no eviction can take a block the answer promised.

With tiers below the pool (kvoffd/cache/tiers/manager.py), a LOOKUP's hits extend to the blocks found
there (their promotion into the pool starts before the answer), and a LOAD of such blocks first waits
for their promotions, then copies from the pool as usual.

Every STORE or LOAD gets an answer naming its job, whatever fails inside the daemon (the client waits
for it without a timer): an exception before the copy starts is an ``internal`` ERROR with the
``job_id`` (nothing was copied); one after it fails the job with a notice once its copy has ended
(``_faulted``), and a job's task that raises before its notice sends it (``_guarded``).

Handlers answer through the ``reply`` callable and start tasks through ``spawn``; they never import
the server loop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import TYPE_CHECKING, Any

import numpy as np

from kvoffd.cache.index import Index, StorePlan
from kvoffd.cache.restart.keeper import Keeper
from kvoffd.cache.tiers.manager import PROMOTE_WAIT_S, Tiers
from kvoffd.metrics import Metrics
from kvoffd.pool.allocator import Pool
from kvoffd.server.job import Job
from kvoffd.server.limits import MAX_JOBS_PER_CONN, MAX_RUNS_PER_JOB
from kvoffd.server.sessions import Conn, Engine, Lease, Reply, Sessions
from kvoffd.server.verify import LoadVerify
from kvoffd.transfer.base import Direction, JobExpired
from kvoffd_client import protocol as P
from kvoffd_client.protocol import DropReason, ErrorCode, MissReason, NoticeCode, ProtocolError

if TYPE_CHECKING:
    from kvoffd.events.publisher import KvEventPublisher

log = logging.getLogger(__name__)

Spawn = Callable[[Coroutine[Any, Any, None]], None]


def _failed_future(exc: BaseException) -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    fut.set_exception(exc)
    return fut


class Jobs(LoadVerify):
    """The data path's requests. ``running`` is every accepted job until its notice. ``kv_events``
    (--kv-events-address; None: off) keeps what a STORE tells of its blocks for their KV events."""

    def __init__(self, *, sessions: Sessions, index: Index, pool: Pool, metrics: Metrics, verify: bool,
                 persist: Keeper, reply: Reply, spawn: Spawn, kv_events: KvEventPublisher | None = None,
                 tiers: Tiers | None = None) -> None:
        """``persist``: the pool file's keeper (kvoffd/cache/restart/persistence.py): adopted blocks are checked on
        their first LOAD, and loaded blocks get new last-use stamps."""
        self.sessions = sessions
        self.index = index
        self.tiers = tiers if tiers is not None else Tiers(index, [])  # below the pool (none: no tier)
        self.pool = pool
        self.metrics = metrics
        self.verify = verify
        self.persist = persist
        self.reply = reply
        self.spawn = spawn
        self.kv_events = kv_events
        self.running: set[Job] = set()

    def in_flight(self) -> tuple[dict[str, int], float]:
        """Jobs running by direction, and the age of the oldest."""
        counts = {"store": 0, "load": 0}
        oldest = 0.0
        now = time.monotonic()
        for job in self.running:
            counts[job.direction.value] += 1
            oldest = max(oldest, now - job.started)
        return counts, oldest

    # --- LOOKUP -----------------------------------------------------------------------------------------
    def lookup(self, conn: Conn, msg: P.Lookup) -> P.Message | None:
        """Answer first, then promote, count and hold: the client waits on the answer, and nothing else
        runs on the loop in between, so no eviction can take a block the answer promised. Blocks found
        below the pool are answered as hits before their promotion's per-block work (``Tiers.promote``)
        when the pool surely has slots for them all, free or evictable (``Tiers.fits``); otherwise they
        are promoted first (the evictions may fall short) and the answer counts those that got a slot."""
        total = P.count_keys(msg.keys)
        hits = self.index.lookup(msg.namespace, msg.keys, with_entries=msg.lease_ms > 0)
        if (hits.n < total and hits.miss_reason is MissReason.ABSENT  # a restart still indexing: not a miss
                and self.persist.adopt_asked(msg.namespace, msg.keys[hits.n * P.KEY_SIZE:])):
            hits = self.index.lookup(msg.namespace, msg.keys, with_entries=msg.lease_ms > 0)
        below = None
        if self.tiers.enabled and hits.n < total:  # blocks below the pool are hits too
            below = self.tiers.find_below(msg.namespace, msg.keys, hits)
            if below is not None and not self.tiers.fits(below):  # room not sure: promote, then answer
                hits, below = self.tiers.promote(below), None
        n = below.n if below is not None else hits.n
        lease_id = 0
        if n and msg.lease_ms:
            self.sessions.check_lease(conn, n * hits.world_size, msg.seq)
            lease_id = self.sessions.next_lease_id()
        self.reply(conn.ident, P.LookupResult(seq=msg.seq, hits=n, lease_id=lease_id, world_size=hits.world_size))
        if below is not None:
            # The answer is queued for libzmq's I/O thread, which the send just woke, often on this core;
            # the promotion's per-block work (4-9 us a block) would run ahead of it. One yield lets it
            # go out first (one run on the 2-core VM: 1,024-block disk hits 779 -> 646 us at p50).
            os.sched_yield()
            hits = self.tiers.promote(below, answered=True)  # they surely get slots: nothing falls short
        if lease_id:
            held = self.index.hold(hits)
            self.sessions.add_lease(conn, Lease(lease_id, conn.ident, time.monotonic() + msg.lease_ms / 1000,
                                                hits.by_rank, msg.namespace), held)
        counts = self.metrics.lookup
        counts.lookups += 1
        counts.hit_blocks += n
        missed = total - n
        if missed:
            counts.miss_blocks += missed
            reason = hits.miss_reason if hits.n == n else MissReason.ABSENT
            self.metrics.misses.labels((reason or MissReason.ABSENT).value).inc(missed)
        return None

    # --- checks shared by STORE and LOAD ----------------------------------------------------------------
    def _check(self, conn: Conn, msg: P.Store | P.Load) -> tuple[Engine, list[bytes], np.ndarray]:
        eng = self.sessions.engine_of(conn, msg.engine_id, msg.seq, msg.job_id)
        if msg.expires_ns and time.monotonic_ns() > msg.expires_ns:
            self.metrics.expired_jobs.inc()
            raise ProtocolError(ErrorCode.EXPIRED, f"job {msg.job_id} arrived after its deadline; not started",
                                seq=msg.seq, job_id=msg.job_id)
        ids = np.frombuffer(msg.block_ids, dtype="<i4").astype(np.int64)
        n = P.count_keys(msg.keys)
        if n != len(ids):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{n} keys but {len(ids)} block ids", seq=msg.seq,
                                job_id=msg.job_id)
        if len(ids) and (int(ids.min()) < 0 or int(ids.max()) >= eng.mapped.num_blocks):
            raise ProtocolError(ErrorCode.BAD_BLOCK_ID, f"block ids must lie in [0, {eng.mapped.num_blocks}); got "
                                f"[{int(ids.min())}, {int(ids.max())}]", seq=msg.seq, job_id=msg.job_id)
        if msg.event >= 0 and msg.event >= eng.mapped.num_events:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"event {msg.event} is not in this engine's event ring",
                                seq=msg.seq, job_id=msg.job_id)
        if msg.job_id in conn.jobs:
            raise ProtocolError(ErrorCode.DUPLICATE_JOB, f"job {msg.job_id} is already in flight", seq=msg.seq,
                                job_id=msg.job_id)
        if len(conn.jobs) >= MAX_JOBS_PER_CONN:
            raise ProtocolError(ErrorCode.TOO_MANY, f"at most {MAX_JOBS_PER_CONN} jobs in flight per connection",
                                seq=msg.seq, job_id=msg.job_id)
        if len(ids) * len(eng.mapped.segments) > MAX_RUNS_PER_JOB:
            raise ProtocolError(ErrorCode.TOO_MANY, f"{len(ids)} blocks of {len(eng.mapped.segments)} segments "
                                f"make {len(ids) * len(eng.mapped.segments)} copy runs; at most "
                                f"{MAX_RUNS_PER_JOB} per job", seq=msg.seq, job_id=msg.job_id)
        return eng, P.split_keys(msg.keys), ids

    @staticmethod
    def _submit(eng: Engine, d: Direction, ids: np.ndarray, slots: np.ndarray, msg: P.Store | P.Load
                ) -> Awaitable[None]:
        try:
            return eng.backend.submit(d, eng.mapped, ids, slots, msg.event, msg.expires_ns)
        except Exception as e:
            return _failed_future(e)

    # --- a job's answer, whatever fails ------------------------------------------------------------------
    @staticmethod
    def _refused(msg: P.Store | P.Load, e: Exception) -> ProtocolError:
        """A bug before the job's copy started: an ``internal`` ERROR naming the job (the client ends it:
        nothing was copied), the traceback in the log."""
        log.error("%s job %d failed inside the daemon before its copy started", msg.op.value, msg.job_id,
                  exc_info=e)
        return ProtocolError(ErrorCode.INTERNAL, "internal error; see the daemon log", seq=msg.seq,
                             job_id=msg.job_id)

    async def _guarded(self, job: Job, run: Coroutine[Any, Any, None]) -> None:
        """A job's task: whatever it raises before its notice went out, the job ends with one (all its
        blocks failed), so no accepted job is left unanswered."""
        try:
            await run
        except asyncio.CancelledError:
            raise
        except Exception:
            if job.answered:  # its notice is out: only the bookkeeping after it failed
                log.exception("%s job %d: bookkeeping after its notice failed", job.direction.value, job.job_id)
                return
            log.exception("%s job %d of engine %s failed inside the daemon", job.direction.value, job.job_id,
                          job.engine.engine_id)
            self.metrics.failed_jobs.labels(job.direction.value).inc()
            if job in self.running:
                self._end(job)
            self._notice(job, list(range(P.count_keys(job.msg.keys))), NoticeCode.COPY_FAILED.value,
                         "internal error; see the daemon log")

    # --- STORE ------------------------------------------------------------------------------------------
    def store(self, conn: Conn, msg: P.Store) -> P.Message | None:
        eng, keys, ids = self._check(conn, msg)
        try:
            return self._store(conn, msg, eng, keys, ids)
        except ProtocolError:
            raise
        except Exception as e:
            raise self._refused(msg, e) from e

    def _store(self, conn: Conn, msg: P.Store, eng: Engine, keys: list[bytes], ids: np.ndarray) -> P.Message | None:
        if eng.table.rank != eng.rank:  # replicas: its run's first rank stores the one copy, the others read it
            raise ProtocolError(ErrorCode.BAD_FIELD, f"rank {eng.rank} of namespace {eng.namespace!r} reads the copy "
                                f"rank {eng.table.rank} stores (replicas); it does not store", seq=msg.seq,
                                job_id=msg.job_id)
        described = self._described(eng, msg, len(keys))  # KV events: the blocks' tokens and parents
        plan = self.index.prepare_store(eng.table, keys, shard=eng.placement.shard)  # on its NUMA node's shard
        m = self.metrics
        if plan.present:
            m.store_noop_blocks.inc(plan.present)
        dropped = plan.dropped
        if dropped:
            m.dropped_stores.labels(DropReason.POOL_FULL.value).inc(len(dropped))
        if plan.refused:  # reported with the dropped ones: not stored, nothing copied
            m.admission_refused.inc(len(plan.refused))
            dropped = sorted(dropped + plan.refused)
        code = NoticeCode.POOL_FULL.value if plan.dropped else NoticeCode.NOT_ADMITTED.value if plan.refused else ""
        if not plan.copy_idx:
            return P.Notice(seq=msg.seq, job_id=msg.job_id, ok=not dropped, failed=dropped, code=code)
        t0 = time.monotonic()
        slots = np.array(plan.slots, dtype=np.int64)
        block_ids = ids[plan.copy_idx]
        # the copy starts first; the per-key bookkeeping below runs while the bytes move
        fut = self._submit(eng, Direction.STORE, block_ids, slots, msg)
        fault: Exception | None = None
        try:
            self.index.add_pending(plan)
            if described:
                self._note_described(eng, msg, plan)
        except Exception as e:  # the copy is running: the job fails once it has ended, never before
            fault = e
        job = Job(conn=conn, engine=eng, msg=msg, direction=Direction.STORE, started=t0, entries=plan.entries,
                  idx=plan.copy_idx, block_ids=block_ids, slots=slots, failed=dropped, code=code, future=fut,
                  plan=plan)
        self._begin(job)
        self.spawn(self._guarded(job, self._faulted(job, fault) if fault else self._finish_store(job)))
        return None

    async def _faulted(self, job: Job, fault: Exception) -> None:
        """A job whose bookkeeping raised after its copy started: it fails once the copy has ended (the
        engine's blocks are not touched after the notice), its planned entries aborted."""
        with contextlib.suppress(Exception):
            await job.future
        if job.plan is not None and job.entries:
            self.index.complete_store(job.plan, False)
        raise fault

    def _described(self, eng: Engine, msg: P.Store, n: int) -> bool:
        """Whether this STORE's ``tokens``/``parents`` are kept for its blocks' events; ``bad_field``
        when they do not fit its keys. A daemon without KV events ignores them (it never asked)."""
        if self.kv_events is None or not (msg.tokens or msg.parents):
            return False
        try:
            return self.kv_events.check_described(eng.namespace, eng.rank, n, msg.tokens, msg.parents)
        except ProtocolError as e:
            e.seq, e.job_id = msg.seq, msg.job_id
            raise

    def _note_described(self, eng: Engine, msg: P.Store, plan: StorePlan) -> None:
        ev = self.kv_events
        assert ev is not None
        ident = ev.identity(eng.namespace)
        assert ident is not None  # check_described said so, in this same callback
        ev.note_described(plan.entries, plan.copy_idx, msg.tokens, msg.parents, ident.block_size)

    async def _finish_store(self, job: Job) -> None:
        plan, entries = job.plan, job.entries
        assert plan is not None and job.future is not None
        try:
            await job.future
        except asyncio.CancelledError:
            self.index.complete_store(plan, False)
            self._end(job)
            raise
        except Exception as e:
            code = self._job_failed(job, e)
            self._end(job)
            self._notice(job, sorted(job.failed + job.idx), code, str(e)[:200])
            self.index.complete_store(plan, False)  # a partial (or expired) store is never committed
            self.metrics.dropped_stores.labels(DropReason.FAILED.value).inc(len(entries))
            return
        if self.verify:
            try:
                sums = await asyncio.get_running_loop().run_in_executor(None, self._checksums, entries)
            except Exception:
                self.index.complete_store(plan, False)  # not committed without its sums
                raise
            for e, c in zip(entries, sums, strict=True):
                e.checksum = c
        self._end(job)
        # The engine may reuse its blocks from now on: tell it before the bookkeeping. Nothing can
        # interleave between the notice and the commit (same loop callback), so a lookup that follows
        # the notice sees the blocks.
        self._notice(job, job.failed, job.code, "")
        self._account(job, len(entries))
        done = self.index.complete_store(plan, True)
        if done < len(entries):
            self.metrics.dropped_stores.labels(DropReason.CLEAR.value).inc(len(entries) - done)

    # --- LOAD -------------------------------------------------------------------------------------------
    def load(self, conn: Conn, msg: P.Load) -> P.Message | None:
        eng, keys, ids = self._check(conn, msg)
        try:
            waiting = self.tiers.promotions(eng.table, keys)
            if waiting:  # blocks a LOOKUP found below the pool, still on their way into it
                job = Job(conn=conn, engine=eng, msg=msg, direction=Direction.LOAD, started=time.monotonic(),
                          entries=[], idx=[], block_ids=ids[:0], slots=np.empty(0, dtype=np.int64), failed=[],
                          code="", future=None)
                self._begin(job)  # in flight from now: it waits for the promotions first
                self.spawn(self._guarded(job, self._load_promoted(job, keys, ids, waiting)))
                return None
            return self._load_resident(conn, eng, msg, keys, ids)
        except ProtocolError:
            raise
        except Exception as e:  # (``_load_resident`` submits its copy only as its last fallible step)
            raise self._refused(msg, e) from e

    async def _load_promoted(self, job: Job, keys: list[bytes], ids: np.ndarray,
                             waiting: list[asyncio.Future]) -> None:
        """A LOAD waits for its promotions (a failed or late one: those blocks fail), then runs as usual."""
        msg = job.msg
        left = (msg.expires_ns - time.monotonic_ns()) / 1e9 if msg.expires_ns else PROMOTE_WAIT_S
        try:
            await asyncio.wait(waiting, timeout=max(0.0, min(left, PROMOTE_WAIT_S)))
        finally:
            self._end(job)  # cancelled (shutdown) too: no longer in flight
        if job.engine.closing:
            self._notice(job, list(range(len(keys))), NoticeCode.COPY_FAILED.value, "the engine left")
            return
        assert isinstance(msg, P.Load)
        reply = self._load_resident(job.conn, job.engine, msg, keys, ids)
        if reply is not None:
            self.reply(job.conn.ident, reply)

    def _load_resident(self, conn: Conn, eng: Engine, msg: P.Load, keys: list[bytes],
                       ids: np.ndarray) -> P.Message | None:
        """The LOAD of what the pool holds now (the blocks not resident are reported failed)."""
        lp = self.index.prepare_load(eng.table, keys)  # a ref on each entry, released when the copy ends
        entries, failed = lp.entries, lp.missing_idx
        try:
            if msg.lease_id and entries:
                self.sessions.consume_lease(msg.lease_id, eng, entries[0])
            if failed:
                self.metrics.misses.labels(MissReason.ABSENT.value).inc(len(failed))
            if not entries:
                return P.Notice(seq=msg.seq, job_id=msg.job_id, ok=not failed, failed=failed,
                                code=NoticeCode.NOT_RESIDENT.value if failed else "")
            slots = np.fromiter((e.slot for e in entries), dtype=np.int64, count=len(entries))
            if eng.placement.shard >= 0:  # a sharded pool: blocks read from another node than the engine's
                far = int(np.count_nonzero(self.pool.chunk_node[slots // self.pool.chunk_bytes]
                                           != eng.placement.node))
                if far:
                    self.metrics.cross_numa_loads.inc(far)
            ids = ids[lp.found_idx] if failed else ids
            checks_first = self.verify or self.persist.must_check(entries)
        except Exception:
            self.index.release(entries)  # the refs ``prepare_load`` took: no job holds them
            raise
        t0 = time.monotonic()
        fut: Awaitable[None] | None = None
        # start the copy now, not one loop turn later in the job's task, unless checksums come first
        if not checks_first:
            fut = self._submit(eng, Direction.LOAD, ids, slots, msg)
        job = Job(conn=conn, engine=eng, msg=msg, direction=Direction.LOAD, started=t0, entries=entries,
                  idx=lp.found_idx, block_ids=ids, slots=slots, failed=failed,
                  code=NoticeCode.NOT_RESIDENT.value if failed else "", future=fut)
        self._begin(job)
        self.spawn(self._guarded(job, self._run_load(job)))
        return None

    async def _run_load(self, job: Job) -> None:
        failed, code, text = job.failed, job.code, ""
        moved = len(job.block_ids)
        try:
            if job.future is not None:
                await job.future
            else:  # --verify, or adopted blocks not checked yet since a warm restart: checksums first
                failed, code, text, moved = await self._verified_load(job)
        except asyncio.CancelledError:
            self._end(job)
            self.index.release(job.entries)
            raise
        except Exception as e:
            code = self._job_failed(job, e)
            failed = sorted(failed + job.idx)
            text = str(e)[:200]
            moved = -1
        self._end(job)
        self._notice(job, failed, code, text)  # first: the engine is waiting on it
        try:
            if moved >= 0:
                self._account(job, moved)
                self.persist.touched(job.entries)  # last-use stamps, for the next daemon's LRU order
        finally:
            self.index.release(job.entries)

    # --- a job's life -----------------------------------------------------------------------------------
    def _begin(self, job: Job) -> None:
        """An accepted job: counted in flight (and aged) from now until its notice."""
        job.conn.jobs.add(job.job_id)
        job.engine.mapped.in_flight += 1
        self.running.add(job)

    def _end(self, job: Job) -> None:
        self.running.discard(job)
        job.conn.jobs.discard(job.job_id)
        eng = job.engine
        eng.mapped.in_flight -= 1
        if eng.closing and eng.mapped.in_flight == 0:
            self.sessions.detach(eng)

    def _job_failed(self, job: Job, e: Exception) -> str:
        """Count and log a job that failed as a whole; returns its notice code. ``expired``: its
        deadline passed before (the rest of) its copy could start, so it was stopped there."""
        d = job.direction.value
        if isinstance(e, JobExpired):
            log.warning("%s job %d of engine %s expired: %s", d, job.job_id, job.engine.engine_id, e)
            self.metrics.expired_jobs.inc()
            return NoticeCode.EXPIRED.value
        log.warning("%s job %d of engine %s failed: %s", d, job.job_id, job.engine.engine_id, e)
        self.metrics.failed_jobs.labels(d).inc()
        return NoticeCode.COPY_FAILED.value

    def _notice(self, job: Job, failed: list[int], code: str, text: str) -> None:
        """Sent even when the connection was dropped meanwhile (an engine silent past engine_timeout_s,
        e.g. a client frozen for a while): its client waits for this notice before it reuses the
        blocks, and a peer that is gone is just not routed to. Once per job."""
        job.answered = True
        self.reply(job.conn.ident, P.Notice(job_id=job.job_id, ok=not failed, failed=failed, code=code,
                                            message=text))

    def _account(self, job: Job, blocks: int) -> None:
        m = self.metrics
        d = job.direction
        nbytes = blocks * job.engine.mapped.slot_bytes
        dt = time.monotonic() - job.started
        (m.stored_blocks if d is Direction.STORE else m.loaded_blocks).inc(blocks)
        m.transfer_bytes.labels(d.value).inc(nbytes)
        m.transfer_seconds.labels(d.value).observe(dt)
        m.transfer_blocks.labels(d.value).observe(blocks)
        if nbytes >= (1 << 20) and dt > 0:
            m.transfer_gbps.labels(d.value).set(nbytes / dt / 1e9)
