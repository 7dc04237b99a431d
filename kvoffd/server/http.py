"""The daemon's HTTP side: /metrics, /healthz, /readyz on the metrics address.

Hand-written on non-blocking sockets driven by the daemon's loop (no framework, no thread): three GET
routes, no bodies in, and a scrape reads counters; it never waits on a copy. Every local user can
reach the port (and the network can, with 0.0.0.0), and each connection costs the daemon a file
descriptor, so connections are bounded. How they are bounded is what keeps the port answering under
a connection flood (a plain global cap would not: whoever held every slot with idle connections
would make every /healthz fail, and a liveness probe on it would restart a healthy daemon):

- A request already in the kernel's buffer when its connection is accepted is answered at once and
  holds no slot: probes and scrapes send their request as soon as they connect.
- A connection still waiting for its request holds a slot of its peer's. The peer is the other end's
  uid when that end is on this host in this network namespace (``PeerIds``: the kernel's sock_diag,
  as ``ss -e`` shows), else its address. A peer has at most PER_PEER slots: a new connection beyond
  them closes that peer's oldest. With MAX_CONNS slots taken in all, the peer holding the most loses
  its oldest. So a flood displaces only its own connections, never those of a peer with fewer.
- The request head must arrive within HEAD_S of the connection and the answer be taken within
  ANSWER_S; the head is at most HEAD_LIMIT bytes. Nothing is logged per request.
- /metrics is rendered afresh at most RENDERS_PER_S times a second per peer (bursts of RENDER_BURST);
  past that the peer gets the last rendering. A rendering costs the loop milliseconds (about 5 ms on
  the 2-core dev VM): a peer asking at full speed used to take 85% of the loop (pings up to 0.7 s).
- While the descriptor budget is tight (``tight``), a connection whose request is not there at once
  is closed instead of kept.

``MetricsServer.connections`` is how many descriptors it holds now (the descriptor budget counts them,
kvoffd/server/fdbudget.py).
"""

from __future__ import annotations

import asyncio
import errno
import ipaddress
import json
import logging
import socket
import struct
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

if TYPE_CHECKING:  # reads the Server's public attributes only
    from kvoffd.server.loop import Server

log = logging.getLogger(__name__)

MAX_CONNS = 64  # connections held at once, all peers together (each is a descriptor)
PER_PEER = 8  # connections one peer (a uid on this host, else an address) holds at once
HEAD_S = 1.0  # from the connection to the end of its request head
ANSWER_S = 2.0  # from the start of the answer to its last byte taken
HEAD_LIMIT = 16 << 10  # bytes of request head
BACKLOG = 1024  # connections the kernel queues before accept (they hold no descriptor of the daemon)
ACCEPT_BATCH = 64  # accepts per loop callback: the loop's other work goes on during a flood
RENDERS_PER_S = 10.0  # fresh /metrics renderings per peer and second (Prometheus scrapes every 15 s or so)
RENDER_BURST = 20.0
TRACKED_PEERS = 1024  # peers whose rendering budget is remembered (the least recent are forgotten)
SWEEP_S = 0.25  # how often deadlines are checked
RETRY_ACCEPT_S = 0.05  # pause after EMFILE and the like (the pending connection would spin the loop)

Route = Callable[[], tuple[int, str, bytes]]
_REASONS = {200: "OK", 404: "Not Found", 405: "Method Not Allowed", 500: "Internal Server Error",
            503: "Service Unavailable"}


def _reply(status: int, ctype: str, body: bytes, head_only: bool) -> bytes:
    return (f"HTTP/1.1 {status} {_REASONS[status]}\r\nContent-Type: {ctype}\r\nContent-Length: {len(body)}\r\n"
            "Connection: close\r\n\r\n").encode() + (b"" if head_only else body)


def request_line(head: bytes) -> tuple[str, str]:
    """(method, path) of a request head (latin-1 decodes any byte: a request line that is not UTF-8
    is a 404, not a traceback)."""
    parts = head.split(b"\r\n", 1)[0].split()
    if len(parts) < 2:
        return "", ""
    return parts[0].decode("latin-1"), parts[1].decode("latin-1").split("?", 1)[0]


