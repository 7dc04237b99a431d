"""The daemon's control loop: ROUTER socket in, validate, dispatch, queue work, notices out.

Everything here runs on one asyncio (uvloop) thread and never blocks: copies run in backends
(threads or CUDA streams), mapping an engine's memory runs in an executor. A client's mistake is
answered with ERROR and changes nothing; only a bug in the daemon reaches the INTERNAL code, and even
that is answered and logged, never fatal.
"""

from __future__ import annotations

import asyncio
import hmac
import itertools
import logging
import os
import socket
import stat
import time
import uuid
import zlib
from collections import deque
from collections.abc import Awaitable, Callable, Coroutine
from typing import Any

import numpy as np
import zmq

from kvoffd import __version__, sdnotify
from kvoffd.cache.index import Entry, Index
from kvoffd.cache.pool import MIN_SLOT_BYTES, Pool
from kvoffd.cache.tiers.manager import PROMOTE_WAIT_S, make_tiers
from kvoffd.config import Config
from kvoffd.metrics import Metrics
from kvoffd.runtime import ensure_private_dir, load_or_create_token
from kvoffd.server.fdbudget import HANDSHAKE_IVL_MS, LISTEN_BACKLOG, FdBudget, ListenerGuard, open_listener
from kvoffd.server.fdserver import FdServer, fd_socket_path, remove_stale_socket
from kvoffd.server.sessions import (
    MAX_ENGINES_PER_CONN,
    MAX_EXPLAIN_KEYS,
    MAX_JOBS_PER_CONN,
    MAX_LEASED_KEYS,
    MAX_LEASED_KEYS_PER_CONN,
    MAX_LEASES_PER_CONN,
    MAX_RUNS_PER_JOB,
    MAX_SEGMENTS,
    MAX_UNREAD_REPLY_BYTES,
    MAX_UNREAD_REPLY_BYTES_PER_PEER,
    TRACKED_REPLY_BYTES,
    Conn,
    Engine,
    Lease,
    PidWatcher,
)
from kvoffd.transfer.base import AttachError, Direction, JobExpired, TransferBackend, past
from kvoffd.transfer.cpu import CpuBackend
from kvoffd_client import protocol as P
from kvoffd_client.protocol import ErrorCode, ProtocolError

log = logging.getLogger(__name__)

# plain ints: pyzmq's flag enums cost microseconds per ``&``, several times per message
_EVENTS, _POLLIN, _NOBLOCK, _RCVMORE = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK), int(zmq.RCVMORE)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK

HEARTBEAT_S = 2.0
IDLE_CONN_S = 600.0
#: client connections known at once. KVOFFD_TEST_MAX_CONNS lowers it, for tests only (a burst past the
#: bound then needs hundreds of sockets, not thousands).
MAX_CONNS = int(os.environ.get("KVOFFD_TEST_MAX_CONNS", "4096"))
QUIET_CONN_S = 3 * HEARTBEAT_S  # a connection silent this long is no longer protected from eviction
#: why the daemon dropped a connection, told in reply to its next message (the last 4 x MAX_CONNS)
DROPPED_SILENT = "the daemon dropped this connection after it was silent a while; send HELLO again"
DROPPED_FOR_ROOM = (f"the daemon dropped this connection to make room ({MAX_CONNS} connections open, and this "
                    "one had sent nothing after HELLO or was silent); send HELLO again")
VERSION_WARN_EVERY_S = 60.0  # HELLOs of another protocol version: one WARNING per interval
HOUSEKEEPING_S = 0.1
HARD_FRAME_LIMIT = 2 * P.MAX_FRAME_BYTES  # libzmq drops the peer above this; between the two: ERROR
RCVHWM = 100  # messages queued per peer; bounds a flooding client's memory
DRAIN_BATCH = 256  # messages handled per loop callback


class AddressInUse(RuntimeError):
    pass


def _failed_future(exc: BaseException) -> asyncio.Future:
    fut = asyncio.get_running_loop().create_future()
    fut.set_exception(exc)
    return fut


def _make_backends(cfg: Config, pool: Pool) -> list[TransferBackend]:
    backends: list[TransferBackend] = []
    if cfg.backend in ("auto", "cuda"):
        try:
            from kvoffd.transfer.cuda import CudaBackend, cuda_available
        except ImportError as e:
            if cfg.backend == "cuda":
                raise RuntimeError(f"--backend cuda: the CUDA backend cannot load ({e})") from None
        else:
            if cuda_available():
                backends.append(CudaBackend(pool))
            elif cfg.backend == "cuda":
                raise RuntimeError("--backend cuda: no CUDA device is visible")
    if cfg.backend in ("auto", "cpu"):
        backends.append(CpuBackend(pool, cfg.copy_threads))
    return backends


