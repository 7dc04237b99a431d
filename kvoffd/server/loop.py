"""The daemon's control loop: ROUTER socket in, validate, dispatch, queue work, notices out.

Everything here runs on one asyncio (uvloop) thread and never blocks: copies run in backends
(threads or CUDA streams), mapping an engine's memory runs in an executor. A client's mistake is
answered with ERROR and changes nothing; only a bug in the daemon reaches the INTERNAL code, and even
that is answered and logged, never fatal.

This module is how the daemon hears and answers: the socket, the drain, one dispatch table
(``Server._routes``) for every request, the reply path and ``tick()``. What it knows lives in the
handlers' modules, which never import this one: ``sessions`` (who is there), ``jobs`` (LOOKUP,
STORE, LOAD), ``admin`` (STATS, CLEAR, EXPLAIN). Each gets the ``reply(ident, msg)`` and
``spawn(coro)`` callables; every handler returns ``Message | None``, the reply or nothing.
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
import uuid
from collections.abc import Callable, Coroutine
from dataclasses import dataclass
from typing import Any

import zmq

from kvoffd import __version__, sdnotify
from kvoffd.cache.keyspace import Keyspace, purge_command
from kvoffd.config import Config
from kvoffd.events.publisher import KvEventPublisher, make_publisher
from kvoffd.metrics import Metrics
from kvoffd.pool.allocator import Pool
from kvoffd.pool.reap import reap_stale
from kvoffd.pool.topology import parse_numa_map, read_topology
from kvoffd.runtime import ensure_private_dir, load_or_create_token
from kvoffd.server.admin import Admin
from kvoffd.server.backends import by_kind, make_backends
from kvoffd.server.endpoint import AddressClaim, UnreadReplies, new_router, prepare_ipc_path, unlink_if_ours
from kvoffd.server.fdbudget import LISTEN_BACKLOG, FdBudget, ListenerGuard, open_listener
from kvoffd.server.fdserver import FdServer, fd_socket_path, remove_stale_socket
from kvoffd.server.jobs import Jobs
from kvoffd.server.limits import (
    DRAIN_BATCH,
    HOUSEKEEPING_S,
    INTERNAL_LOG_EVERY_S,
    MAX_UNREAD_REPLY_BYTES_PER_PEER,
    REAP_EVERY_S,
    REFUSAL_LOG_EVERY_S,
    TRACKED_REPLY_BYTES,
)
from kvoffd.server.outlet_link import outlet_for
from kvoffd.server.ratelog import RateLimitedLog
from kvoffd.server.register import Registrar
from kvoffd.server.sessions import Engine, Sessions
from kvoffd.server.tcpgate import TcpGate
from kvoffd_client import protocol as P
from kvoffd_client.protocol import ErrorCode, ProtocolError

log = logging.getLogger(__name__)

# plain ints: pyzmq's flag enums cost microseconds per ``&``, several times per message
_EVENTS, _POLLIN, _NOBLOCK, _RCVMORE = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK), int(zmq.RCVMORE)
_SNDMORE_NOBLOCK = int(zmq.SNDMORE) | _NOBLOCK
_SRCFD = int(zmq.SRCFD)


@dataclass(frozen=True)
class Route:
    """One row of the dispatch table. ``handle(conn, msg)`` returns the reply or None; a row with
    ``needs_session=False`` (HELLO) is called with the routing id instead of a connection, and an
    ``is_async`` row (REGISTER) returns a coroutine whose result is the reply."""

    handle: Callable[[Any, Any], Any]
    needs_session: bool = True
    is_async: bool = False


def process_age_s() -> float:
    """Seconds since this process was started (exec included), from /proc; 0 where unreadable."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return 0.0
    return max(0.0, uptime - start_ticks / os.sysconf("SC_CLK_TCK"))


