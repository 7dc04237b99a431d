"""``RemoteTier``: the cluster tier behind the ``Tier`` protocol (kvoffd/cache/tiers/base.py), plus what a
shared store needs beyond a local tier:

* ``lookup``: an asynchronous probe of the cluster (pipelined EXISTS, bounded by ``probe_timeout``) for
  keys no local tier holds: another node may have published them. ``contains``/``probe`` answer from
  memory only (``Known``: what this node published or a lookup found, bounded), as the protocol asks;
  a stale "yes" costs a failed read.
* ``read``: fetch into the destination slots, verified, within ``read_timeout``; resolved on the loop
  only once no lane can write into a destination any more (RemoteStore.fetch's rule).
* ``write``: publish now (the spill path: the slots are the caller's until the future resolves).
* ``publish``: write-behind of admitted blocks: a bounded queue (``queue_blocks``), drop-oldest when
  full (counted, its ``release`` told), at most ``write_budget`` bytes/s (a token bucket, so that
  publishing never saturates the NIC), skipping keys this node knows the cluster holds and those the
  cluster answers EXISTS for. ``release(results)`` runs on the loop when the sources may be reused.

Everything blocking runs on ``IoPool`` threads (reads before writes) or the publisher's thread, never on
the loop; results come back with ``call_soon_threadsafe``.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from kvoffd.cache.identity import MEDIUM_REMOTE
from kvoffd.cache.tiers.base import Held, SpillResult, TableRef, TierStats
from kvoffd.cache.tiers.iopool import READ, WRITE, IoPool
from kvoffd.cache.tiers.remote.known import Known
from kvoffd.cache.tiers.remote.store import OK, PRESENT, RemoteStore
from kvoffd.cache.tiers.remote.valueformat import namespace_id
from kvoffd.metrics import REMOTE_OPS, LatencyTally

log = logging.getLogger(__name__)

_KEY = 32


def split_keys(keys: bytes) -> list[bytes]:
    return [keys[i:i + _KEY] for i in range(0, len(keys), _KEY)]


def pick_keys(keys: bytes, where: np.ndarray) -> bytes:
    """The binary of the keys of ``keys`` (a binary of 32-byte keys) that the bool mask ``where`` picks."""
    return np.frombuffer(keys, dtype=np.uint8).reshape(-1, _KEY)[np.asarray(where, dtype=bool)].tobytes()


class Budget:
    """A token bucket of bytes per second (0: no limit), burst one second's worth or one block."""

    def __init__(self, rate: int, clock=time.monotonic):
        self.rate = rate
        self._clock = clock
        self._tokens = float(rate)
        self._at = clock()
        self._lock = threading.Lock()

    def wait_for(self, n: int, max_wait: float = float("inf")) -> float | None:
        """Take ``n`` bytes; returns how long the caller must wait first (0: go), or None (nothing taken)
        when that would be longer than ``max_wait``."""
        if self.rate <= 0:
            return 0.0
        with self._lock:
            now = self._clock()
            self._tokens = min(float(max(self.rate, n)), self._tokens + (now - self._at) * self.rate)
            self._at = now
            wait = 0.0 if self._tokens >= n else (n - self._tokens) / self.rate
            if wait > max_wait:
                return None
            self._tokens -= n
            return wait


@dataclass
class RemoteStats(TierStats):
    """``TierStats`` plus the cluster tier's own figures (``remote``: kvoffd/metrics.py's ``_RemoteState``
    exports them, docs/metrics.md *The cluster tier*)."""

    remote: dict[str, Any] = field(default_factory=dict)


class _Job:
    __slots__ = ("table", "keys", "src", "release", "sums")

    def __init__(self, table: TableRef, keys: bytes, src: Sequence[memoryview],
                 release: Callable[[list[SpillResult]], None] | None, sums: Sequence[int] | None):
        self.table, self.keys, self.src, self.release, self.sums = table, keys, src, release, sums