class Daemon:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.daemon_id = uuid.uuid4().hex
        self.started = time.time()
        self.pool = Pool(cfg.pool_size)
        self.index = Index(self.pool, cfg.eviction_policy)
        self.tiers = make_tiers(self.index, cfg.disk_path, cfg.disk_size, cfg.verify)  # below the pool
        self.backends = _make_backends(cfg, self.pool)
        self.by_kind: dict[str, TransferBackend] = {}
        for b in self.backends:
            for k in b.kinds():
                self.by_kind.setdefault(k, b)
        self.conns: dict[bytes, Conn] = {}
        self.engines: dict[str, Engine] = {}
        self.leases: dict[int, Lease] = {}
        self._lease_ids = itertools.count(1)
        self._jobs: dict[int, tuple[str, float]] = {}  # internal id -> (direction, started monotonic)
        self._job_ids = itertools.count(1)
        self._tasks: set[asyncio.Task] = set()
        self._pids: PidWatcher | None = None
        self._last_reap = 0.0
        self._dropped: dict[bytes, str] = {}  # connections dropped by the daemon -> why (bounded)
        self._version_warned = -VERSION_WARN_EVERY_S  # monotonic time of the last version WARNING
        self._version_refused = 0  # HELLOs of another version refused since that WARNING
        self.metrics = Metrics(__version__, self._live_state, self.tier_stats)
        self.ready = asyncio.Event()
        self._stopping = asyncio.Event()
        self._ctx = zmq.Context.instance()
        self.sock: zmq.Socket | None = None
        self.bound_address = ""
        self.fd_handover: FdServer | None = None  # where CPU engines hand over their memory (cpu_fd)
        self._auth_token: bytes | None = None  # tcp:// only: HELLO must carry it
        self.metrics_address = cfg.metrics_address  # the cli sets the bound one (port 0 picks a port)
        self.fds = FdBudget()
        self._guard: ListenerGuard | None = None
        self._listener: socket.socket | None = None  # the ZeroMQ listener's socket, owned here
        self._zmq_fd = -1  # libzmq's duplicate of it
        self._socket_ino = 0  # the ipc socket file this daemon made (removed at stop only if still it)
        self._leased_keys = 0  # entries pinned by leases, all connections
        self._unread: dict[bytes, deque[tuple[zmq.MessageTracker, int]]] = {}  # big replies not yet sent
        self._unread_bytes = 0
        self._handlers: dict[P.Op, Callable[[Conn, Any], P.Message | None]] = {
            P.Op.UNREGISTER: self._unregister,
            P.Op.LOOKUP: self._lookup,
            P.Op.RELEASE: self._release,
            P.Op.STORE: self._store,
            P.Op.LOAD: self._load,
            P.Op.STATS: self._stats,
            P.Op.CLEAR: self._clear,
            P.Op.PING: lambda c, m: P.Pong(seq=m.seq, daemon_id=self.daemon_id),
            P.Op.EXPLAIN: self._explain,
        }

    # ------------------------------------------------------------------------------------------------
    # socket

    def bind(self) -> str:
        addr = self.cfg.address
        sock = self._ctx.socket(zmq.ROUTER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, HARD_FRAME_LIMIT)
        sock.setsockopt(zmq.RCVHWM, RCVHWM)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted client may reuse its routing id
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)  # a connect that never speaks costs an fd briefly
        sock.copy_threshold = 0  # big replies are sent zero-copy and tracked (see _send_tracked)
        if addr.startswith("ipc://"):
            self._prepare_ipc_path(addr[6:])
        elif addr.startswith("tcp://"):  # any local user can connect: only token holders may talk
            self._auth_token = load_or_create_token(self.cfg.auth_token_file)
            if addr.startswith("tcp://["):
                sock.setsockopt(zmq.IPV6, 1)
        self._listener = open_listener(addr, LISTEN_BACKLOG)
        if addr.startswith("ipc://"):
            self._socket_ino = os.lstat(addr[6:]).st_ino
        if self._listener is not None:  # libzmq gets a duplicate: the guard can point it elsewhere
            self._zmq_fd = os.dup(self._listener.fileno())
            sock.setsockopt(zmq.USE_FD, self._zmq_fd)
            if addr.startswith("tcp://"):  # the port the listener got (port 0 picks one)
                addr = f"{addr.rpartition(':')[0]}:{self._listener.getsockname()[1]}"
        sock.bind(addr)
        self.sock = sock
        self.bound_address = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if "cpu_fd" in self.by_kind:
            self._bind_fd_socket()
        return self.bound_address

    def _bind_fd_socket(self) -> None:
        """The UNIX socket CPU engines pass their memfd on: beside the ipc socket (same checks), or in
        the token file's private directory for tcp://. Its path goes out in HELLO_OK."""
        path = fd_socket_path(self.bound_address, os.path.dirname(self.cfg.auth_token_file) or ".")
        ensure_private_dir(os.path.dirname(path) or ".")
        remove_stale_socket(path)  # the ZeroMQ bind above proved no daemon serves this address
        self.fd_handover = FdServer(path)

    def _unlink_own_socket(self, path: str) -> None:
        """Remove our socket file, unless it is no longer ours: a newer daemon that took the path over
        (after an operator removed ours) must not lose its socket when this one stops."""
        try:
            if os.lstat(path).st_ino == self._socket_ino:
                os.unlink(path)
        except OSError:
            pass  # already gone (removed by an operator)

    @staticmethod
    def _prepare_ipc_path(path: str) -> None:
        """Refuse a directory another user owns or can write (kvoffd.runtime), a live socket, and a
        path that is not a socket at all (never delete an operator's file); clear a stale socket."""
        ensure_private_dir(os.path.dirname(path) or ".")
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            return
        if not stat.S_ISSOCK(st.st_mode):
            raise AddressInUse(f"{path} exists and is not a socket; choose another --address")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(path)
        except OSError:
            os.unlink(path)  # a stale socket from a daemon that died
        else:
            raise AddressInUse(f"another daemon is serving on {path}")
        finally:
            probe.close()

    # ------------------------------------------------------------------------------------------------
    # main loop

    async def serve(self, on_ready: Callable[[], None] | None = None) -> None:
        loop = asyncio.get_running_loop()
        if self.sock is None:
            self.bind()
        for b in self.backends:
            b.start()
        self.tiers.start(loop)
        if self.fd_handover is not None:
            self.fd_handover.start(loop)
        fd = self.sock.getsockopt(zmq.FD)
        loop.add_reader(fd, self._drain)
        self._guard = ListenerGuard(self._ctx, self.sock, self._listener, self._zmq_fd, self.fds)
        loop.add_reader(self._guard.fd, self._drain_monitor)
        self._drain_monitor()  # edge-triggered like the ROUTER's fd: take what is queued already
        house = asyncio.create_task(self._housekeeping())
        self.ready.set()
        log.info("kvoffd %s serving on %s: pool %d MiB, backends %s", __version__, self.bound_address,
                 self.pool.nbytes >> 20, ",".join(b.name for b in self.backends))
        if on_ready:
            on_ready()
        self._drain()  # messages that arrived before the reader was installed
        try:
            await self._stopping.wait()
        finally:
            loop.remove_reader(fd)
            loop.remove_reader(self._guard.fd)
            self._guard.close()
            house.cancel()
            await self._shutdown()

    def stop(self) -> None:
        self._stopping.set()

    async def _shutdown(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        for eng in list(self.engines.values()):
            self._drop_engine(eng, "shutdown")
        for conn in list(self.conns.values()):
            self._close_conn(conn)
        if self._pids is not None:
            self._pids.close()
        await self.tiers.aclose()
        for b in self.backends:
            b.close()
        if self.fd_handover is not None:
            self.fd_handover.close()
        if self.sock is not None:
            self.sock.close(0)
            if self._listener is not None:
                self._listener.close()
            if self.bound_address.startswith("ipc://"):
                self._unlink_own_socket(self.bound_address[6:])
        log.info("kvoffd stopped")

    def _drain(self) -> None:
        """Read queued messages. The ZeroMQ fd is edge-triggered, so whatever is left after a batch
        is picked up by a callback scheduled at once: completions and timers run in between, and a
        flooding client cannot hold the loop."""
        sock = self.sock
        recv, getsockopt = sock.recv, sock.getsockopt
        for _ in range(DRAIN_BATCH):
            if not getsockopt(_EVENTS) & _POLLIN:
                return
            try:  # ROUTER: [identity, body]; not recv_multipart, whose flag enums cost more than the rest
                ident = recv(_NOBLOCK)
                body = recv(_NOBLOCK)
            except zmq.Again:
                return
            if getsockopt(_RCVMORE):  # a message arrives whole, so the rest is here: drop it
                extra = 0
                while getsockopt(_RCVMORE):
                    recv(_NOBLOCK)
                    extra += 1
                self._reject(ident, ProtocolError(ErrorCode.BAD_FRAME,
                                                  f"expected one frame per message, got {extra + 1}"))
                continue
            self._on_message(ident, body)
        asyncio.get_running_loop().call_soon(self._drain)

    def _drain_monitor(self) -> None:
        """Connection events: count them, and let the guard stop or resume accepting."""
        if self._guard.drain():
            asyncio.get_running_loop().call_soon(self._drain_monitor)

    def _send(self, ident: bytes, msg: P.Message) -> None:
        sock = self.sock
        data = P.encode(msg)
        if len(data) >= TRACKED_REPLY_BYTES:
            self._send_tracked(ident, msg, data)
            return
        try:
            sock.send(ident, _SNDMORE_NOBLOCK)  # a ROUTER queues both parts or neither
            sock.send(data, _NOBLOCK)
        except zmq.Again:
            log.warning("client %s is not reading; dropped a %s", ident.hex(), msg.op.value)
        except zmq.ZMQError as e:
            log.warning("send to %s failed: %s", ident.hex(), e)
        # a send can consume the fd's edge; make sure pending input is not left unread
        if sock.getsockopt(_EVENTS) & _POLLIN:
            asyncio.get_running_loop().call_soon(self._drain)

    def _send_tracked(self, ident: bytes, msg: P.Message, data: bytes) -> None:
        """A big reply (EXPLAIN, STATS, a notice with a long failed list), counted until libzmq has
        handed it to the kernel. ROUTER's SNDHWM bounds messages, not bytes: a peer that asks and never
        reads would otherwise pile up gigabytes. Past the per-peer or global bound the reply becomes a
        small ``too_many`` ERROR (with the job id for a notice, so the client fails the job at once)."""
        q = self._unread_reclaim(ident)
        pending = sum(n for _, n in q) if q else 0
        if (pending + len(data) > MAX_UNREAD_REPLY_BYTES_PER_PEER
                or self._unread_bytes + len(data) > MAX_UNREAD_REPLY_BYTES):
            self.metrics.errors.labels(ErrorCode.TOO_MANY.value).inc()
            log.warning("client %s: %d bytes of replies unread (%d in all); refused a %d-byte %s", ident.hex(),
                        pending, self._unread_bytes, len(data), msg.op.value)
            self._send(ident, P.Error(seq=msg.seq, code=ErrorCode.TOO_MANY.value, job_id=getattr(msg, "job_id", None),
                                      message=f"{pending} bytes of replies are waiting for this client to read "
                                      f"them; at most {MAX_UNREAD_REPLY_BYTES_PER_PEER}"))
            return
        sock = self.sock
        try:
            sock.send(ident, _SNDMORE_NOBLOCK)
            tracker = sock.send(data, _NOBLOCK, copy=False, track=True)
        except zmq.Again:
            log.warning("client %s is not reading; dropped a %s", ident.hex(), msg.op.value)
        except zmq.ZMQError as e:
            log.warning("send to %s failed: %s", ident.hex(), e)
        else:
            self._unread.setdefault(ident, deque()).append((tracker, len(data)))
            self._unread_bytes += len(data)
        if sock.getsockopt(_EVENTS) & _POLLIN:
            asyncio.get_running_loop().call_soon(self._drain)

    def _unread_reclaim(self, ident: bytes) -> deque | None:
        """Forget the peer's tracked replies that libzmq has sent (or dropped with the peer)."""
        q = self._unread.get(ident)
        if q is None:
            return None
        while q and q[0][0].done:
            self._unread_bytes -= q.popleft()[1]
        if not q:
            del self._unread[ident]
            return None
        return q

    def _reject(self, ident: bytes, e: ProtocolError) -> None:
        self.metrics.errors.labels(e.code.value).inc()
        log.debug("client %s: %s", ident.hex(), e)
        self._send(ident, P.error_for(e))

    def _on_message(self, ident: bytes, body: bytes) -> None:
        seq = 0
        try:
            msg = P.decode(body, requests_only=True)
            seq = msg.seq
            conn = self.conns.get(ident)
            if msg.op is P.Op.HELLO:
                reply = self._hello(ident, msg)
            elif conn is None:
                raise ProtocolError(ErrorCode.HELLO_REQUIRED, self._dropped.pop(ident, "send HELLO first"),
                                    seq=msg.seq)
            else:
                conn.last_seen = time.monotonic()
                conn.active = True
                if msg.op is P.Op.REGISTER:
                    self._spawn(self._register(conn, msg))
                    return
                reply = self._handlers[msg.op](conn, msg)
        except ProtocolError as e:
            self._reject(ident, e)
            return
        except Exception:
            log.exception("internal error handling a message from %s", ident.hex())
            self.metrics.errors.labels(ErrorCode.INTERNAL.value).inc()
            self._send(ident, P.Error(seq=seq, code=ErrorCode.INTERNAL.value,
                                      message="internal error; see the daemon log"))
            return
        if reply is not None:
            self._send(ident, reply)

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)

    # ------------------------------------------------------------------------------------------------
    # connection and engine lifecycle

    def _hello(self, ident: bytes, msg: P.Hello) -> P.Message:
        if msg.version != P.PROTOCOL_VERSION:
            self._warn_version(msg)
            raise ProtocolError(ErrorCode.VERSION_MISMATCH, f"this daemon speaks protocol v{P.PROTOCOL_VERSION}, "
                                f"the client v{msg.version}; upgrade the older side", seq=msg.seq)
        if self._auth_token is not None and not hmac.compare_digest(msg.token.encode(), self._auth_token):
            raise ProtocolError(ErrorCode.UNAUTHORIZED, "this daemon serves tcp:// to holders of its auth token "
                                "only (--auth-token-file; clients read KVOFFD_AUTH_TOKEN_FILE)", seq=msg.seq)
        conn = self.conns.get(ident)
        if conn is None:
            if len(self.conns) >= MAX_CONNS:
                self._reap_idle_conns(force=True)
            if len(self.conns) >= MAX_CONNS:
                raise ProtocolError(ErrorCode.TOO_MANY, f"all {MAX_CONNS} connections are in use by clients that "
                                    "hold engines, jobs or leases or spoke recently; try again later", seq=msg.seq)
            self._dropped.pop(ident, None)
            conn = self.conns[ident] = Conn(ident=ident, pid=msg.pid, client=msg.client)
            if self._pids is None:
                self._pids = PidWatcher(asyncio.get_running_loop(), self._on_pid_exit)
            conn.watched = self._pids.watch(ident, msg.pid, msg.start_ticks)
        conn.last_seen = time.monotonic()
        caps = ["lease", "explain"] + [f"memory:{k}" for k in self.by_kind]
        return P.HelloOk(seq=msg.seq, daemon_id=self.daemon_id, pid=os.getpid(), capabilities=caps,
                         limits={"max_frame_bytes": P.MAX_FRAME_BYTES, "max_keys": P.MAX_KEYS,
                                 "max_jobs": MAX_JOBS_PER_CONN, "key_size": P.KEY_SIZE},
                         heartbeat_s=HEARTBEAT_S,
                         fd_socket=self.fd_handover.path if self.fd_handover is not None else "")

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

    async def _register(self, conn: Conn, msg: P.Register) -> None:
        conn.registering += 1
        try:
            reply = await self._do_register(conn, msg)
        except ProtocolError as e:
            e.seq = msg.seq
            self.metrics.errors.labels(e.code.value).inc()
            log.warning("engine %s: registration refused: %s", msg.engine_id, e.message)
            reply = P.error_for(e)
        finally:
            conn.registering -= 1
        if conn.ident in self.conns:
            self._send(conn.ident, reply)

    async def _do_register(self, conn: Conn, msg: P.Register) -> P.Message:
        if msg.rank >= msg.world_size:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"rank {msg.rank} is not below world_size {msg.world_size}")
        num_blocks, segments = P.parse_layout(msg.layout)
        kind = msg.memory.get("kind")
        backend = self.by_kind.get(kind) if type(kind) is str else None
        if backend is None:
            raise ProtocolError(ErrorCode.MEMORY_UNREACHABLE, f"memory kind {kind!r:.40} is not served here; "
                                f"this daemon maps {sorted(self.by_kind)}")
        old = self.engines.get(msg.engine_id)
        if old is not None and old.conn is not conn and old.conn.ident in self.conns:
            raise ProtocolError(ErrorCode.FOREIGN_ENGINE, f"engine {msg.engine_id!r} is registered by "
                                "another live connection")
        if old is None and len(conn.engines) + conn.registering > MAX_ENGINES_PER_CONN:  # (this one included)
            raise ProtocolError(ErrorCode.TOO_MANY, f"at most {MAX_ENGINES_PER_CONN} engines per connection")
        if len(segments) > MAX_SEGMENTS:
            raise ProtocolError(ErrorCode.TOO_MANY, f"a block of {len(segments)} segments; at most {MAX_SEGMENTS}")
        if self.fds.engines_refused():
            raise ProtocolError(ErrorCode.TOO_MANY, f"the daemon's file descriptors are nearly exhausted "
                                f"({self.fds.in_use()} of {self.fds.limit}); try again later")
        slot_bytes = sum(s.length for s in segments)
        if slot_bytes > self.pool.chunk_bytes:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"a block of {slot_bytes} bytes exceeds the pool's "
                                f"{self.pool.chunk_bytes}-byte chunks")
        if slot_bytes < MIN_SLOT_BYTES:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"a block of {slot_bytes} bytes is below the "
                                f"{MIN_SLOT_BYTES}-byte minimum (the index's bookkeeping would outweigh it)")
        layout_fp = tuple(s.length for s in segments)
        try:  # checked now, created only once the memory is mapped: a refused REGISTER leaves nothing
            self.index.check_table(msg.namespace, msg.rank, msg.world_size, layout_fp)
        except ValueError as e:
            raise ProtocolError(ErrorCode.LAYOUT_MISMATCH, str(e)) from None
        memory = self._claim_memory(msg.memory) if kind == "cpu_fd" else msg.memory
        loop = asyncio.get_running_loop()
        try:
            mapped = await loop.run_in_executor(None, backend.attach, msg.engine_id, memory, num_blocks,
                                                segments)
        except AttachError as e:
            raise ProtocolError(ErrorCode.MEMORY_UNREACHABLE, str(e)) from None
        try:
            if conn.ident not in self.conns:
                raise ProtocolError(ErrorCode.NOT_REGISTERED, "the connection closed while mapping")
            current = self.engines.get(msg.engine_id)
            if current is not old:
                raise ProtocolError(ErrorCode.NOT_REGISTERED, "the engine was registered again meanwhile")
            try:
                table = self.index.table(msg.namespace, msg.rank, msg.world_size, slot_bytes, layout_fp)
            except ValueError as e:
                raise ProtocolError(ErrorCode.LAYOUT_MISMATCH, str(e)) from None
        except ProtocolError:
            await loop.run_in_executor(None, backend.detach, mapped)
            raise
        if old is not None:  # a re-registration replaces the engine only now that the new one works
            self._drop_engine(old, "replaced")
        eng = Engine(engine_id=msg.engine_id, conn=conn, namespace=msg.namespace, rank=msg.rank,
                     world_size=msg.world_size, mapped=mapped, backend=backend, table=table)
        self.engines[msg.engine_id] = eng
        conn.engines.add(msg.engine_id)
        self.fds.took(1)  # the mapping may keep a descriptor; the next measurement knows
        self.metrics.engine_events.labels("registered").inc()
        log.info("engine %s registered: pid %d, namespace %s rank %d/%d, %d blocks of %d bytes (%s, %s)",
                 msg.engine_id, conn.pid, msg.namespace, msg.rank, msg.world_size, num_blocks, slot_bytes,
                 backend.name, msg.layout.get("desc", "") if isinstance(msg.layout.get("desc"), str) else "")
        return P.Registered(seq=msg.seq, engine_id=msg.engine_id, slot_bytes=slot_bytes, backend=backend.name)

    def _claim_memory(self, memory: dict[str, Any]) -> dict[str, Any]:
        """A ``cpu_fd`` REGISTER: the descriptor handed to the fd socket under the token. The backend
        gets a dict built here (never the client's, which could carry an ``fd`` of its own choosing)
        and closes the descriptor whatever happens."""
        token, size = memory.get("token"), memory.get("size")
        if type(token) is not str or not 0 < len(token) <= 64:
            raise ProtocolError(ErrorCode.BAD_FIELD, "memory.token must be the string the fd socket answered")
        if type(size) is not int or size <= 0:
            raise ProtocolError(ErrorCode.BAD_FIELD, "memory.size must be a positive integer")
        pending = self.fd_handover.claim(token) if self.fd_handover is not None else None
        if pending is None:
            raise ProtocolError(ErrorCode.MEMORY_UNREACHABLE, "unknown or expired memory token: hand the "
                                "descriptor to the fd socket again (a token is good for one REGISTER)")
        return {"kind": "cpu_fd", "fd": pending.fd, "size": size}

    def _unregister(self, conn: Conn, msg: P.Unregister) -> P.Message:
        eng = self._engine_of(conn, msg.engine_id, msg.seq)
        self._drop_engine(eng, "unregistered")
        return P.Ok(seq=msg.seq)

    def _drop_engine(self, eng: Engine, why: str) -> None:
        """Forget the engine; its cached blocks stay for the next engine of the namespace."""
        if self.engines.get(eng.engine_id) is eng:
            del self.engines[eng.engine_id]
        eng.conn.engines.discard(eng.engine_id)
        if eng.closing:
            return
        eng.closing = True
        event = {"unregistered": "unregistered", "timed_out": "timed_out"}.get(why, "disconnected")
        self.metrics.engine_events.labels(event).inc()
        log.info("engine %s left (%s)", eng.engine_id, why)
        if why not in ("unregistered", "replaced") and eng.mapped.in_flight:
            n = eng.backend.abort(eng.mapped)  # a dead engine's events never fire
            if n:
                log.info("engine %s: failed %d jobs still waiting for its events", eng.engine_id, n)
        if eng.mapped.in_flight == 0:
            self._detach(eng)
        if why != "replaced" and not any(e.namespace == eng.namespace for e in self.engines.values()):
            self.index.forget_if_idle(eng.namespace)  # its world size and layouts bind nobody now

    def _detach(self, eng: Engine) -> None:
        asyncio.get_running_loop().run_in_executor(None, eng.backend.detach, eng.mapped)

    def _on_pid_exit(self, ident: bytes) -> None:
        conn = self.conns.get(ident)
        if conn is not None:
            conn.watched = False
            self._close_conn(conn, "exited")

    def _close_conn(self, conn: Conn, why: str = "disconnected") -> None:
        self.conns.pop(conn.ident, None)
        if conn.watched and self._pids is not None:
            self._pids.unwatch(conn.ident)
            conn.watched = False
        for eid in list(conn.engines):
            eng = self.engines.get(eid)
            if eng is not None:
                self._drop_engine(eng, why)
        for lid in list(conn.leases):
            self._drop_lease(lid)

    async def _housekeeping(self) -> None:
        watchdog_s = sdnotify.watchdog_interval()
        last_watchdog = 0.0
        while True:
            await asyncio.sleep(HOUSEKEEPING_S)
            try:
                now = time.monotonic()
                if watchdog_s and now - last_watchdog >= watchdog_s:
                    sdnotify.watchdog()  # from the loop itself: a stalled loop stops the pings
                    last_watchdog = now
                for lid in [lid for lid, lease in self.leases.items() if lease.expires <= now]:
                    self._drop_lease(lid)
                for conn in list(self.conns.values()):
                    idle = now - conn.last_seen
                    if conn.engines and idle > self.cfg.engine_timeout_s:
                        log.warning("client pid %d silent for %.1f s: unregistering its engines", conn.pid, idle)
                        self._close_conn(conn, "timed_out")
                if now - self._last_reap > 1.0:
                    self._reap_idle_conns()
                    self._last_reap = now
                    self.fds.calibrate()
                    for ident in list(self._unread):
                        self._unread_reclaim(ident)
                self._guard.check()
            except Exception:
                log.exception("housekeeping failed")

    def _reap_idle_conns(self, force: bool = False) -> None:
        """Forget connections that hold nothing and said nothing for a while (ZeroMQ does not tell
        the daemon when a peer goes). Clients heartbeat every few seconds, so a live one is never
        idle this long. When the table is full (``force``), room is made by evicting connections
        that never sent anything after HELLO, then the longest-silent of those silent past
        QUIET_CONN_S; never one that holds engines, jobs or leases, or spoke recently. The "oldest
        idle" alone is the wrong victim: ZeroMQ queues each peer fairly, so in a burst of HELLOs
        the busy client's last message is older than every newcomer's HELLO."""
        now = time.monotonic()
        empty = [c for c in self.conns.values() if not (c.engines or c.jobs or c.leases or c.registering)]
        limit = IDLE_CONN_S
        if force or len(self.conns) > MAX_CONNS // 2:
            limit = min(limit, QUIET_CONN_S)
        for c in empty:
            if now - c.last_seen > limit:
                self._forget_conn(c, DROPPED_SILENT)
        if not force or len(self.conns) < MAX_CONNS:
            return
        victims = [c for c in empty if c.ident in self.conns and (not c.active or now - c.last_seen > QUIET_CONN_S)]
        victims.sort(key=lambda c: (c.active, c.last_seen))
        for c in victims[: len(self.conns) - MAX_CONNS + 1]:
            self._forget_conn(c, DROPPED_FOR_ROOM)

    def _forget_conn(self, conn: Conn, why: str) -> None:
        """Close a connection the daemon gave up on, remembering why: its next message is answered
        ``hello_required`` with this reason, so the client can say what happened."""
        self._close_conn(conn)
        self._dropped[conn.ident] = why
        if len(self._dropped) > 4 * MAX_CONNS:
            del self._dropped[next(iter(self._dropped))]

    # ------------------------------------------------------------------------------------------------
    # lookups and leases

    def _lookup(self, conn: Conn, msg: P.Lookup) -> P.Message | None:
        """Answer first, then count and pin: the client waits on the answer, and nothing else runs on
        the loop in between, so no eviction can take a block the answer promised."""
        n, by_rank, reason = self.index.leading_hits(msg.namespace, msg.keys, want_entries=msg.lease_ms > 0)
        if self.tiers.enabled and n < P.count_keys(msg.keys):  # blocks below the pool are hits too: their
            n, by_rank, reason = self.tiers.extend_lookup(msg.namespace, msg.keys, n, by_rank, reason)  # promotion starts now
        ns = self.index.namespaces.get(msg.namespace)
        lease_id = 0
        pinned = 0
        if n and msg.lease_ms:
            if len(conn.leases) >= MAX_LEASES_PER_CONN:
                raise ProtocolError(ErrorCode.TOO_MANY, f"at most {MAX_LEASES_PER_CONN} leases per connection",
                                    seq=msg.seq)
            pinned = sum(len(v) for v in by_rank.values())
            self._check_leased_keys(conn, pinned, msg.seq)
            lease_id = next(self._lease_ids)
        self._send(conn.ident, P.LookupResult(seq=msg.seq, hits=n, lease_id=lease_id,
                                              world_size=ns.world_size if ns else 0))
        if lease_id:
            for entries in by_rank.values():
                for e in entries:
                    e.pins += 1  # a pin (see Index): thousands per step
            self.leases[lease_id] = Lease(lease_id, conn.ident, time.monotonic() + msg.lease_ms / 1000, by_rank,
                                          msg.namespace)
            conn.leases.add(lease_id)
            conn.leased_keys += pinned
            self._leased_keys += pinned
        counts = self.metrics.lookup
        counts.lookups += 1
        counts.hit_blocks += n
        missed = P.count_keys(msg.keys) - n
        if missed:
            counts.miss_blocks += missed
            self.metrics.misses.labels(reason).inc(missed)
        return None

    def _check_leased_keys(self, conn: Conn, pinned: int, seq: int) -> None:
        """Leases are bounded by what they hold (8 bytes per pinned entry and rank), not by their
        count: 8,192 leases of 65,536 keys each would be 4 GiB for one connection."""
        if conn.leased_keys + pinned > MAX_LEASED_KEYS_PER_CONN:
            raise ProtocolError(ErrorCode.TOO_MANY, f"this connection's leases hold {conn.leased_keys} blocks; "
                                f"at most {MAX_LEASED_KEYS_PER_CONN} (release or load some first)", seq=seq)
        if self._leased_keys + pinned > MAX_LEASED_KEYS:
            raise ProtocolError(ErrorCode.TOO_MANY, f"leases hold {self._leased_keys} blocks in all; at most "
                                f"{MAX_LEASED_KEYS}", seq=seq)

    def _release(self, conn: Conn, msg: P.Release) -> P.Message | None:
        lease = self.leases.get(msg.lease_id)
        if lease is not None and lease.owner == conn.ident:  # only its owner may drop a lease
            self._drop_lease(msg.lease_id)
        return None  # fire and forget: releasing an unknown, expired or foreign lease changes nothing

    def _drop_lease(self, lease_id: int, rank: int | None = None) -> None:
        lease = self.leases.get(lease_id)
        if lease is None:
            return
        ranks = list(lease.by_rank) if rank is None else [rank]
        freed = 0
        for r in ranks:
            entries = lease.by_rank.pop(r, ())
            freed += len(entries)
            for e in entries:
                self.index.unpin(e)
        self._leased_keys -= freed
        owner = self.conns.get(lease.owner)
        if owner is not None:
            owner.leased_keys -= freed
        if not lease.by_rank:
            del self.leases[lease_id]
            if owner is not None:
                owner.leases.discard(lease_id)

    # ------------------------------------------------------------------------------------------------
    # jobs

    def _engine_of(self, conn: Conn, engine_id: str, seq: int, job_id: int | None = None) -> Engine:
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

    def _check_job(self, conn: Conn, msg: P.Store | P.Load) -> tuple[Engine, list[bytes], np.ndarray]:
        eng = self._engine_of(conn, msg.engine_id, msg.seq, msg.job_id)
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
        if msg.event >= 0 and msg.event >= eng.mapped.extra.get("num_events", 0):
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

    def _store(self, conn: Conn, msg: P.Store) -> P.Message | None:
        eng, keys, ids = self._check_job(conn, msg)
        evicted = self.index.evictions
        plan = self.index.plan(eng.table, keys)
        want, slot_list, present, dropped = plan.want, plan.slots, plan.present, plan.dropped
        m = self.metrics
        if self.index.evictions != evicted:
            m.evicted_blocks.inc(self.index.evictions - evicted)
        if present:
            m.store_noop_blocks.inc(present)
        if dropped:
            m.dropped_stores.labels("pool_full").inc(len(dropped))
        if plan.refused:  # reported with the dropped ones: not stored, nothing copied
            m.admission_refused.inc(len(plan.refused))
            dropped = sorted(dropped + plan.refused)
        code = "pool_full" if plan.dropped else "not_admitted" if plan.refused else ""
        if not want:
            return P.Notice(seq=msg.seq, job_id=msg.job_id, ok=not dropped, failed=dropped, code=code)
        t0 = time.monotonic()
        slots = np.array(slot_list, dtype=np.int64)
        try:  # the copy starts first; the per-key bookkeeping below runs while the bytes move
            fut = eng.backend.submit(Direction.STORE, eng.mapped, ids[want], slots, msg.event, msg.expires_ns)
        except Exception as e:
            fut = _failed_future(e)
        entries = self.index.add_pending(eng.table, keys, want, slot_list)
        jid = self._begin_job(conn, eng, msg.job_id, "store", t0)
        self._spawn(self._finish_store(conn, eng, msg, jid, want, entries, fut, dropped, code, t0))
        return None

    async def _finish_store(self, conn: Conn, eng: Engine, msg: P.Store, jid: int, idx: list[int],
                            entries: list[Entry], fut: Awaitable[None], dropped: list[int], code: str,
                            t0: float) -> None:
        try:
            await fut
        except asyncio.CancelledError:
            self.index.abort(entries)
            self._end_job(conn, eng, msg.job_id, jid)
            raise
        except Exception as e:
            code = self._job_failed("store", msg.job_id, eng, e)
            self._end_job(conn, eng, msg.job_id, jid)
            self._notice(conn, msg.job_id, sorted(dropped + idx), code, str(e)[:200])
            self.index.abort(entries)  # a partial (or expired) store is never committed
            self.metrics.dropped_stores.labels("failed").inc(len(entries))
            return
        if self.cfg.verify:
            sums = await asyncio.get_running_loop().run_in_executor(None, self._checksums, entries)
            for e, c in zip(entries, sums, strict=True):
                e.checksum = c
        self._end_job(conn, eng, msg.job_id, jid)
        # The engine may reuse its blocks from now on: tell it before the bookkeeping. Nothing can
        # interleave between the notice and the commit (same loop callback), so a lookup that follows
        # the notice sees the blocks.
        self._notice(conn, msg.job_id, dropped, code, "")
        self._account(Direction.STORE, len(entries), len(entries) * eng.mapped.slot_bytes, t0)
        done = self.index.commit(entries)
        if done < len(entries):
            self.metrics.dropped_stores.labels("clear").inc(len(entries) - done)

    def _load(self, conn: Conn, msg: P.Load) -> P.Message | None:
        eng, keys, ids = self._check_job(conn, msg)
        waiting = self.tiers.promotions(eng.table, keys)
        if waiting:  # blocks a LOOKUP found below the pool, still on their way into it
            jid = self._begin_job(conn, eng, msg.job_id, "load", time.monotonic())
            self._spawn(self._load_promoted(conn, eng, msg, jid, keys, ids, waiting))
            return None
        return self._load_resident(conn, eng, msg, keys, ids)

    async def _load_promoted(self, conn: Conn, eng: Engine, msg: P.Load, jid: int, keys: list[bytes],
                             ids: np.ndarray, waiting: list[asyncio.Future]) -> None:
        """A LOAD waits for its promotions (a failed or late one: those blocks fail), then runs as usual."""
        left = (msg.expires_ns - time.monotonic_ns()) / 1e9 if msg.expires_ns else PROMOTE_WAIT_S
        await asyncio.wait(waiting, timeout=max(0.0, min(left, PROMOTE_WAIT_S)))
        self._end_job(conn, eng, msg.job_id, jid)
        if eng.closing:
            self._notice(conn, msg.job_id, list(range(len(keys))), ErrorCode.NOT_REGISTERED.value,
                         "the engine left")
            return
        reply = self._load_resident(conn, eng, msg, keys, ids)
        if reply is not None:
            self._send(conn.ident, reply)

    def _load_resident(self, conn: Conn, eng: Engine, msg: P.Load, keys: list[bytes],
                       ids: np.ndarray) -> P.Message | None:
        failed: list[int] = []
        entries: list[Entry] = []
        ok_idx: list[int] = []
        get = eng.table.visible.get
        for i, k in enumerate(keys):
            e = get(k)
            if e is None:
                failed.append(i)
            else:
                e.pins += 1  # a pin, released by unpin when the copy ends
                entries.append(e)
                ok_idx.append(i)
        if msg.lease_id and entries:
            # A lease is consumed by a LOAD of blocks it holds: another connection may (the engine's
            # worker, by design), but naming a lease id alone (no keys, or other keys) must not
            # release someone else's lease (lease ids are sequential).
            lease = self.leases.get(msg.lease_id)
            held = lease.by_rank.get(eng.rank) if lease is not None and lease.namespace == eng.namespace else None
            first = entries[0]
            if held and any(e is first for e in held):
                self._drop_lease(msg.lease_id, eng.rank)
        if failed:
            self.metrics.misses.labels("absent").inc(len(failed))
        if not entries:
            return P.Notice(seq=msg.seq, job_id=msg.job_id, ok=not failed, failed=failed,
                            code="not_resident" if failed else "")
        slots = np.fromiter((e.slot for e in entries), dtype=np.int64, count=len(entries))
        t0 = time.monotonic()
        ids = ids[ok_idx] if failed else ids
        fut: Awaitable[None] | None = None
        if not self.cfg.verify:  # start the copy now, not one loop turn later in the job's task
            try:
                fut = eng.backend.submit(Direction.LOAD, eng.mapped, ids, slots, msg.event, msg.expires_ns)
            except Exception as e:
                fut = _failed_future(e)
        jid = self._begin_job(conn, eng, msg.job_id, "load", t0)
        self._spawn(self._run_load(conn, eng, msg, jid, t0, ok_idx, entries, ids, slots, failed, fut))
        return None

    async def _run_load(self, conn: Conn, eng: Engine, msg: P.Load, jid: int, t0: float, idx: list[int],
                        entries: list[Entry], ids: np.ndarray, slots: np.ndarray, failed: list[int],
                        fut: Awaitable[None] | None) -> None:
        code, text = ("not_resident", "") if failed else ("", "")
        try:
            if fut is not None:
                await fut
            elif self.cfg.verify:
                sums = await asyncio.get_running_loop().run_in_executor(None, self._checksums, entries)
                bad = [j for j, (e, c) in enumerate(zip(entries, sums, strict=True)) if e.checksum != c]
                if bad:
                    log.error("engine %s: %d blocks failed their checksum; reporting them failed", eng.engine_id,
                              len(bad))
                    self.metrics.checksum_failures.inc(len(bad))
                    for j in bad:
                        self.index.discard(entries[j])
                    failed = sorted(failed + [idx[j] for j in bad])
                    code, text = "checksum_mismatch", f"{len(bad)} blocks corrupt in the pool"
                    keep = np.ones(len(entries), dtype=bool)
                    keep[bad] = False
                    ids, slots = ids[keep], slots[keep]
                if past(msg.expires_ns):  # checksums took too long
                    raise JobExpired("deadline passed before the copy could start")
                if len(ids):
                    await eng.backend.submit(Direction.LOAD, eng.mapped, ids, slots, msg.event, msg.expires_ns)
        except asyncio.CancelledError:
            self._release_load(conn, eng, msg.job_id, jid, entries)
            raise
        except Exception as e:
            code = self._job_failed("load", msg.job_id, eng, e)
            failed = sorted(failed + idx)
            text = str(e)[:200]
        else:
            self._account(Direction.LOAD, len(ids), len(ids) * eng.mapped.slot_bytes, t0)
        self._end_job(conn, eng, msg.job_id, jid)
        self._notice(conn, msg.job_id, failed, code, text)  # first: the engine is waiting on it
        for e in entries:
            self.index.unpin(e)

    def _job_failed(self, direction: str, job_id: int, eng: Engine, e: Exception) -> str:
        """Count and log a job that failed as a whole; returns its notice code. ``expired``: its
        deadline passed before (the rest of) its copy could start, so it was stopped there."""
        if isinstance(e, JobExpired):
            log.warning("%s job %d of engine %s expired: %s", direction, job_id, eng.engine_id, e)
            self.metrics.expired_jobs.inc()
            return ErrorCode.EXPIRED.value
        log.warning("%s job %d of engine %s failed: %s", direction, job_id, eng.engine_id, e)
        self.metrics.failed_jobs.labels(direction).inc()
        return "copy_failed"

    def _release_load(self, conn: Conn, eng: Engine, job_id: int, jid: int, entries: list[Entry]) -> None:
        self._end_job(conn, eng, job_id, jid)
        for e in entries:
            self.index.unpin(e)

    def _checksums(self, entries: list[Entry]) -> list[int]:
        """crc32 of each slot (--verify). Runs in an executor: zlib releases the GIL on big buffers."""
        buf = self.pool.buffer
        return [zlib.crc32(buf[e.slot:e.slot + e.table.slot_bytes]) for e in entries]

    def _begin_job(self, conn: Conn, eng: Engine, job_id: int, direction: str, t0: float) -> int:
        """An accepted job: counted in flight (and aged) from now until its notice."""
        conn.jobs.add(job_id)
        eng.mapped.in_flight += 1
        jid = next(self._job_ids)
        self._jobs[jid] = (direction, t0)
        return jid

    def _end_job(self, conn: Conn, eng: Engine, job_id: int, jid: int) -> None:
        self._jobs.pop(jid, None)
        conn.jobs.discard(job_id)
        eng.mapped.in_flight -= 1
        if eng.closing and eng.mapped.in_flight == 0:
            self._detach(eng)

    def _notice(self, conn: Conn, job_id: int, failed: list[int], code: str, text: str) -> None:
        """Sent even when the connection was dropped meanwhile (an engine silent past engine_timeout_s,
        e.g. a client frozen for a while): its client waits for this notice before it reuses the
        blocks, and a peer that is gone is just not routed to."""
        self._send(conn.ident, P.Notice(job_id=job_id, ok=not failed, failed=failed, code=code, message=text))

    def _account(self, d: Direction, blocks: int, nbytes: int, t0: float) -> None:
        m = self.metrics
        dt = time.monotonic() - t0
        (m.stored_blocks if d is Direction.STORE else m.loaded_blocks).inc(blocks)
        m.transfer_bytes.labels(d.value).inc(nbytes)
        m.transfer_seconds.labels(d.value).observe(dt)
        m.transfer_blocks.labels(d.value).observe(blocks)
        if nbytes >= (1 << 20) and dt > 0:
            m.transfer_gbps.labels(d.value).set(nbytes / dt / 1e9)

    # ------------------------------------------------------------------------------------------------
    # admin

    def _clear(self, conn: Conn, msg: P.Clear) -> P.Message:
        if msg.namespace and msg.namespace not in self.index.namespaces:
            self.tiers.cleared(msg.namespace)  # blocks below the pool from before a restart
            return P.Cleared(seq=msg.seq, removed_blocks=0, in_flight_jobs=0)
        in_flight = sum(1 for e in self.engines.values() if not msg.namespace or e.namespace == msg.namespace
                        for _ in range(e.mapped.in_flight))
        removed = self.index.clear(msg.namespace, in_use={e.namespace for e in self.engines.values()})
        log.info("cleared %s: %d blocks removed, %d jobs in flight", msg.namespace or "all namespaces", removed,
                 in_flight)
        return P.Cleared(seq=msg.seq, removed_blocks=removed, in_flight_jobs=in_flight)

    def _explain(self, conn: Conn, msg: P.Explain) -> P.Message:
        if P.count_keys(msg.keys) > MAX_EXPLAIN_KEYS:  # ~100 bytes of reply per key
            raise ProtocolError(ErrorCode.TOO_MANY, f"EXPLAIN of {P.count_keys(msg.keys)} keys; at most "
                                f"{MAX_EXPLAIN_KEYS}", seq=msg.seq)
        return P.Explained(seq=msg.seq, entries=self.index.explain(msg.namespace, P.split_keys(msg.keys)))

    def _stats(self, conn: Conn, msg: P.Stats) -> P.Message:
        return P.StatsResult(seq=msg.seq, stats=self.stats())

    def _in_flight(self) -> tuple[dict[str, int], float]:
        counts = {"store": 0, "load": 0}
        oldest = 0.0
        now = time.monotonic()
        for d, t0 in self._jobs.values():
            counts[d] += 1
            oldest = max(oldest, now - t0)
        return counts, oldest

    def _live_state(self) -> dict[str, Any]:
        counts, oldest = self._in_flight()
        p = self.pool
        return {"pool": {"capacity": p.capacity_bytes, "used": p.used_bytes, "pinned": p.pinned_bytes,
                         "free_chunks": p.free_chunk_bytes, "total": p.nbytes},
                "engines": len(self.engines), "leases": len(self.leases), "resident_blocks": self.index.resident,
                "in_flight": counts, "oldest_in_flight_s": oldest}

    def tier_stats(self) -> list[dict[str, Any]]:
        """Per tier (the pool first): ``kvoffctl status`` and the metrics collector read this."""
        m = self.metrics
        disk_hits = sum(self.tiers.hits.values())
        dram = {"name": "dram", "capacity_bytes": self.pool.capacity_bytes, "resident_bytes": self.pool.used_bytes,
                "resident_blocks": self.index.resident, "hits": m.lookup.hit_blocks - disk_hits,
                "evictions": self.index.evictions, "admissions_refused": self.index.refused}
        out = [dram] + [st.as_dict() for st in self.tiers.stats()]
        if self.tiers.disabled:
            out.append({"name": "disk", "disabled": self.tiers.disabled})
        return out

    def stats(self) -> dict[str, Any]:
        m = self.metrics
        counts, oldest = self._in_flight()

        def c(counter, *labels) -> int:
            return int((counter.labels(*labels) if labels else counter)._value.get())

        return {
            "daemon": {"id": self.daemon_id, "pid": os.getpid(), "version": __version__,
                       "protocol": P.PROTOCOL_VERSION, "uptime_s": round(time.time() - self.started, 3),
                       "address": self.bound_address, "metrics_address": self.metrics_address,
                       "backends": [b.describe() for b in self.backends], "fds": self.fds.describe(),
                       "listening": not (self._guard and self._guard.paused)},
            "pool": {**self.pool.stats(), "base_address": self.pool.base_address},
            "verify": self.cfg.verify,
            "eviction_policy": self.cfg.eviction_policy,
            "counters": {
                "lookups": m.lookup.lookups, "lookup_hit_blocks": m.lookup.hit_blocks,
                "lookup_miss_blocks": m.lookup.miss_blocks, "stored_blocks": c(m.stored_blocks),
                "store_noop_blocks": c(m.store_noop_blocks), "loaded_blocks": c(m.loaded_blocks),
                "store_bytes": c(m.transfer_bytes, "store"), "load_bytes": c(m.transfer_bytes, "load"),
                "evicted_blocks": self.index.evictions,
                "admission_refused_blocks": c(m.admission_refused),
                "dropped_stores": sum(c(m.dropped_stores, r) for r in ("pool_full", "clear", "failed")),
                "errors": sum(c(m.errors, code.value) for code in ErrorCode),
            },
            "resident_blocks": self.index.resident,
            "leases": len(self.leases),
            "engines": [e.describe() for e in self.engines.values()],
            "namespaces": self.index.namespace_stats(),
            "tiers": self.tier_stats(),
            "in_flight_jobs": counts["store"] + counts["load"],
            "oldest_in_flight_s": round(oldest, 6),
        }
