"""``RemoteStore``: the batched operations of the cluster tier, blocking, called from a tier's worker
thread (never the event loop), each bounded by a timeout:

* ``exists``: which keys the store holds (pipelined ``EXISTS`` per shard);
* ``fetch``: GET each block into its destination (a pool slot) and verify it; a block is True only when
  its header and checksum (and MAC) matched; a value that failed is deleted from the store;
* ``publish``: SET each block from its source slot (``NX``: blocks are immutable, another node's copy
  is the same bytes), first skipping what the store already has;
* ``delete``.

Rules:
* A batch is split by shard (slot owner) and runs on the shards' lanes in parallel; a shard whose
  breaker is open costs its own keys only, at once. Every result is final when the call returns: a lane
  still inside a GET at the deadline is aborted (its socket shut down) and waited for, so no byte lands
  in a destination after ``fetch`` returned (the late-copy rule).
* MOVED refreshes the slot map and retries on the new owner; ASK retries once on the named node after
  ``ASKING``; TRYAGAIN/CLUSTERDOWN are misses.
* Errors are counted (``stats()``) and logged once per kind and shard until that shard answers again.
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

from kvoffd.cache.tiers.remote.address import Address
from kvoffd.cache.tiers.remote.cluster import Addr, Cluster, Lane, Shard, parse_redirect
from kvoffd.cache.tiers.remote.resp import Broken, RespError, pack
from kvoffd.cache.tiers.remote.slots import key_slot
from kvoffd.cache.tiers.remote.tls import Tls
from kvoffd.cache.tiers.remote.valueformat import HEADER, Codec, store_key

log = logging.getLogger(__name__)

ASKING = pack("ASKING")
# outcomes of one item
OK, MISS, BAD, FAIL, PRESENT = "ok", "miss", "bad", "fail", "present"
_GRACE = 0.25  # how long past the deadline a lane may take to notice it (one system call's wake-up)


@dataclass
class RemoteConfig:
    address: Address
    secret: bytes | None = None
    #: rediss:// only: the CA, client certificate and checked name every connection uses (tls.py's
    #: ``client_tls``); None: the system's CAs and each shard's own host
    tls: Tls | None = None
    read_lanes: int = 1  # connections (threads) per shard for probes and fetches
    write_lanes: int = 1  # ... for publishing (1-2 large SETs in flight each)
    connect_timeout: float = 0.5
    breaker_max_cooldown: float = 0.5  # a shard that came back is tried again within this
    pipeline: int = 32  # EXISTS per round trip, and at most this many GETs in flight ...
    get_window: int = 6 << 20  # ... and about these many bytes of values (at least one value): a GET is
    # sent as each value is read, so the shard never waits for a round trip and has few replies pending
    # (a plain reader of a 3-shard cluster: 32 GETs in flight 0.92-0.94 of one at a time, 2 0.98)
    set_depth: int = 2  # SETs in flight per connection (more makes the server copy behind a big one)
    check_threads: int = 4  # checksum (and MAC) threads: a block is summed while the next ones move (2 held a
    # 3-shard cluster's SET to 0.66-0.67 of raw, 4 to 0.78-0.85: docs/benchmarks.md)


COUNTERS = ("probes", "probe_hits", "fetches", "fetch_hits", "fetch_misses", "fetch_failures",
            "verify_failures", "deleted_bad", "published", "publish_present", "publish_failures",
            "fetch_bytes", "publish_bytes", "oom_errors", "auth_errors", "timeouts", "connect_errors",
            "server_errors", "moved", "ask", "breaker_skips", "refreshes")


class _Redirect:
    __slots__ = ("ask", "slot", "addr")

    def __init__(self, ask: bool, slot: int, addr: Addr):
        self.ask, self.slot, self.addr = ask, slot, addr


class RemoteStore:
    def __init__(self, cfg: RemoteConfig):
        self.cfg = cfg
        self.codec = Codec(cfg.secret)
        self.cluster = Cluster(cfg.address, cfg.read_lanes, cfg.write_lanes, cfg.connect_timeout,
                               cfg.breaker_max_cooldown, on_error=self._error, tls=cfg.tls)
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTERS, 0)
        self._logged: set[tuple[str, Addr]] = set()
        self.reasons: dict[str, int] = {}  # verify failures by reason (header, identity, checksum, mac, length)
        self._checks = concurrent.futures.ThreadPoolExecutor(max(1, cfg.check_threads),
                                                             thread_name_prefix="kvoffd-remote-sum")

    # -- bookkeeping -------------------------------------------------------------------------------

    def _add(self, **kw: int) -> None:
        with self._lock:
            for k, v in kw.items():
                self._counts[k] += v

    def _error(self, kind: str, addr: Addr, text: str) -> None:
        counter = {"auth": "auth_errors", "oom": "oom_errors", "timeout": "timeouts",
                   "connect": "connect_errors"}.get(kind, "server_errors")
        with self._lock:
            self._counts[counter] += 1
            first = (kind, addr) not in self._logged
            self._logged.add((kind, addr))
        if first:
            log.warning("remote tier: %s:%d: %s error: %s (counted; logged once until it answers again)",
                        addr[0], addr[1], kind, text)

    def _answered(self, addr: Addr) -> None:
        with self._lock:
            if self._logged:
                self._logged = {x for x in self._logged if x[1] != addr}

    def stats(self) -> dict[str, int]:
        with self._lock:
            d = dict(self._counts)
        d["refreshes"] = self.cluster.refreshes
        return d

    def breakers(self) -> dict[str, str]:
        return {f"{s.addr[0]}:{s.addr[1]}": s.breaker.state for s in self.cluster.shards()}

    # -- the batch runner --------------------------------------------------------------------------

    def start(self, timeout: float = 2.0) -> bool:
        """Read the slot map; False when no seed answered (the store still works: it retries)."""
        return self.cluster.refresh(time.monotonic() + timeout, min_interval=0.0)

    def _run(self, skeys: Sequence[bytes], write: bool, deadline: float,
             work: Callable[[Lane, list[int], float, bool], dict[int, object]]) -> list[object]:
        n = len(skeys)
        out: list[object] = [FAIL] * n
        if not n:
            return out
        if self.cluster.owner(0) is None:
            self.cluster.refresh(deadline)
        slots = [key_slot(k) for k in skeys]
        todo: dict[tuple[Shard, bool], list[int]] = {}
        for i in range(n):
            sh = self.cluster.owner(slots[i])
            if sh is None:
                continue
            todo.setdefault((sh, False), []).append(i)
        for _round in range(3):
            redirects = self._round(todo, write, deadline, work, out)
            if not redirects:
                break
            todo = {}
            moved = False
            for i, r in redirects.items():
                if r.ask:
                    self._add(ask=1)
                    todo.setdefault((self.cluster.shard(r.addr), True), []).append(i)
                else:
                    self._add(moved=1)
                    moved = True
                    todo.setdefault((self.cluster.moved(r.slot, r.addr), False), []).append(i)
            if moved:
                self.cluster.refresh(deadline)
        return [FAIL if isinstance(o, _Redirect) else o for o in out]

    def _round(self, todo: dict[tuple[Shard, bool], list[int]], write: bool, deadline: float, work,
               out: list[object]) -> dict[int, _Redirect]:
        futs: dict[concurrent.futures.Future, Lane] = {}
        for (sh, asking), idx in todo.items():
            if not sh.breaker.allow():
                self._add(breaker_skips=len(idx))
                continue
            lanes = sh.write_lanes if write else sh.read_lanes
            k = len(lanes)
            parts = [idx[j::k] for j in range(k)] if k > 1 and len(idx) > 1 else [idx]
            for j, part in enumerate(parts):
                if part:
                    ln = lanes[j] if len(parts) > 1 else sh.lane(write)
                    futs[ln.submit(lambda ln, p=part, a=asking: self._task(ln, p, deadline, a, work))] = ln
        if not futs:
            return {}
        done, pending = concurrent.futures.wait(futs, timeout=max(0.0, deadline - time.monotonic()) + _GRACE)
        for f in pending:  # past the deadline inside a system call: cut it, then wait (no late write)
            futs[f].abort()
        if pending:
            concurrent.futures.wait(pending)
        redirects: dict[int, _Redirect] = {}
        for f in futs:
            for i, o in f.result().items():
                if isinstance(o, _Redirect):
                    redirects[i] = o
                out[i] = o
        return redirects

    def _task(self, lane: Lane, idx: list[int], deadline: float, asking: bool, work) -> dict[int, object]:
        """Runs on the lane's thread; never raises."""
        sh = lane.shard
        if time.monotonic() >= deadline:
            self._add(timeouts=1)
            return dict.fromkeys(idx, FAIL)
        try:
            res = work(lane, idx, deadline, asking)
        except RespError as e:  # AUTH refused on connect
            self._error("auth" if e.kind in ("WRONGPASS", "NOAUTH", "ERR") else e.kind.lower(), sh.addr, e.text)
            sh.breaker.failure()
            return dict.fromkeys(idx, FAIL)
        except Broken as e:
            self._error("timeout" if "timed out" in str(e) else "connect", sh.addr, str(e))
            lane.conn.close()
            sh.breaker.failure()
            return dict.fromkeys(idx, FAIL)
        except Exception:  # a bug: a miss, never a crash of the caller
            log.exception("remote tier: a task failed")
            lane.conn.close()
            return dict.fromkeys(idx, FAIL)
        sh.breaker.success()
        self._answered(sh.addr)
        return res

    def _reply_error(self, lane: Lane, r: RespError) -> object:
        if r.kind in ("MOVED", "ASK"):
            red = parse_redirect(r)
            if red is not None:
                return _Redirect(r.kind == "ASK", red[0], red[1])
        kind = {"OOM": "oom", "NOAUTH": "auth", "WRONGPASS": "auth", "NOPERM": "auth"}.get(r.kind, r.kind.lower())
        self._error(kind, lane.shard.addr, r.text)
        return FAIL

    # -- operations --------------------------------------------------------------------------------

    def exists(self, ns_id: bytes, keys: Sequence[bytes], timeout: float) -> np.ndarray:
        skeys = [store_key(ns_id, k) for k in keys]
        pipe = self.cfg.pipeline

        def work(lane: Lane, idx: list[int], deadline: float, asking: bool) -> dict[int, object]:
            conn = lane.ready(deadline)
            res: dict[int, object] = {}
            for c in range(0, len(idx), pipe):
                chunk = idx[c:c + pipe]
                conn.send(b"".join((ASKING if asking else b"") + pack("EXISTS", skeys[i]) for i in chunk), deadline)
                for i in chunk:
                    if asking:
                        conn.reply(deadline)
                    r = conn.reply(deadline)
                    res[i] = self._reply_error(lane, r) if isinstance(r, RespError) else (OK if r == 1 else MISS)
            return res

        out = self._run(skeys, False, time.monotonic() + timeout, work)
        hit = np.array([o == OK for o in out], dtype=bool)
        self._add(probes=len(keys), probe_hits=int(hit.sum()))
        return hit

    def fetch(self, ns_id: bytes, keys: Sequence[bytes], dests: Sequence[memoryview], timeout: float) -> np.ndarray:
        """True per block whose verified bytes are in ``dests[i]``; False: a miss (its destination may
        hold garbage and must not be used). Nothing writes into a destination after this returns."""
        skeys = [store_key(ns_id, k) for k in keys]
        pipe, window = self.cfg.pipeline, self.cfg.get_window
        codec = self.codec
        inline = codec.verify_inline

        def work(lane: Lane, idx: list[int], deadline: float, asking: bool) -> dict[int, object]:
            conn = lane.ready(deadline)
            res: dict[int, object] = {}
            checks: list[tuple[int, concurrent.futures.Future]] = []
            bad: list[int] = []
            nbytes = 0
            depth = max(1, min(pipe, window // (HEADER + max(1, len(dests[idx[0]])))))

            def judge(i: int, why: str) -> None:  # a value's verdict: "" is good, else why not
                res[i] = BAD if why else OK
                if why:
                    self._reason(why)
                    bad.append(i)

            sent = 0
            for j, i in enumerate(idx):
                if sent <= j:  # nothing in flight: send a window's worth
                    end = min(len(idx), j + depth)
                    conn.send(b"".join((ASKING if asking else b"") + pack("GET", skeys[k]) for k in idx[sent:end]),
                              deadline)
                    sent = end
                elif sent < len(idx):  # one more, so that ``depth`` are in flight as this one is read
                    k = idx[sent]
                    conn.send((ASKING if asking else b"") + pack("GET", skeys[k]), deadline)
                    sent += 1
                if asking:
                    conn.reply(deadline)
                d = dests[i]
                head = bytearray(HEADER)
                r = conn.bulk_into(memoryview(head), d, deadline)
                if isinstance(r, RespError):
                    res[i] = self._reply_error(lane, r)
                elif r == -1:
                    res[i] = MISS
                elif r != HEADER + len(d):
                    judge(i, "length")
                else:
                    nbytes += r
                    if inline:  # the bytes just received, in this core's cache (Codec.verify_inline)
                        judge(i, codec.verify(head, ns_id, keys[i], d))
                    else:  # summed on a check thread while the next value arrives
                        checks.append((i, self._checks.submit(codec.verify, head, ns_id, keys[i], d)))
            for i, f in checks:
                judge(i, f.result())
            self._add(fetch_bytes=nbytes)
            if bad:  # best effort: a value that failed is never fetched again
                conn.send(b"".join(pack("DEL", skeys[i]) for i in bad), deadline)
                gone = sum(1 for _ in bad if conn.reply(deadline) == 1)
                self._add(deleted_bad=gone)
            return res

        out = self._run(skeys, False, time.monotonic() + timeout, work)
        ok = np.array([o == OK for o in out], dtype=bool)
        self._add(fetches=len(keys), fetch_hits=int(ok.sum()), fetch_misses=sum(1 for o in out if o == MISS),
                  verify_failures=sum(1 for o in out if o == BAD), fetch_failures=sum(1 for o in out if o == FAIL))
        return ok

    def _reason(self, why: str) -> None:
        with self._lock:
            self.reasons[why] = self.reasons.get(why, 0) + 1

    def publish(self, ns_id: bytes, keys: Sequence[bytes], srcs: Sequence[memoryview], timeout: float,
                skip_present: bool = True, sums: Sequence[int] | None = None) -> list[str]:
        """Write each block (``ok``), or find it there (``present``), or not (``fail``). ``srcs`` are only
        read, and not after this returns. ``sums``: each block's ``block_sum`` where known (-1: not),
        read as its header is made (``Codec.header``)."""
        skeys = [store_key(ns_id, k) for k in keys]
        codec = self.codec
        depth = max(1, self.cfg.set_depth)

        def work(lane: Lane, idx: list[int], deadline: float, asking: bool) -> dict[int, object]:
            conn = lane.ready(deadline)
            res: dict[int, object] = {}
            todo = idx
            if skip_present:
                conn.send(b"".join((ASKING if asking else b"") + pack("EXISTS", skeys[i]) for i in idx), deadline)
                todo = []
                for i in idx:
                    if asking:
                        conn.reply(deadline)
                    r = conn.reply(deadline)
                    if isinstance(r, RespError):
                        res[i] = self._reply_error(lane, r)
                    elif r == 1:
                        res[i] = PRESENT
                    else:
                        todo.append(i)
            inflight: list[int] = []
            nbytes = 0
            heads = [self._checks.submit(codec.header, ns_id, keys[i], srcs[i], -1 if sums is None else sums[i])
                     for i in todo]

            def land() -> None:
                nonlocal nbytes
                j = inflight.pop(0)
                if asking:
                    conn.reply(deadline)
                r = conn.reply(deadline)
                if isinstance(r, RespError):
                    res[j] = self._reply_error(lane, r)
                elif r is None:
                    res[j] = PRESENT  # NX: another node wrote it meanwhile
                else:
                    res[j] = OK
                    nbytes += HEADER + len(srcs[j])

            for i, head in zip(todo, heads, strict=True):
                src = srcs[i]
                k = skeys[i]
                cmd = b"*4\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(k), k, HEADER + len(src))
                parts = [cmd, head.result(), src, b"\r\n$2\r\nNX\r\n"]
                if asking:
                    parts.insert(0, ASKING)
                conn.send_parts(parts, deadline)
                inflight.append(i)
                if len(inflight) >= depth:
                    land()
            while inflight:
                land()
            self._add(publish_bytes=nbytes)
            return res

        out = self._run(skeys, True, time.monotonic() + timeout, work)
        res = [o if o in (OK, PRESENT) else FAIL for o in out]
        self._add(published=res.count(OK), publish_present=res.count(PRESENT), publish_failures=res.count(FAIL))
        return res

    def delete(self, ns_id: bytes, keys: Sequence[bytes], timeout: float) -> int:
        skeys = [store_key(ns_id, k) for k in keys]

        def work(lane: Lane, idx: list[int], deadline: float, asking: bool) -> dict[int, object]:
            conn = lane.ready(deadline)
            conn.send(b"".join((ASKING if asking else b"") + pack("DEL", skeys[i]) for i in idx), deadline)
            res: dict[int, object] = {}
            for i in idx:
                if asking:
                    conn.reply(deadline)
                r = conn.reply(deadline)
                res[i] = self._reply_error(lane, r) if isinstance(r, RespError) else (OK if r == 1 else MISS)
            return res

        return sum(1 for o in self._run(skeys, True, time.monotonic() + timeout, work) if o == OK)

    def close(self) -> None:
        self.cluster.close()
        self._checks.shutdown(wait=True)
