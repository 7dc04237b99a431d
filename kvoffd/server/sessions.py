"""Who is connected: client connections, the engine workers they registered, leases, liveness.

A connection is a ZeroMQ routing id that said HELLO. An engine belongs to the connection that
registered it; only that connection may submit jobs for it. Liveness comes from two sources: a pidfd
on the client's process (instant, when the daemon can see that pid and its start time matches:
kvoffd/server/pidwatch.py) and heartbeats (any message; clients ping every few seconds) for
everything else. A lease holds index entries (refs) for a LOOKUP's hits until a LOAD consumes it, a
RELEASE drops it or it expires.

Handlers here answer through the ``reply`` callable the server hands over and never import the
server loop (kvoffd/server/loop.py owns the socket).
"""

from __future__ import annotations

import asyncio
import enum
import hmac
import itertools
import logging
import os
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from kvoffd.cache.keyspace import Entry, Keyspace, Table
from kvoffd.metrics import Metrics
from kvoffd.server.fdbudget import FdBudget
from kvoffd.server.fdserver import FdServer
from kvoffd.server.limits import (
    HEARTBEAT_S,
    IDLE_CONN_S,
    MAX_CONNS,
    MAX_JOBS_PER_CONN,
    MAX_LEASED_KEYS,
    MAX_LEASED_KEYS_PER_CONN,
    MAX_LEASES_PER_CONN,
    QUIET_CONN_S,
    ROOM_SCAN_EVERY_S,
    STALL_S,
    VERSION_WARN_EVERY_S,
)
from kvoffd.server.pidwatch import PidWatcher
from kvoffd.server.placement import Placement
from kvoffd.transfer.base import MappedMemory, TransferBackend
from kvoffd_client import protocol as P
from kvoffd_client.protocol import ErrorCode, ProtocolError

log = logging.getLogger(__name__)

Reply = Callable[[bytes, P.Message], None]

#: why the daemon dropped a connection, told in reply to its next message (the last 4 x MAX_CONNS)
DROPPED_SILENT = "the daemon dropped this connection after it was silent a while; send HELLO again"
DROPPED_FOR_ROOM = (f"the daemon dropped this connection to make room ({MAX_CONNS} connections open, and this "
                    "one had sent nothing after HELLO or was silent); send HELLO again")


class Departure(enum.Enum):
    """Why an engine left. Behaviour depends on it: an engine that is gone (its process, its
    connection) never fires its events, so its waiting jobs are failed; one that unregistered or
    was replaced by a new registration keeps its jobs until they end."""

    UNREGISTERED = "unregistered"
    REPLACED = "replaced"  # registered again (a new mapping): the namespace is in use still
    EXITED = "exited"  # the client's process exited (pidfd)
    TIMED_OUT = "timed_out"  # silent past --engine-timeout
    DISCONNECTED = "disconnected"
    SHUTDOWN = "shutdown"

    @property
    def metric_label(self) -> str:
        """The ``kvoffd_engine_events_total`` label: three departures are told apart there."""
        return self.value if self in (Departure.UNREGISTERED, Departure.TIMED_OUT) else "disconnected"

    @property
    def engine_gone(self) -> bool:
        return self not in (Departure.UNREGISTERED, Departure.REPLACED)


@dataclass
class Conn:
    """One client connection (a routing id that said HELLO) and what it holds."""

    ident: bytes
    pid: int
    client: str
    connected_at: float = field(default_factory=time.time)
    last_seen: float = field(default_factory=time.monotonic)
    engines: set[str] = field(default_factory=set)
    jobs: set[int] = field(default_factory=set)  # client job ids in flight
    leases: set[int] = field(default_factory=set)
    registering: int = 0  # REGISTERs being mapped: counted against the engine bound (pipelined ones too)
    leased_keys: int = 0  # entries its leases hold (bounded: MAX_LEASED_KEYS_PER_CONN)
    watched: bool = False  # registered with the PidWatcher
    active: bool = False  # sent anything after HELLO: a connection that never did is evicted first