class Server:
    """The daemon's server: it owns the socket and the loop, and hands each request to its handler."""

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.daemon_id = uuid.uuid4().hex
        self.started = time.time()
        t0 = time.monotonic()
        self._t_process = t0 - process_age_s()  # the process's start, on the monotonic clock
        # First the address: a second daemon of this address stops here, before it touches a pool or a tier
        self.claim = AddressClaim(cfg.address)
        self.keyspace: Keyspace | None = None  # given back by ``abandon`` if the start fails
        self.sock: zmq.Socket | None = None
        self._socket_ino = 0  # the ipc socket file this daemon made (removed at stop only if still it)
        self.fd_handover: FdServer | None = None  # where engines hand over memory descriptors (cpu_fd, cuda_vmm)
        self.kv_events: KvEventPublisher | None = None
        try:
            self._build(cfg, t0)
        except BaseException:
            self.abandon()
            raise

    def _build(self, cfg: Config, t0: float) -> None:
        reap_stale(cfg.address)  # this user's pools that no daemon can come back for
        topology = read_topology(cfg.sysfs_root, parse_numa_map(cfg.numa_map))
        ks = self.keyspace = Keyspace.open(cfg, topology, t0)  # the pool, its index, its blocks, the tiers
        t_keyspace = time.monotonic()
        self.backends = make_backends(cfg, ks.pool)
        # where a start's time goes (the serving line says it: a warm restart's first hit is this)
        self.start_phases = {"before the server": t0 - self._t_process, **ks.phases,
                             "backends": time.monotonic() - t_keyspace}
        self._t_built = time.monotonic()
        self.by_kind = by_kind(self.backends)
        self.fds = FdBudget()
        self.metrics = Metrics(__version__)
        # --kv-events-address (None: off); its endpoints are another process's (kvoffd/server/outlet.py)
        self.kv_events = make_publisher(cfg, self.metrics, outlet_for(cfg, self.metrics))
        if self.kv_events is not None:
            ks.add_events(self.kv_events)  # a mirror of the index, the tiers and the adopted blocks
        self.sessions = Sessions(daemon_id=self.daemon_id, keyspace=ks, metrics=self.metrics, fds=self.fds,
                                 by_kind=self.by_kind, engine_timeout_s=cfg.engine_timeout, reply=self._send,
                                 capabilities=("kv_events",) if self.kv_events and self.kv_events.token_ids else ())
        self.registrar = Registrar(sessions=self.sessions, keyspace=ks, metrics=self.metrics, fds=self.fds,
                                   by_kind=self.by_kind)
        self.jobs = Jobs(sessions=self.sessions, keyspace=ks, metrics=self.metrics, reply=self._send,
                         spawn=self._spawn)
        self.admin = Admin(sessions=self.sessions, jobs=self.jobs, keyspace=ks, metrics=self.metrics,
                           describe_daemon=self.describe)
        self.metrics.watch_live_state(self.admin.live_state)
        self.metrics.watch_tiers(self.admin.tier_stats)
        self._routes = self._table()
        self._tasks: set[asyncio.Task] = set()
        self.ready = asyncio.Event()
        self._stopping = asyncio.Event()
        self._ctx = zmq.Context.instance()
        self.bound_address = ""
        self.metrics_address = cfg.metrics_address  # the cli sets the bound one (port 0 picks a port)
        self._guard: ListenerGuard | None = None
        self._listener: socket.socket | None = None  # the ZeroMQ listener's socket, owned here
        self._zmq_fd = -1  # libzmq's duplicate of it
        self._gate: TcpGate | None = None  # tcp://: connections that have not shown the token yet
        self._unread = UnreadReplies()  # big replies libzmq has not sent yet
        self._refusals = RateLimitedLog(log, REFUSAL_LOG_EVERY_S)  # per error code
        self._internals = RateLimitedLog(log, INTERNAL_LOG_EVERY_S)
        self._last_reap = 0.0
        self._watchdog_s: float | None = None  # systemd's WatchdogSec, halved (read when serving starts)
        self._last_watchdog = 0.0

    def _table(self) -> dict[P.Op, Route]:
        """Every request the daemon serves, and who handles it."""
        s, j, a = self.sessions, self.jobs, self.admin
        return {
            P.Op.HELLO: Route(s.hello, needs_session=False),
            P.Op.REGISTER: Route(self.registrar.register, is_async=True),
            P.Op.UNREGISTER: Route(s.unregister, is_async=True),
            P.Op.LOOKUP: Route(j.lookup),
            P.Op.RELEASE: Route(s.release),
            P.Op.STORE: Route(j.store),
            P.Op.LOAD: Route(j.load),
            P.Op.STATS: Route(a.stats_request),
            P.Op.CLEAR: Route(a.clear),
            P.Op.PING: Route(lambda conn, msg: P.Pong(seq=msg.seq, daemon_id=self.daemon_id)),
            P.Op.EXPLAIN: Route(a.explain),
        }

    # --- what entry points read (kvoffd/cli.py, kvoffd/server/http.py) ---------------------------------
    @property
    def engines(self) -> dict[str, Engine]:
        return self.sessions.engines

    @property
    def pool(self) -> Pool:
        return self.keyspace.pool

    @property
    def jobs_in_flight(self) -> int:
        return len(self.jobs.running)

    def stats(self) -> dict[str, Any]:
        return self.admin.stats()

    def describe(self) -> dict[str, Any]:
        """The STATS reply's ``daemon`` section."""
        return {"id": self.daemon_id, "pid": os.getpid(), "version": __version__, "protocol": P.PROTOCOL_VERSION,
                "uptime_s": round(time.time() - self.started, 3), "address": self.bound_address,
                "metrics_address": self.metrics_address, "backends": [b.describe() for b in self.backends],
                "fds": self.fds.describe(), "listening": not (self._guard and self._guard.paused),
                "unauthenticated": self._gate.describe() if self._gate is not None else None,
                "kv_events": self.kv_events.describe() if self.kv_events is not None else None}

    # ------------------------------------------------------------------------------------------------
    # socket

    def bind(self) -> str:
        addr = self.cfg.address
        sock = new_router(self._ctx)
        if addr.startswith("ipc://"):
            prepare_ipc_path(addr[6:])
        elif addr.startswith("tcp://"):  # any local user can connect: only token holders may talk
            self.sessions.auth_token = load_or_create_token(self.cfg.auth_token_file)
            self._gate = TcpGate(self.fds.limit)
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
        self.claim.release()  # the socket answers for this daemon now (AddressClaim)
        if self.by_kind.keys() & {"cpu_fd", "cuda_vmm"}:  # the kinds whose memory comes as descriptors
            self._bind_fd_socket()
        if self.kv_events is not None:
            self.kv_events.bind()
        return self.bound_address

    def _bind_fd_socket(self) -> None:
        """The UNIX socket engines pass their memory descriptors on (CPU memfds, VMM allocations): beside the ipc socket (same checks), or in
        the token file's private directory for tcp://. Its path goes out in HELLO_OK."""
        path = fd_socket_path(self.bound_address, os.path.dirname(self.cfg.auth_token_file) or ".")
        ensure_private_dir(os.path.dirname(path) or ".")
        remove_stale_socket(path)  # the ZeroMQ bind above proved no daemon serves this address
        self.fd_handover = self.sessions.fd_handover = FdServer(path, self.fds)

    # ------------------------------------------------------------------------------------------------
    # main loop

    async def serve(self, on_ready: Callable[[], None] | None = None) -> None:
        loop = asyncio.get_running_loop()
        t0 = time.monotonic()
        if self.sock is None:
            self.bind()
        for b in self.backends:
            b.start()
        t_backends = time.monotonic()
        if self.kv_events is not None:
            self.kv_events.start()
        keeper_s = self.keyspace.start(loop)  # the keeper, the tiers, and what the KV-event mirror hears first
        self.start_phases["bind"] = t0 - self._t_built
        self.start_phases["started"] = t_backends - t0
        self.start_phases["keeper"] = keeper_s
        if self.fd_handover is not None:
            self.fd_handover.start(loop)
        fd = self.sock.getsockopt(zmq.FD)
        loop.add_reader(fd, self._drain)
        self._guard = ListenerGuard(self._ctx, self.sock, self._listener, self._zmq_fd, self.fds)
        if self._gate is not None:
            self._guard.on_event = self._gate.on_event
        loop.add_reader(self._guard.fd, self._drain_monitor)
        self._drain_monitor()  # edge-triggered like the ROUTER's fd: take what is queued already
        self._watchdog_s = sdnotify.watchdog_interval()
        self.sessions.expire(time.monotonic())  # the stall clock starts now (Sessions.expire)
        house = asyncio.create_task(self._housekeeping())
        self.ready.set()
        log.info("kvoffd %s serving on %s: pool %d MiB, backends %s; %.2f s after the process started (%s)",
                 __version__, self.bound_address, self.pool.nbytes >> 20, ",".join(b.name for b in self.backends),
                 process_age_s(), ", ".join(f"{k} {v:.2f} s" for k, v in self.start_phases.items()))
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

    def abandon(self) -> None:
        """The start failed before serving: leave nothing behind that no one will use. A pool this start
        made or emptied goes with its files (one holding a previous daemon's blocks stays for the next
        start), the socket files this start made go, and so does the address's lock."""
        if self.keyspace is not None:
            self.keyspace.abandon()
        if self.kv_events is not None:
            try:
                self.kv_events.close()
            except Exception:
                log.debug("closing the KV-event outlet of a failed start", exc_info=True)
        if self.fd_handover is not None:
            self.fd_handover.close()
        if self.sock is not None:
            self.sock.close(0)
        if self._socket_ino:
            unlink_if_ours(self.cfg.address[6:], self._socket_ino)
        self.claim.release()

    async def _shutdown(self) -> None:
        for t in list(self._tasks):
            t.cancel()
        if self._tasks:
            await asyncio.gather(*self._tasks, return_exceptions=True)
        self.sessions.shutdown()
        await self.keyspace.stop_tiers()  # spills in flight land first
        for b in self.backends:
            b.close()
        await self.keyspace.close()  # seals what is left: the next daemon adopts it
        if self.fd_handover is not None:
            self.fd_handover.close()
        if self.kv_events is not None:
            self.kv_events.close()
        if self.sock is not None:
            self.sock.close(0)
            if self._listener is not None:
                self._listener.close()
            if self.bound_address.startswith("ipc://"):
                unlink_if_ours(self.bound_address[6:], self._socket_ino)
        kept = self.keyspace.kept_at()
        if kept:
            log.info("kvoffd stopped; its pool stays in memory in %s for the next start to adopt ('%s' gives the "
                     "memory back)", kept, purge_command(self.cfg.address, self.cfg.pool_path))
        else:
            log.info("kvoffd stopped")

    async def _housekeeping(self) -> None:
        while True:
            await asyncio.sleep(HOUSEKEEPING_S)
            try:
                self.tick(time.monotonic())
            except Exception:
                log.exception("housekeeping failed")

    def tick(self, now: float) -> None:
        """Timers, every HOUSEKEEPING_S: the systemd watchdog (from the loop itself: a stalled loop
        stops the pings), leases and silent engines; once a second, idle connections, the descriptor
        budget and the big replies libzmq has sent; the listener guard."""
        if self._watchdog_s and now - self._last_watchdog >= self._watchdog_s:
            sdnotify.watchdog()
            self._last_watchdog = now
        self.sessions.expire(now)
        if self._gate is not None:
            self._gate.expire(now)
        if now - self._last_reap > REAP_EVERY_S:
            self.sessions.reap_idle_conns()
            self._last_reap = now
            self.fds.calibrate()
            self._unread.reclaim_all()
        self._guard.check()

    def _drain(self) -> None:
        """Read queued messages. The ZeroMQ fd is edge-triggered, so whatever is left after a batch
        is picked up by a callback scheduled at once: completions and timers run in between, and a
        flooding client cannot hold the loop."""
        sock = self.sock
        recv, getsockopt = sock.recv, sock.getsockopt
        gated = self._gate is not None  # tcp://: HELLO must say which connection it came on (a zmq.Frame)
        for _ in range(DRAIN_BATCH):
            if not getsockopt(_EVENTS) & _POLLIN:
                self.sessions.heard_all_at = time.monotonic()  # silence is counted up to here (Sessions)
                return
            try:  # ROUTER: [identity, body]; not recv_multipart, whose flag enums cost more than the rest
                ident = recv(_NOBLOCK)
                body = recv(_NOBLOCK, copy=False) if gated else recv(_NOBLOCK)
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
        """A big reply, counted until libzmq has sent it (UnreadReplies). Past the per-peer or global
        bound the reply becomes a small ``too_many`` ERROR (with the job id for a notice, so the client
        fails the job at once)."""
        pending = self._unread.pending(ident)
        if not self._unread.fits(pending, len(data)):
            self.metrics.errors.labels(ErrorCode.TOO_MANY.value).inc()
            log.warning("client %s: %d bytes of replies unread (%d in all); refused a %d-byte %s", ident.hex(),
                        pending, self._unread.total, len(data), msg.op.value)
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
            self._unread.track(ident, tracker, len(data))
        if sock.getsockopt(_EVENTS) & _POLLIN:
            asyncio.get_running_loop().call_soon(self._drain)

    def _reject(self, ident: bytes, e: ProtocolError) -> None:
        self.metrics.errors.labels(e.code.value).inc()
        malformed = e.code in (ErrorCode.BAD_FRAME, ErrorCode.FRAME_TOO_LARGE)  # a broken or hostile client
        self._refusals(e.code.value, logging.WARNING if malformed else logging.DEBUG, "client %s: %s",
                       ident.hex(), e)
        self._send(ident, P.error_for(e))

    def _on_message(self, ident: bytes, body: bytes | zmq.Frame) -> None:
        seq = 0
        try:
            msg = P.decode(body, requests_only=True)
            seq = msg.seq
            if self._gate is not None and msg.op is P.Op.HELLO:  # the token, on this connection: it may stay
                self._gate.hello(body.get(_SRCFD), self.sessions.token_ok(msg.token))
            route = self._routes[msg.op]
            who = self.sessions.session_of(ident, msg.seq) if route.needs_session else ident
            if route.is_async:
                self._spawn(self._answer_later(ident, msg, route.handle(who, msg)))
                return
            reply = route.handle(who, msg)
        except ProtocolError as e:
            self._reject(ident, e)
            return
        except Exception:
            self._internal_error(ident, seq)
            return
        if reply is not None:
            self._send(ident, reply)

    async def _answer_later(self, ident: bytes, msg: P.Message, handling: Coroutine[Any, Any, Any]) -> None:
        """An ``is_async`` row: its reply once its coroutine is done (None: nothing to send)."""
        try:
            reply = await handling
        except ProtocolError as e:
            e.seq = msg.seq
            self._reject(ident, e)
            return
        except Exception:
            self._internal_error(ident, msg.seq)
            return
        if reply is not None:
            self._send(ident, reply)

    def _internal_error(self, ident: bytes, seq: int) -> None:
        self._internals("internal", logging.ERROR, "internal error handling a message from %s", ident.hex(),
                        exc_info=True)
        self.metrics.errors.labels(ErrorCode.INTERNAL.value).inc()
        self._send(ident, P.Error(seq=seq, code=ErrorCode.INTERNAL.value, message="internal error; see the daemon log"))

    def _spawn(self, coro: Coroutine[Any, Any, None]) -> None:
        t = asyncio.create_task(coro)
        self._tasks.add(t)
        t.add_done_callback(self._tasks.discard)