class Renderings:
    """/metrics bodies, rendered afresh within each peer's budget (a token bucket: RENDERS_PER_S, at
    most RENDER_BURST saved up), else the last one rendered for anyone."""

    def __init__(self, render: Callable[[], bytes]) -> None:
        self._render = render
        self._last: bytes | None = None
        self._budget: dict[tuple[str, object], tuple[float, float]] = {}  # peer -> (tokens, when); LRU order

    def body(self, peer: tuple[str, object]) -> bytes:
        now = time.monotonic()
        tokens, then = self._budget.pop(peer, (RENDER_BURST, now))
        tokens = min(RENDER_BURST, tokens + (now - then) * RENDERS_PER_S)
        if tokens >= 1.0 or self._last is None:
            tokens = max(0.0, tokens - 1.0)
            self._last = self._render()
        self._budget[peer] = (tokens, now)
        if len(self._budget) > TRACKED_PEERS:
            del self._budget[next(iter(self._budget))]
        return self._last


# ------------------------------------------------------------------------------------------------------
# who is at the other end

_NETLINK_SOCK_DIAG = 4
_SOCK_DIAG_BY_FAMILY = 20
_NLM_F_REQUEST = 1
_NLMSG = struct.Struct("=IHHII")  # len, type, flags, seq, pid
_REQ = struct.Struct("=BBBxI")  # family, protocol, ext, pad, states
_SOCKID = struct.Struct("!HH16s16s")  # sport, dport, src, dst (network order); then if, cookie[2]
_NOCOOKIE = struct.pack("=III", 0, 0xFFFFFFFF, 0xFFFFFFFF)
_UID_AT = _NLMSG.size + 4 + _SOCKID.size + 12 + 12  # inet_diag_msg: 4 bytes, id, expires/rqueue/wqueue


def _packed(family: int, host: str) -> bytes:
    return socket.inet_pton(family, host).ljust(16, b"\0")


class PeerIds:
    """The key a connection's slots are counted under: ("uid", n) when the other end is a socket of
    this network namespace (its owner, from one sock_diag lookup of that exact socket, ~10 us), else
    ("addr", host). A lookup that fails falls back to the address."""

    def __init__(self) -> None:
        try:
            self._nl: socket.socket | None = socket.socket(socket.AF_NETLINK, socket.SOCK_DGRAM, _NETLINK_SOCK_DIAG)
            self._nl.setblocking(False)
        except OSError:
            self._nl = None
        self._seq = 0

    def of(self, sock: socket.socket, peer: tuple) -> tuple[str, object]:
        host = peer[0]
        uid = self._uid(sock, peer)
        return ("uid", uid) if uid is not None else ("addr", host)

    def _uid(self, sock: socket.socket, peer: tuple) -> int | None:
        if self._nl is None:
            return None
        try:
            local = sock.getsockname()
            family = sock.family
            phost, lhost = peer[0], local[0]
            if family == socket.AF_INET6:
                p6, l6 = ipaddress.IPv6Address(phost.split("%")[0]), ipaddress.IPv6Address(lhost.split("%")[0])
                if p6.ipv4_mapped is not None and l6.ipv4_mapped is not None:  # the other end is an AF_INET socket
                    family, phost, lhost = socket.AF_INET, str(p6.ipv4_mapped), str(l6.ipv4_mapped)
            # the other end's socket: its source is our peer, its destination our local address
            sid = _SOCKID.pack(peer[1], local[1], _packed(family, phost), _packed(family, lhost)) + _NOCOOKIE
            req = _REQ.pack(family, socket.IPPROTO_TCP, 0, 0xFFFFFFFF) + sid
            self._seq += 1
            self._nl.send(_NLMSG.pack(_NLMSG.size + len(req), _SOCK_DIAG_BY_FAMILY, _NLM_F_REQUEST, self._seq, 0) + req)
            for _ in range(4):  # a stale answer (a lookup that gave up) is skipped
                data = self._nl.recv(8192)
                _, typ, _, seq, _ = _NLMSG.unpack_from(data)
                if seq == self._seq:
                    break
            else:
                return None
        except (OSError, ValueError):
            return None
        if typ != _SOCK_DIAG_BY_FAMILY or len(data) < _UID_AT + 4:
            return None  # not found (another network namespace: the kubelet's probe), or an error
        return struct.unpack_from("=I", data, _UID_AT)[0]

    def close(self) -> None:
        if self._nl is not None:
            self._nl.close()
            self._nl = None


# ------------------------------------------------------------------------------------------------------


class _Conn:
    """One connection the server keeps: waiting for its request head, or sending its answer."""

    __slots__ = ("sock", "fd", "addr", "peer", "head", "out", "deadline")

    def __init__(self, sock: socket.socket, addr: tuple, peer: tuple[str, object], deadline: float) -> None:
        self.sock = sock
        self.fd = sock.fileno()
        self.addr = addr  # the other end's address, as accept gave it
        self.peer = peer  # whom its slot counts against (PeerIds)
        self.head = b""
        self.out: memoryview | None = None  # the answer's unsent part, once answering
        self.deadline = deadline