@dataclass
class Engine:
    """One registered engine worker: its mapped memory, its backend and the table it writes."""

    engine_id: str
    conn: Conn
    namespace: str
    rank: int
    world_size: int
    mapped: MappedMemory
    backend: TransferBackend
    table: Table
    placement: Placement = field(default_factory=Placement)  # its NUMA node and pool shard
    registered_at: float = field(default_factory=time.time)
    closing: bool = False  # unregistered; detach once its jobs are done
    unmapped: asyncio.Event = field(default_factory=asyncio.Event)  # set once detach is over

    def describe(self) -> dict:
        return {"engine_id": self.engine_id, "namespace": self.namespace, "rank": self.rank,
                "world_size": self.world_size, "pid": self.conn.pid, "client": self.conn.client,
                "backend": self.backend.name, "slot_bytes": self.mapped.slot_bytes,
                "num_blocks": self.mapped.num_blocks, "numa_node": self.placement.node,
                "shard": self.placement.shard, "registered_s": round(time.time() - self.registered_at, 3),
                "last_seen_s": round(time.monotonic() - self.conn.last_seen, 3),
                "in_flight": self.mapped.in_flight}


@dataclass
class Lease:
    lease_id: int
    owner: bytes
    expires: float  # monotonic
    by_rank: dict[int, list[Entry]]  # the entries it holds a ref on
    namespace: str