class RemoteTier:
    name = "remote"
    medium = MEDIUM_REMOTE

    def __init__(self, store: RemoteStore, read_timeout: float = 1.0, probe_timeout: float = 0.2,
                 write_timeout: float = 5.0, write_budget: int = 0, queue_blocks: int = 256,
                 threads: int = 2, known_cap: int = 1 << 20, publish_on: str = "admitted"):
        self.store = store
        self.read_timeout, self.probe_timeout, self.write_timeout = read_timeout, probe_timeout, write_timeout
        self.budget = Budget(write_budget)
        self.queue_blocks = queue_blocks
        self.known = Known(known_cap)
        self.changed = None
        self.st = RemoteStats(self.name)
        self.latency = {op: LatencyTally() for op in REMOTE_OPS}  # one observation per batch, on its thread
        self._io = IoPool(threads, "kvoffd-remote")
        self._probes = IoPool(1, "kvoffd-remote-probe")  # LOOKUP misses: never queued behind spills
        self._loop: asyncio.AbstractEventLoop | None = None
        self._ns: dict[TableRef, bytes] = {}
        self._queue: collections.deque[_Job] = collections.deque()
        self._queued_blocks = 0
        self._cv = threading.Condition()
        self._stop = False
        self.publish_gate: threading.Event | None = None  # tests: the publisher waits for it
        self._publisher = threading.Thread(target=self._publish_loop, name="kvoffd-remote-publish", daemon=True)
        self.max_probing = 4  # background probes of LOOKUP misses in flight
        self.probe_keys = 1024  # keys asked per probe (a prompt's blocks past the local hits)
        self._probing = 0
        self.probes_dropped = 0  # LOOKUP misses not asked about: too many probes in flight
        self.probes_done = 0  # background probes answered (bench/trace_cluster.py waits on it)
        self._opened_seen = 0  # the shards' breaker openings ``known`` was last trusted at
        self.known_resets = 0
        self.dropped_oldest = 0  # blocks dropped from the write-behind queue (counted)
        self.skipped_known = 0  # blocks not published: this node knew the cluster holds them
        self.skipped_held = 0  # admitted blocks the Publisher did not hold for publishing (its share full)
        self.publish_on = publish_on  # --remote-publish (reported in stats; the keyspace wires the Publisher)

    # -- the Tier protocol -------------------------------------------------------------------------

    def mark_reopened(self) -> None:
        pass

    def reopened_namespaces(self) -> set[str]:
        return set()

    def take_reopened(self, namespace: str, n: int) -> tuple[bytes, bool]:
        return b"", True

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        self._io.start(loop)
        self._probes.start(loop)
        self._publisher.start()
        self._io.submit(READ, lambda: self.store.start(self.probe_timeout * 10), lambda ok: None)

    def _ns_id(self, t: TableRef) -> bytes:
        ns = self._ns.get(t)
        if ns is None:
            ns = self._ns[t] = namespace_id(t.namespace, t.rank, t.world_size, t.layout)
        return ns

    def _fresh(self) -> Known:
        """``known``, emptied when a shard's breaker opened since the last look: a shard that failed may
        come back empty (a cache shard restarts without its data), so nothing it held is trusted."""
        n = sum(s.breaker.opened for s in self.store.cluster.shards())
        if n != self._opened_seen:
            self._opened_seen = n
            self.known.clear()
            self.known_resets += 1
        return self.known

    def contains(self, table: TableRef, keys: bytes, touch: bool = False) -> np.ndarray:
        return self._fresh().has(self._ns_id(table), keys)

    def probe(self, table: TableRef, keys: bytes) -> int:
        return self._fresh().leading(self._ns_id(table), keys)

    def _future(self) -> asyncio.Future:
        assert self._loop is not None, "RemoteTier.start first"
        return self._loop.create_future()

    def lookup(self, table: TableRef, keys: bytes) -> asyncio.Future:
        """Ask the cluster which of ``keys`` it holds; resolves to a bool array (a dead shard: False)."""
        fut = self._future()
        ns, n = self._ns_id(table), len(keys) // _KEY

        def run():
            t0 = time.monotonic()
            hit = self.store.exists(ns, split_keys(keys), self.probe_timeout)
            self.latency["probe"].observe(time.monotonic() - t0)
            self.known.add(ns, keys, hit)
            return hit

        def done(res):
            if isinstance(res, Exception):
                res = np.zeros(n, dtype=bool)
            self.st.hits += int(res.sum())
            if not fut.done():
                fut.set_result(res)
        self._io.submit(READ, run, done)
        return fut

    def note_misses(self, tables: Sequence[TableRef], keys: bytes) -> asyncio.Future | None:
        """A LOOKUP missed ``keys`` locally: ask the cluster about them (every rank's table) on the probe
        thread (never behind spills), so that ``probe``/``contains`` then answer from ``Known``. Returns a
        future resolved on the loop once the answer is in (a LOOKUP may wait for it), or None when there
        is nothing to ask (all known) or the probe was dropped: at most ``max_probing`` in flight (more
        are counted in ``probes_dropped``), ``probe_keys`` keys each."""
        if self._probing >= self.max_probing:
            self.probes_dropped += 1
            return None
        keys = keys[:self.probe_keys * _KEY]
        n = len(keys) // _KEY
        known = self._fresh()
        todo = [ns for ns in map(self._ns_id, tables) if known.leading(ns, keys) < n]
        if not todo:
            return None
        self._probing += 1
        fut = self._future()

        def run():
            ks = split_keys(keys)
            for ns in todo:
                t0 = time.monotonic()
                hit = self.store.exists(ns, ks, self.probe_timeout)
                self.latency["probe"].observe(time.monotonic() - t0)
                self.known.add(ns, keys, hit)

        def done(_res):
            self._probing -= 1
            self.probes_done += 1
            if not fut.done():
                fut.set_result(None)
        self._probes.submit(READ, run, done)
        return fut

    def read(self, table: TableRef, keys: bytes, dest: Sequence[memoryview]) -> asyncio.Future:
        fut = self._future()
        ns, n = self._ns_id(table), len(keys) // _KEY

        def run():
            t0 = time.monotonic()
            ok = self.store.fetch(ns, split_keys(keys), dest, self.read_timeout)
            self.latency["fetch"].observe(time.monotonic() - t0)
            self.known.discard(ns, keys, ~ok)
            return ok

        def done(res):
            if isinstance(res, Exception):
                res = np.zeros(n, dtype=bool)
            got = int(res.sum())
            if got < n:  # not there (evicted), unreadable or refused: forgotten, so announced gone
                self._announce(table, b"", pick_keys(keys, ~res))
            self.st.promotions += got
            self.st.promotion_failures += n - got
            self.st.read_bytes += got * table.slot_bytes
            if not fut.done():
                fut.set_result(res)
        self._io.submit(READ, run, done)
        return fut

    def _publish_now(self, table: TableRef, keys: bytes, src: Sequence[memoryview],
                     may_wait: bool = True, sums: Sequence[int] | None = None) -> list[SpillResult]:
        """On a worker thread: skip what is known there, wait for the budget (only the publisher's own
        thread waits; on the IoPool, whose threads serve the promotions, a spill over the budget is
        dropped, BUSY), publish the rest (``sums``: the blocks' pool checksums where known)."""
        ns, ks = self._ns_id(table), split_keys(keys)
        out = [SpillResult.PRESENT] * len(ks)
        have = self._fresh().has(ns, keys)
        todo = np.flatnonzero(~have).tolist()
        self.skipped_known += len(ks) - len(todo)
        if not todo:
            return out
        wait = self.budget.wait_for(len(todo) * table.slot_bytes, self.write_timeout if may_wait else 0.0)
        if wait is None:
            for i in todo:
                out[i] = SpillResult.BUSY
            return out
        if wait:
            time.sleep(wait)  # the publisher's own thread: paced, never the loop
        t0 = time.monotonic()
        res = self.store.publish(ns, [ks[i] for i in todo], [src[i] for i in todo], self.write_timeout,
                                 sums=None if sums is None else [sums[i] for i in todo])
        self.latency["publish"].observe(time.monotonic() - t0)
        there = np.zeros(len(ks), dtype=bool)
        there[todo] = [r in (OK, PRESENT) for r in res]
        self.known.add(ns, keys, there)
        for i, r in zip(todo, res, strict=True):
            out[i] = SpillResult.WRITTEN if r == OK else SpillResult.PRESENT if r == PRESENT else SpillResult.ERROR
        return out

    def write(self, table: TableRef, keys: bytes, src: Sequence[memoryview],
              sums: Sequence[int] | None = None) -> asyncio.Future:
        fut = self._future()

        def done(res):
            if isinstance(res, Exception):
                res = [SpillResult.ERROR] * (len(keys) // _KEY)
            self._count(table, res, keys)
            if not fut.done():
                fut.set_result(res)
        self._io.submit(WRITE, lambda: self._publish_now(table, keys, src, may_wait=False, sums=sums), done)
        return fut

    def _announce(self, table: TableRef, stored: bytes, removed: bytes) -> None:
        """KV events (--kv-events-address; ``changed`` is set by Tiers.publish): what the cluster now holds
        from this node (published, or found already there) and what this node found gone (binaries of
        keys). On the loop."""
        if self.changed is not None and (stored or removed):
            self.changed(table, stored, removed)

    def _count(self, table: TableRef, res: list[SpillResult], keys: bytes = b"") -> None:
        """Count a batch's results by kind (``list.count``: no Python step per block on the loop) and announce
        ``keys``' published or present ones."""
        if keys and self.changed is not None:
            arr = np.array(res, dtype=object)
            self._announce(table, pick_keys(keys, (arr == SpillResult.WRITTEN) | (arr == SpillResult.PRESENT)), b"")
        for kind in SpillResult:
            k = res.count(kind)
            if not k or kind is SpillResult.PRESENT:
                continue
            if kind is SpillResult.WRITTEN:
                self.st.spills += k
                self.st.write_bytes += k * table.slot_bytes
            else:
                self.st.spills_dropped[kind.value] = self.st.spills_dropped.get(kind.value, 0) + k

    # -- write-behind ------------------------------------------------------------------------------

    def publish(self, table: TableRef, keys: bytes, src: Sequence[memoryview],
                release: Callable[[list[SpillResult]], None] | None = None,
                sums: Sequence[int] | None = None) -> None:
        """Queue ``keys`` for publishing from ``src`` (kept unchanged by the caller until ``release``);
        the oldest queued batches are dropped (``release`` told BUSY) to stay within ``queue_blocks``.
        ``sums``: the blocks' pool checksums (-1 where not known yet), read when each is sent."""
        n = len(keys) // _KEY
        if n > self.queue_blocks:  # never queued: more than the whole queue
            self._release(table, release, [SpillResult.BUSY] * n)
            return
        dropped: list[_Job] = []
        with self._cv:
            while self._queued_blocks + n > self.queue_blocks and self._queue:
                old = self._queue.popleft()
                self._queued_blocks -= len(old.keys) // _KEY
                dropped.append(old)
            self._queue.append(_Job(table, keys, src, release, sums))
            self._queued_blocks += n
            self._cv.notify()
        for old in dropped:
            k = len(old.keys) // _KEY
            self.dropped_oldest += k
            self._release(old.table, old.release, [SpillResult.BUSY] * k)

    def note_held_full(self, n: int) -> None:
        """The Publisher left ``n`` admitted blocks to the spill path: its held share of the pool was full."""
        self.skipped_held += n

    @property
    def queued_blocks(self) -> int:
        return self._queued_blocks

    def _release(self, table: TableRef, release, res: list[SpillResult], keys: bytes = b"") -> None:
        """On the loop: count (and announce ``keys``' published ones), then hand the sources back."""
        self._count(table, res, keys)
        if release is not None:
            try:
                release(res)
            except Exception:
                log.exception("remote tier: a publish's release failed")

    def _publish_loop(self) -> None:
        while True:
            with self._cv:
                while not self._queue and not self._stop:
                    self._cv.wait()
                if not self._queue:
                    return
                gate = self.publish_gate
                job = self._queue[0]
            if gate is not None:
                gate.wait()
            with self._cv:  # taken off only now: while the gate holds it, it may still be dropped
                if not self._queue or self._queue[0] is not job:
                    continue
                self._queue.popleft()
                self._queued_blocks -= len(job.keys) // _KEY
            try:
                res = self._publish_now(job.table, job.keys, job.src, sums=job.sums)
            except Exception:
                log.exception("remote tier: publishing failed")
                res = [SpillResult.ERROR] * (len(job.keys) // _KEY)
            loop = self._loop
            if loop is not None and not loop.is_closed():
                try:
                    loop.call_soon_threadsafe(self._release, job.table, job.release, res, job.keys)
                except RuntimeError:
                    pass

    # -- the rest of the protocol --------------------------------------------------------------------

    def remove(self, table: TableRef, keys: bytes) -> None:
        """Forget locally; the cluster's copy stays (other nodes may use it; same key, same bytes)."""
        self.known.discard(self._ns_id(table), keys)

    def clear(self, namespace: str) -> int:
        ids = {v for t, v in self._ns.items() if not namespace or t.namespace == namespace}
        return self.known.drop_namespace(ids)

    def namespace_blocks(self) -> dict[str, Held]:
        return {}

    def stats(self) -> RemoteStats:
        s = self.store.stats()
        st = self.st
        breakers = self.store.breakers()
        st.remote = {
            "probes": sum(self.latency["probe"].counts), "probed_blocks": s["probes"],
            "probes_dropped": self.probes_dropped,
            "errors": {"timeout": s["timeouts"], "auth": s["auth_errors"], "oom": s["oom_errors"],
                       "verify": s["verify_failures"], "connect": s["connect_errors"], "server": s["server_errors"]},
            "publish_dropped": {"queue_full": self.dropped_oldest, "held_share": self.skipped_held},
            "publish_skipped": {"known": self.skipped_known, "present": s["publish_present"]},
            "queued": self._queued_blocks, "queue_capacity": self.queue_blocks, "breakers": breakers,
            "latency": {op: t.snapshot() for op, t in self.latency.items()}}
        st.resident_blocks = len(self.known)
        st.checksum_failures = s["verify_failures"]
        st.io_errors = s["timeouts"] + s["connect_errors"] + s["server_errors"] + s["auth_errors"] + s["oom_errors"]
        st.spills_in_flight = self._queued_blocks
        st.notes = {"breakers": ",".join(f"{a}={b}" for a, b in breakers.items()), "publish_on": self.publish_on,
                    "dropped_oldest": str(self.dropped_oldest), "skipped_known": str(self.skipped_known),
                    "skipped_held": str(self.skipped_held),
                    "probes_dropped": str(self.probes_dropped), "probes_done": str(self.probes_done)}
        return st

    def close(self) -> None:
        with self._cv:
            self._stop = True
            self._cv.notify_all()
        if self.publish_gate is not None:
            self.publish_gate.set()
        if self._publisher.is_alive():
            self._publisher.join(timeout=30)
        self._io.close()
        self._probes.close()
        self.store.close()