class MetricsServer:
    """The listening sockets and the connections kept, all on the daemon's loop (see the module's
    docstring for the rules)."""

    def __init__(self, loop: asyncio.AbstractEventLoop, listeners: list[socket.socket], routes: dict[str, Route],
                 render_metrics: Callable[[], bytes], tight: Callable[[], bool] = lambda: False,
                 on_count: Callable[[int], None] = lambda n: None) -> None:
        """``routes``: the cheap GET routes (/healthz, /readyz); ``render_metrics``: /metrics's body."""
        self._loop = loop
        self.listeners = listeners
        self._routes = routes
        self._metrics = Renderings(render_metrics)
        self._tight = tight
        self._on_count = on_count
        self._peers = PeerIds()
        self._by_peer: dict[tuple[str, object], dict[_Conn, None]] = {}  # insertion order: oldest first
        self.connections = 0
        self._sweep: asyncio.TimerHandle | None = None
        self._closed = False
        for s in listeners:
            loop.add_reader(s.fileno(), self._on_accept, s)

    @property
    def port(self) -> int:
        return self.listeners[0].getsockname()[1]

    def _on_accept(self, listener: socket.socket) -> None:
        for _ in range(ACCEPT_BATCH):
            try:
                sock, peer = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:
                if e.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    self._loop.remove_reader(listener.fileno())  # the pending connection would spin the loop
                    self._loop.call_later(RETRY_ACCEPT_S, self._accept_again, listener)
                    return
                continue  # ECONNABORTED and the like: that connection only
            self._take(sock, peer)

    def _answer(self, sock: socket.socket, peer: tuple, head: bytes) -> bytes:
        try:
            return self._route(sock, peer, head)
        except Exception:  # a bug in a route: answered and logged, and the connection still closed
            log.exception("HTTP request failed")
            return _reply(500, "text/plain", b"internal error\n", False)

    def _route(self, sock: socket.socket, peer: tuple, head: bytes) -> bytes:
        method, path = request_line(head)
        if method not in ("GET", "HEAD"):
            return _reply(405, "text/plain", b"method not allowed\n", False)
        if path == "/metrics":
            return _reply(200, CONTENT_TYPE_LATEST, self._metrics.body(self._peers.of(sock, peer)), method == "HEAD")
        route = self._routes.get(path)
        if route is None:
            return _reply(404, "text/plain", b"not found: try /metrics, /healthz, /readyz\n", method == "HEAD")
        return _reply(*route(), method == "HEAD")

    def _accept_again(self, listener: socket.socket) -> None:
        if not self._closed:
            self._loop.add_reader(listener.fileno(), self._on_accept, listener)

    def _take(self, sock: socket.socket, peer: tuple) -> None:
        sock.setblocking(False)
        try:
            head = sock.recv(HEAD_LIMIT)
        except (BlockingIOError, InterruptedError):
            head = None
        except OSError:
            sock.close()
            return
        if head == b"":
            sock.close()  # gone already
            return
        if head is not None and b"\r\n\r\n" in head:
            out = memoryview(self._answer(sock, peer, head))
            try:
                n = sock.send(out)
            except (BlockingIOError, InterruptedError):
                n = 0
            except OSError:
                sock.close()
                return
            if n == len(out):
                sock.close()
                return
            conn = self._admit(sock, peer, time.monotonic() + ANSWER_S)
            if conn is not None:
                conn.out = out[n:]
                self._loop.add_writer(conn.fd, self._on_writable, conn)
            return
        if self._tight():
            sock.close()  # the descriptors are short: only requests that are there already are served
            return
        conn = self._admit(sock, peer, time.monotonic() + HEAD_S)
        if conn is not None:
            conn.head = head or b""
            if len(conn.head) >= HEAD_LIMIT:
                self._drop(conn)
                return
            self._loop.add_reader(conn.fd, self._on_readable, conn)

    def _admit(self, sock: socket.socket, peer: tuple, deadline: float) -> _Conn | None:
        """Keep ``sock`` in a slot of its peer's, displacing the oldest connection of its own peer (at
        PER_PEER) or of the peer holding the most (at MAX_CONNS)."""
        if self._closed:
            sock.close()
            return None
        conn = _Conn(sock, peer, self._peers.of(sock, peer), deadline)
        mine = self._by_peer.setdefault(conn.peer, {})
        if len(mine) >= PER_PEER:
            self._drop(next(iter(mine)))
        elif self.connections >= MAX_CONNS:
            self._drop(next(iter(max(self._by_peer.values(), key=len))))
        self._by_peer.setdefault(conn.peer, {})[conn] = None
        self.connections += 1
        self._on_count(self.connections)
        if self._sweep is None:
            self._sweep = self._loop.call_later(SWEEP_S, self._expire)
        return conn

    def _on_readable(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(HEAD_LIMIT)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            self._drop(conn)
            return
        if not data:
            self._drop(conn)
            return
        conn.head += data
        if b"\r\n\r\n" in conn.head:
            self._loop.remove_reader(conn.fd)
            conn.out = memoryview(self._answer(conn.sock, conn.addr, conn.head))
            conn.deadline = time.monotonic() + ANSWER_S
            if self._send(conn):
                self._loop.add_writer(conn.fd, self._on_writable, conn)
        elif len(conn.head) >= HEAD_LIMIT:
            self._drop(conn)

    def _on_writable(self, conn: _Conn) -> None:
        self._send(conn)

    def _send(self, conn: _Conn) -> bool:
        """Send what the socket takes of the answer; True while some of it is left (the connection is
        closed once it is all sent, or on an error)."""
        try:
            n = conn.sock.send(conn.out)
        except (BlockingIOError, InterruptedError):
            return True
        except OSError:
            self._drop(conn)
            return False
        conn.out = conn.out[n:]
        if len(conn.out):
            return True
        self._drop(conn)
        return False

    def _drop(self, conn: _Conn) -> None:
        mine = self._by_peer.get(conn.peer)
        if mine is None or conn not in mine:
            return
        del mine[conn]
        if not mine:
            del self._by_peer[conn.peer]
        self._loop.remove_reader(conn.fd)
        self._loop.remove_writer(conn.fd)
        conn.sock.close()
        self.connections -= 1
        self._on_count(self.connections)

    def _expire(self) -> None:
        self._sweep = None
        now = time.monotonic()
        late = [c for conns in self._by_peer.values() for c in conns if c.deadline <= now]
        for c in late:
            self._drop(c)
        if self.connections and not self._closed:
            self._sweep = self._loop.call_later(SWEEP_S, self._expire)

    def close(self) -> None:
        self._closed = True
        for s in self.listeners:
            self._loop.remove_reader(s.fileno())
            s.close()
        for c in [c for conns in self._by_peer.values() for c in conns]:
            self._drop(c)
        if self._sweep is not None:
            self._sweep.cancel()
            self._sweep = None
        self._peers.close()


def listen(host: str, port: int) -> list[socket.socket]:
    """Non-blocking listening sockets on every address ``host`` resolves to (IPv6 ones v6-only), all on
    one port (the first one's, when ``port`` is 0). OSError when none can be bound."""
    infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    out: list[socket.socket] = []
    seen: set[tuple] = set()
    try:
        for family, kind, proto, _, addr in infos:
            if (family, addr[:2]) in seen:
                continue
            seen.add((family, addr[:2]))
            s = socket.socket(family, kind, proto)
            out.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            if family == socket.AF_INET6:
                s.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
            s.bind((addr[0], out[0].getsockname()[1] if len(out) > 1 else port, *addr[2:]))
            s.listen(BACKLOG)
            s.setblocking(False)
    except OSError:
        for s in out:
            s.close()
        raise
    return out


async def start_http(server: Server, host: str, port: int) -> MetricsServer:
    routes: dict[str, Route] = {
        "/healthz": lambda: (200, "text/plain; charset=utf-8", b"ok\n"),
        "/readyz": lambda: _readyz(server),
    }
    fds = server.fds

    def count(n: int) -> None:
        fds.http_conns = n

    return MetricsServer(asyncio.get_running_loop(), listen(host, port), routes,
                         lambda: generate_latest(server.metrics.registry), tight=fds.tight, on_count=count)


def _readyz(server: Server) -> tuple[int, str, bytes]:
    p = server.pool
    ready = server.ready.is_set() and p.capacity_bytes > 0
    body = {"ready": ready, "pool_capacity_bytes": p.capacity_bytes, "pool_total_bytes": p.nbytes,
            "pool_pinned_bytes": p.pinned_bytes,
            "pinned_fraction": round(p.pinned_bytes / p.nbytes, 4) if p.nbytes else 0.0,
            "engines": len(server.engines), "backends": [b.name for b in server.backends]}
    return (200 if ready else 503), "application/json", (json.dumps(body) + "\n").encode()