class Sessions:
    """Connections, engines and leases, and the requests that change them (HELLO, UNREGISTER, RELEASE;
    REGISTER's mapping is kvoffd/server/register.py, which ends in ``attach``). The server sets
    ``auth_token`` and ``fd_handover`` when it binds. ``capabilities``: what HELLO_OK lists besides
    the requests and memory kinds every daemon serves (``kv_events`` with --kv-events-address)."""

    def __init__(self, *, daemon_id: str, keyspace: Keyspace, metrics: Metrics, fds: FdBudget,
                 by_kind: dict[str, TransferBackend], engine_timeout_s: float, reply: Reply,
                 capabilities: Sequence[str] = ()) -> None:
        self.daemon_id = daemon_id
        self.keyspace = keyspace
        self.metrics = metrics
        self.fds = fds
        self.by_kind = by_kind
        self.engine_timeout_s = engine_timeout_s
        self._last_expire: float | None = None  # the last housekeeping (``expire``): a gap is a stall
        self.reply = reply
        self.capabilities = tuple(capabilities)
        self.auth_token: bytes | None = None  # tcp:// only: HELLO must carry it
        self.fd_handover: FdServer | None = None  # where engines hand over memory descriptors (cpu_fd, cuda_vmm)
        self.conns: dict[bytes, Conn] = {}
        self.engines: dict[str, Engine] = {}
        self.leases: dict[int, Lease] = {}
        self.leased_keys = 0  # entries held by leases, all connections
        self._lease_ids = itertools.count(1)
        self._pids: PidWatcher | None = None
        self._dropped: dict[bytes, str] = {}  # connections dropped by the daemon -> why (bounded)
        self._fresh: dict[bytes, Conn] = {}  # connections that said nothing after HELLO, oldest first
        self._quiet: deque[Conn] = deque()  # the last scan's proven-silent connections, longest first
        self._next_room_scan = 0.0  # monotonic: a scan for room that found none is not repeated before
        #: the last moment the loop had read every message that had arrived (set by the loop when it
        #: finds its queue empty). Silence is counted up to it, never up to now: a client whose requests
        #: wait behind a burst is not silent, it is waiting to be read.
        self.heard_all_at = time.monotonic()
        self._version_warned = -VERSION_WARN_EVERY_S  # monotonic time of the last version WARNING
        self._version_refused = 0  # HELLOs of another version refused since that WARNING

    # --- HELLO ------------------------------------------------------------------------------------------
    def hello(self, ident: bytes, msg: P.Hello) -> P.Message:
        if msg.version != P.PROTOCOL_VERSION:
            self._warn_version(msg)
            raise ProtocolError(ErrorCode.VERSION_MISMATCH, f"this daemon speaks protocol v{P.PROTOCOL_VERSION}, "
                                f"the client v{msg.version}; upgrade the older side", seq=msg.seq)
        if not self.token_ok(msg.token):
            raise ProtocolError(ErrorCode.UNAUTHORIZED, "this daemon serves tcp:// to holders of its auth token "
                                "only (--auth-token-file; clients read KVOFFD_AUTH_TOKEN_FILE)", seq=msg.seq)
        conn = self.conns.get(ident)
        if conn is None:
            conn = self._open_conn(ident, msg)
        conn.last_seen = time.monotonic()
        caps = ["lease", "explain", "replicas", "parts", *(f"memory:{k}" for k in self.by_kind), *self.capabilities]
        return P.HelloOk(seq=msg.seq, daemon_id=self.daemon_id, pid=os.getpid(), capabilities=caps,
                         limits={"max_frame_bytes": P.MAX_FRAME_BYTES, "max_keys": P.MAX_KEYS,
                                 "max_jobs": MAX_JOBS_PER_CONN, "key_size": P.KEY_SIZE},
                         heartbeat_s=HEARTBEAT_S,
                         fd_socket=self.fd_handover.path if self.fd_handover is not None else "")

    def token_ok(self, token: str) -> bool:
        """Whether a HELLO's token lets it in (always, but over tcp://)."""
        return self.auth_token is None or hmac.compare_digest(token.encode(), self.auth_token)

    def _open_conn(self, ident: bytes, msg: P.Hello) -> Conn:
        if len(self.conns) >= MAX_CONNS and not self._make_room():
            raise ProtocolError(ErrorCode.TOO_MANY, f"all {MAX_CONNS} connections are in use by clients that "
                                "hold engines, jobs or leases or spoke recently; try again later", seq=msg.seq)
        self._dropped.pop(ident, None)
        conn = self.conns[ident] = self._fresh[ident] = Conn(ident=ident, pid=msg.pid, client=msg.client)
        if self._pids is None:
            self._pids = PidWatcher(asyncio.get_running_loop(), self._on_pid_exit)
        conn.watched = self._pids.watch(ident, msg.pid, msg.start_ticks)
        return conn

    def _warn_version(self, msg: P.Hello) -> None:
        """A client of another protocol version: a WARNING an operator sees (the client is told too),
        at most one per VERSION_WARN_EVERY_S (it retries its HELLO every second)."""
        self._version_refused += 1
        now = time.monotonic()
        if now - self._version_warned < VERSION_WARN_EVERY_S:
            return
        log.warning("client pid %d (%.60s) speaks protocol v%d, this daemon v%d: its HELLO is refused; upgrade "
                    "the older side (%d HELLOs of another version refused since the last such warning)", msg.pid,
                    msg.client, msg.version, P.PROTOCOL_VERSION, self._version_refused)
        self._version_warned = now
        self._version_refused = 0

    def session_of(self, ident: bytes, seq: int) -> Conn:
        """The connection a request comes from; ``hello_required`` (saying why, if the daemon dropped
        it) when there is none. Any request counts as a heartbeat."""
        conn = self.conns.get(ident)
        if conn is None:
            raise ProtocolError(ErrorCode.HELLO_REQUIRED, self._dropped.pop(ident, "send HELLO first"), seq=seq)
        conn.last_seen = time.monotonic()
        if not conn.active:
            conn.active = True
            self._fresh.pop(ident, None)
        return conn

    # --- UNREGISTER -------------------------------------------------------------------------------------
    async def unregister(self, conn: Conn, msg: P.Unregister) -> P.Message:
        """Answered once the engine's jobs ended and its memory is unmapped here: from the OK on the
        daemon never touches that memory again, so the engine may free it (vLLM's sleep mode)."""
        eng = self.engine_of(conn, msg.engine_id, msg.seq)
        self.drop_engine(eng, Departure.UNREGISTERED)
        await eng.unmapped.wait()
        return P.Ok(seq=msg.seq)

    def attach(self, eng: Engine, old: Engine | None) -> None:
        """A registration whose memory is mapped: the engine replaces ``old`` (only now that the new
        mapping works) and may submit jobs from here on."""
        if old is not None:
            self.drop_engine(old, Departure.REPLACED)
        self.engines[eng.engine_id] = eng
        eng.conn.engines.add(eng.engine_id)
        self.fds.took(1)  # the mapping may keep a descriptor; the next measurement knows
        self.metrics.engine_events.labels("registered").inc()

    def engine_of(self, conn: Conn, engine_id: str, seq: int, job_id: int | None = None) -> Engine:
        """The engine, if this connection registered it (a refused job's ERROR names the job, so the
        client can fail it at once)."""
        eng = self.engines.get(engine_id)
        if eng is None:
            raise ProtocolError(ErrorCode.NOT_REGISTERED, f"engine {engine_id!r} is not registered", seq=seq,
                                job_id=job_id)
        if eng.conn is not conn:
            raise ProtocolError(ErrorCode.FOREIGN_ENGINE, f"engine {engine_id!r} belongs to another connection",
                                seq=seq, job_id=job_id)
        return eng

    def drop_engine(self, eng: Engine, why: Departure) -> None:
        """Forget the engine; its cached blocks stay for the next engine of the namespace."""
        if self.engines.get(eng.engine_id) is eng:
            del self.engines[eng.engine_id]
        eng.conn.engines.discard(eng.engine_id)
        if eng.closing:
            return
        eng.closing = True
        self.metrics.engine_events.labels(why.metric_label).inc()
        log.info("engine %s left (%s)", eng.engine_id, why.value)
        if why.engine_gone and eng.mapped.in_flight:
            n = eng.backend.abort(eng.mapped)  # a dead engine's events never fire
            if n:
                log.info("engine %s: failed %d jobs still waiting for its events", eng.engine_id, n)
        if eng.mapped.in_flight == 0:
            self.detach(eng)
        if why is not Departure.REPLACED and not any(e.namespace == eng.namespace for e in self.engines.values()):
            self.keyspace.forget_if_idle(eng.namespace)  # its world size and layouts bind nobody now

    @staticmethod
    def detach(eng: Engine) -> None:
        """Unmap (in an executor): once the engine left and its last job ended."""
        done = asyncio.get_running_loop().run_in_executor(None, eng.backend.detach, eng.mapped)
        done.add_done_callback(lambda _: eng.unmapped.set())

    # --- leases -----------------------------------------------------------------------------------------
    def check_lease(self, conn: Conn, held: int, seq: int) -> None:
        """Leases are bounded by what they hold (8 bytes per held entry and rank), not only by their
        count: 8,192 leases of 65,536 keys each would be 4 GiB for one connection."""
        if len(conn.leases) >= MAX_LEASES_PER_CONN:
            raise ProtocolError(ErrorCode.TOO_MANY, f"at most {MAX_LEASES_PER_CONN} leases per connection", seq=seq)
        if conn.leased_keys + held > MAX_LEASED_KEYS_PER_CONN:
            raise ProtocolError(ErrorCode.TOO_MANY, f"this connection's leases hold {conn.leased_keys} blocks; "
                                f"at most {MAX_LEASED_KEYS_PER_CONN} (release or load some first)", seq=seq)
        if self.leased_keys + held > MAX_LEASED_KEYS:
            raise ProtocolError(ErrorCode.TOO_MANY, f"leases hold {self.leased_keys} blocks in all; at most "
                                f"{MAX_LEASED_KEYS}", seq=seq)

    def next_lease_id(self) -> int:
        return next(self._lease_ids)

    def add_lease(self, conn: Conn, lease: Lease, held: int) -> None:
        """Record a lease whose refs the index has just taken (``Answer.after_reply``, kvoffd/cache/keyspace.py)."""
        self.leases[lease.lease_id] = lease
        conn.leases.add(lease.lease_id)
        conn.leased_keys += held
        self.leased_keys += held

    def release(self, conn: Conn, msg: P.Release) -> P.Message | None:
        lease = self.leases.get(msg.lease_id)
        if lease is not None and lease.owner == conn.ident:  # only its owner may drop a lease
            self.drop_lease(msg.lease_id)
        return None  # fire and forget: releasing an unknown, expired or foreign lease changes nothing

    def consume_lease(self, lease_id: int, eng: Engine, first: Entry) -> None:
        """A LOAD that reads blocks a lease holds consumes the engine's rank of it. Another connection
        may (the engine's worker, by design), but naming a lease id alone (no keys, or other keys)
        must not release someone else's lease (lease ids are sequential)."""
        lease = self.leases.get(lease_id)
        held = lease.by_rank.get(eng.rank) if lease is not None and lease.namespace == eng.namespace else None
        if held and any(e is first for e in held):
            self.drop_lease(lease_id, eng.rank)

    def drop_lease(self, lease_id: int, rank: int | None = None) -> None:
        lease = self.leases.get(lease_id)
        if lease is None:
            return
        ranks = list(lease.by_rank) if rank is None else [rank]
        freed = 0
        for r in ranks:
            entries = lease.by_rank.pop(r, ())
            freed += len(entries)
            self.keyspace.release(entries)
        self.leased_keys -= freed
        owner = self.conns.get(lease.owner)
        if owner is not None:
            owner.leased_keys -= freed
        if not lease.by_rank:
            del self.leases[lease_id]
            if owner is not None:
                owner.leases.discard(lease_id)

    # --- liveness ---------------------------------------------------------------------------------------
    def _on_pid_exit(self, ident: bytes) -> None:
        conn = self.conns.get(ident)
        if conn is not None:
            conn.watched = False
            self.close_conn(conn, Departure.EXITED)

    def close_conn(self, conn: Conn, why: Departure = Departure.DISCONNECTED) -> None:
        self.conns.pop(conn.ident, None)
        self._fresh.pop(conn.ident, None)
        if conn.watched and self._pids is not None:
            self._pids.unwatch(conn.ident)
            conn.watched = False
        for eid in list(conn.engines):
            eng = self.engines.get(eid)
            if eng is not None:
                self.drop_engine(eng, why)
        for lid in list(conn.leases):
            self.drop_lease(lid)

    def expire(self, now: float) -> None:
        """Housekeeping: leases past their time, and engines whose client went silent.

        Silence is counted only while the daemon was running: when this housekeeping comes more than
        ``STALL_S`` after the last one, the daemon itself was stopped (SIGSTOP, a suspended VM or
        container, a loop blocked), and its clients' heartbeats are still queued unread. Dropping their
        engines then would end their jobs without a notice: a vLLM holding blocks for a late load until
        the daemon answers it would wait for ever (a frozen daemon, thawed, did exactly that). So the
        stall is credited to every connection, as if their last word came that much later."""
        last, self._last_expire = self._last_expire, now
        if last is not None and now - last > STALL_S:
            stalled = now - last
            log.warning("the daemon did not run for %.1f s (stopped, suspended, or its loop blocked): its "
                        "clients' silence meanwhile is not counted against --engine-timeout", stalled)
            for conn in self.conns.values():
                conn.last_seen = min(now, conn.last_seen + stalled)
        for lid in [lid for lid, lease in self.leases.items() if lease.expires <= now]:
            self.drop_lease(lid)
        for conn in list(self.conns.values()):
            idle = now - conn.last_seen
            if conn.engines and idle > self.engine_timeout_s:
                log.warning("client pid %d silent for %.1f s: unregistering its engines", conn.pid, idle)
                self.close_conn(conn, Departure.TIMED_OUT)

    @staticmethod
    def _holds_nothing(c: Conn) -> bool:
        return not (c.engines or c.jobs or c.leases or c.registering)

    def silence(self, conn: Conn) -> float:
        """How long the connection has provably said nothing: up to ``heard_all_at``, not up to now."""
        return max(0.0, self.heard_all_at - conn.last_seen)

    def reap_idle_conns(self) -> None:
        """Forget connections that hold nothing and said nothing for a while (ZeroMQ does not tell
        the daemon when a peer goes): IDLE_CONN_S, or QUIET_CONN_S once the table is half full.
        Clients heartbeat every few seconds, so a live one is never idle this long. Once a second
        (a scan of the table)."""
        limit = QUIET_CONN_S if len(self.conns) > MAX_CONNS // 2 else IDLE_CONN_S
        for c in [c for c in self.conns.values() if self._holds_nothing(c) and self.silence(c) > limit]:
            self._forget_conn(c, DROPPED_SILENT)

    def _make_room(self) -> bool:
        """One slot for a newcomer when the table is full: the oldest connection that never sent
        anything after HELLO, else the longest-silent one that holds nothing and has provably said
        nothing for QUIET_CONN_S; never one that holds engines, jobs or leases, or spoke recently.
        Found without a scan of the table per HELLO (else a burst of newcomers costs a scan each, and
        the requests of the clients waiting behind them make those look silent): the never-active are
        kept in order, the silent come from one scan at most every ROOM_SCAN_EVERY_S. The "oldest idle"
        alone is the wrong victim: ZeroMQ queues each peer fairly, so in a burst of HELLOs a busy
        client's last message is older than every newcomer's HELLO."""
        if self._fresh:
            self._forget_conn(next(iter(self._fresh.values())), DROPPED_FOR_ROOM)
            return True
        while self._quiet:
            c = self._quiet.popleft()
            if self.conns.get(c.ident) is c and self._holds_nothing(c) and self.silence(c) > QUIET_CONN_S:
                self._forget_conn(c, DROPPED_FOR_ROOM)
                return True
        now = time.monotonic()
        if now < self._next_room_scan:
            return False
        self._next_room_scan = now + ROOM_SCAN_EVERY_S
        quiet = [c for c in self.conns.values() if self._holds_nothing(c) and self.silence(c) > QUIET_CONN_S]
        quiet.sort(key=lambda c: c.last_seen)
        self._quiet = deque(quiet)
        if not self._quiet:
            return False
        self._forget_conn(self._quiet.popleft(), DROPPED_FOR_ROOM)
        return True

    def _forget_conn(self, conn: Conn, why: str) -> None:
        """Close a connection the daemon gave up on, remembering why: its next message is answered
        ``hello_required`` with this reason, so the client can say what happened."""
        self.close_conn(conn)
        self._dropped[conn.ident] = why
        if len(self._dropped) > 4 * MAX_CONNS:
            del self._dropped[next(iter(self._dropped))]

    def shutdown(self) -> None:
        for eng in list(self.engines.values()):
            self.drop_engine(eng, Departure.SHUTDOWN)
        for conn in list(self.conns.values()):
            self.close_conn(conn)
        if self._pids is not None:
            self._pids.close()
