"""LOOKUP, STORE and LOAD, from the request's check to the job's notice.

A STORE or LOAD that passes its checks becomes a :class:`Job`, counted in flight from then until its
notice. Three orderings matter and are kept where they happen:

* **the copy starts first**: ``backend.submit`` runs before the per-key bookkeeping, which then
  runs while the bytes move;
* **notice before commit, in the same callback**: the engine may reuse its blocks once told, and a
  lookup that follows the notice sees the blocks, because nothing interleaves before the commit;
* **answer first, then hold**: LOOKUP replies, then takes the lease's refs; nothing else runs on
  the loop in between, so no eviction can take a block the answer promised.

Everything the cache knows is asked of the keyspace (kvoffd/cache/keyspace.py): a LOOKUP's hits,
below the pool too (``Keyspace.lookup``: its answer, then ``Answer.after_reply``), and the
promotions a LOAD of such blocks waits for before it copies from the pool as usual.

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
import time
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import numpy as np

from kvoffd.cache.keyspace import ASK_WAIT_S, PROMOTE_WAIT_S, Answer, Keyspace
from kvoffd.metrics import Metrics
from kvoffd.server.job import Job
from kvoffd.server.limits import MAX_JOBS_PER_CONN, MAX_RUNS_PER_JOB
from kvoffd.server.parts import check_parts, submit_parts
from kvoffd.server.sessions import Conn, Engine, Lease, Reply, Sessions
from kvoffd.server.verify import Verifier
from kvoffd.transfer.base import Direction, JobExpired, failed_future
from kvoffd_client import protocol as P
from kvoffd_client.protocol import DropReason, ErrorCode, MissReason, NoticeCode, ProtocolError

log = logging.getLogger(__name__)

Spawn = Callable[[Coroutine[Any, Any, None]], None]


class Jobs:
    """The data path's requests. ``running`` is every accepted job until its notice. ``verifier``
    checks the sums of a LOAD that must check first (--verify, adopted blocks: kvoffd/server/verify.py)."""

    def __init__(self, *, sessions: Sessions, keyspace: Keyspace, metrics: Metrics, reply: Reply,
                 spawn: Spawn) -> None:
        self.sessions = sessions
        self.keyspace = keyspace
        self.metrics = metrics
        self.reply = reply
        self.spawn = spawn
        self.verifier = Verifier(keyspace, metrics)
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
        """Answer first, then hold (``Answer.after_reply``: promotions, then the lease's refs) and
        count: the client waits on the answer, and nothing else runs on the loop in between, so no
        eviction can take a block the answer promised. When the keyspace asked a tier about the misses
        (``Answer.asked``), the LOOKUP is answered afresh once the tier answered, within ``ASK_WAIT_S``
        (the first answer took nothing: it is dropped)."""
        answer = self.keyspace.lookup(msg.namespace, msg.keys, hold=msg.lease_ms > 0)
        if answer.asked is not None:
            self.spawn(self._lookup_after(conn, msg, answer.asked))
            return None
        self._answer_lookup(conn, msg, answer)
        return None

    async def _lookup_after(self, conn: Conn, msg: P.Lookup, asked: asyncio.Future) -> None:
        await asyncio.wait({asked}, timeout=ASK_WAIT_S)
        try:
            conn = self.sessions.session_of(conn.ident, msg.seq)  # still connected?
            self._answer_lookup(conn, msg, self.keyspace.lookup(msg.namespace, msg.keys, hold=msg.lease_ms > 0,
                                                                ask=False))
        except ProtocolError as e:
            e.seq = msg.seq
            self.reply(conn.ident, P.error_for(e))
        except Exception:
            log.exception("a LOOKUP answered after the cluster's probe failed")
            self.reply(conn.ident, P.Error(seq=msg.seq, code=ErrorCode.INTERNAL.value,
                                           message="internal error; see the daemon log"))

    def _answer_lookup(self, conn: Conn, msg: P.Lookup, answer: Answer) -> None:
        n = answer.n
        lease_id = 0
        if n and msg.lease_ms:
            self.sessions.check_lease(conn, n * answer.world_size, msg.seq)
            lease_id = self.sessions.next_lease_id()
        self.reply(conn.ident, P.LookupResult(seq=msg.seq, hits=n, lease_id=lease_id, world_size=answer.world_size))
        held = answer.after_reply()
        if lease_id:
            self.sessions.add_lease(conn, Lease(lease_id, conn.ident, time.monotonic() + msg.lease_ms / 1000,
                                                answer.by_rank, msg.namespace), held)
        counts = self.metrics.lookup
        counts.lookups += 1
        counts.hit_blocks += n
        missed = P.count_keys(msg.keys) - n
        if missed:
            counts.miss_blocks += missed
            self.metrics.misses.labels(answer.miss_reason.value).inc(missed)

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
        if msg.ready_event >= 0 and msg.ready_event >= eng.mapped.num_events:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"ready_event {msg.ready_event} is not in this engine's "
                                "CUDA event ring", seq=msg.seq, job_id=msg.job_id)
        if msg.job_id in conn.jobs:
            raise ProtocolError(ErrorCode.DUPLICATE_JOB, f"job {msg.job_id} is already in flight", seq=msg.seq,
                                job_id=msg.job_id)
        if len(conn.jobs) >= MAX_JOBS_PER_CONN:
            raise ProtocolError(ErrorCode.TOO_MANY, f"at most {MAX_JOBS_PER_CONN} jobs in flight per connection",
                                seq=msg.seq, job_id=msg.job_id)
        runs = len(eng.mapped.segments) + len(msg.cuts)  # a cut splits at most one run
        if len(ids) * runs > MAX_RUNS_PER_JOB:
            raise ProtocolError(ErrorCode.TOO_MANY, f"{len(ids)} blocks of {runs} runs make {len(ids) * runs} "
                                f"copy runs; at most {MAX_RUNS_PER_JOB} per job", seq=msg.seq, job_id=msg.job_id)
        try:
            check_parts(msg, eng.mapped)
        except ValueError as e:
            raise ProtocolError(ErrorCode.BAD_FIELD, str(e), seq=msg.seq, job_id=msg.job_id) from None
        return eng, P.split_keys(msg.keys), ids

    def _submit(self, conn: Conn, eng: Engine, d: Direction, ids: np.ndarray, slots: np.ndarray,
                msg: P.Store | P.Load) -> Awaitable[None]:
        """Start the job's copy: whole, or in parts (kvoffd.server.parts; a LOAD's LANDED go to ``conn``)."""
        try:
            if msg.cuts:
                landed = (lambda n: self.reply(conn.ident, P.Landed(job_id=msg.job_id, parts=n))
                          ) if d is Direction.LOAD else None
                return submit_parts(eng.backend, d, eng.mapped, ids, slots, msg, eng.mapped.parts(msg.cuts), landed)
            return eng.backend.submit(d, eng.mapped, ids, slots, msg.ready_event, msg.expires_ns)
        except Exception as e:
            return failed_future(e)

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
        plan = self.keyspace.prepare_store(eng.table, keys, shard=eng.placement.shard)  # on its NUMA node's shard
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
        fut = self._submit(conn, eng, Direction.STORE, block_ids, slots, msg)
        fault: Exception | None = None
        try:
            self.keyspace.add_pending(plan)
            if described:
                self.keyspace.note_described(eng.namespace, plan, msg.tokens, msg.parents)
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
            self.keyspace.complete_store(job.plan, False)
        raise fault

    def _described(self, eng: Engine, msg: P.Store, n: int) -> bool:
        """Whether this STORE's ``tokens``/``parents`` are kept for its blocks' events; ``bad_field``
        when they do not fit its keys. A daemon without KV events ignores them (it never asked)."""
        try:
            return self.keyspace.describes(eng.namespace, eng.rank, n, msg.tokens, msg.parents)
        except ProtocolError as e:
            e.seq, e.job_id = msg.seq, msg.job_id
            raise

    async def _finish_store(self, job: Job) -> None:
        plan, entries = job.plan, job.entries
        assert plan is not None and job.future is not None
        try:
            await job.future
        except asyncio.CancelledError:
            self.keyspace.complete_store(plan, False)
            self._end(job)
            raise
        except Exception as e:
            code = self._job_failed(job, e)
            self._end(job)
            self._notice(job, sorted(job.failed + job.idx), code, str(e)[:200])
            self.keyspace.complete_store(plan, False)  # a partial (or expired) store is never committed
            self.metrics.dropped_stores.labels(DropReason.FAILED.value).inc(len(entries))
            return
        if self.keyspace.verify:
            try:
                sums = await asyncio.get_running_loop().run_in_executor(None, self.keyspace.checksums, entries)
            except Exception:
                self.keyspace.complete_store(plan, False)  # not committed without its sums
                raise
            for e, c in zip(entries, sums, strict=True):
                e.checksum = c
        self._end(job)
        # The engine may reuse its blocks from now on: tell it before the bookkeeping. Nothing can
        # interleave between the notice and the commit (same loop callback), so a lookup that follows
        # the notice sees the blocks.
        self._notice(job, job.failed, job.code, "")
        self._account(job, len(entries))
        done = self.keyspace.complete_store(plan, True)
        if done < len(entries):
            self.metrics.dropped_stores.labels(DropReason.CLEAR.value).inc(len(entries) - done)

    # --- LOAD -------------------------------------------------------------------------------------------
    def load(self, conn: Conn, msg: P.Load) -> P.Message | None:
        eng, keys, ids = self._check(conn, msg)
        try:
            waiting = self.keyspace.promotions(eng.table, keys)
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
        lp = self.keyspace.prepare_load(eng.table, keys)  # a ref on each entry, dropped when the copy ends
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
                far = self.keyspace.far_blocks(slots, eng.placement.node)
                if far:
                    self.metrics.cross_numa_loads.inc(far)
            ids = ids[lp.found_idx] if failed else ids
            checks_first = self.keyspace.checks_first(entries)
        except Exception:
            self.keyspace.complete_load(entries, False)  # the refs ``prepare_load`` took: no job holds them
            raise
        t0 = time.monotonic()
        fut: Awaitable[None] | None = None
        # start the copy now, not one loop turn later in the job's task, unless checksums come first
        if not checks_first:
            fut = self._submit(conn, eng, Direction.LOAD, ids, slots, msg)
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
                failed, code, text, moved = await self.verifier.load(job)
        except asyncio.CancelledError:
            self._end(job)
            self.keyspace.complete_load(job.entries, False)
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
        finally:  # last-use stamps (for the next daemon's LRU order), then the refs drop
            self.keyspace.complete_load(job.entries, moved >= 0)

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
