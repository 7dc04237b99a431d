"""File descriptors as a budget: the daemon must never run out of them because of a client.

Why: libzmq's ipc listener asserts (SIGABRT, the whole daemon) when ``accept`` fails with EMFILE, and
its tcp listener spins on it. Every client connection, every HTTP scrape and every transient file the
daemon opens draws from the same RLIMIT_NOFILE. So the daemon raises its soft limit to the hard one at
start, keeps a reserve of descriptors that clients can never take, and stops libzmq accepting
(ListenerGuard) before the reserve is touched; it accepts again once the pressure is gone.
Connections that never speak are dropped by libzmq after ``HANDSHAKE_IVL_MS``, which is what lets the
pressure go. docs/reliability.md ("File descriptors") has the figures.
"""

from __future__ import annotations

import asyncio
import logging
import os
import resource
import socket
from collections.abc import Callable

import zmq

log = logging.getLogger(__name__)

RESERVE_MIN = 256  # descriptors clients can never take (pidfds, engine files, executors, logs...)
RESERVE_FRACTION = 4  # ...or a quarter of the limit, whichever is more: room for an accept burst
HANDSHAKE_IVL_MS = 2000  # a peer that has not finished the ZMTP greeting by then is dropped
HTTP_MAX_CONNS = 64  # concurrent metrics connections; more are closed at once
HTTP_BACKLOG = 64  # pending metrics connections the kernel queues (accepted in one loop turn at most)
HTTP_TIMEOUT_S = 2.0  # a scrape must send its request head within this
MONITOR_BATCH = 4096  # monitor events handled per loop callback
REFUSE_BATCH = 256  # connections refused per loop callback while paused
LISTEN_BACKLOG = 128

_ACCEPTED = int(zmq.EVENT_ACCEPTED)
_DISCONNECTED = int(zmq.EVENT_DISCONNECTED)


def raise_nofile_limit() -> tuple[int, int]:
    """Soft RLIMIT_NOFILE up to the hard one (the default soft limit, often 1024, is a relic of
    select()). Returns (before, after)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    target = hard
    if hard == resource.RLIM_INFINITY:
        try:
            with open("/proc/sys/fs/nr_open") as f:
                target = int(f.read())
        except (OSError, ValueError):
            target = 1 << 20
    if target > soft:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (OSError, ValueError) as e:
            log.warning("cannot raise the descriptor limit from %d to %d: %s", soft, target, e)
            return soft, soft
    return soft, max(soft, target)


def open_fds() -> int:
    """Descriptors this process holds now (one listdir of /proc/self/fd: ~1 ms per 10,000)."""
    try:
        return len(os.listdir("/proc/self/fd")) - 1  # listdir's own
    except OSError:
        return 0


class FdBudget:
    """How many descriptors are in use, cheaply: a measurement of /proc/self/fd (refreshed by
    housekeeping every second) plus the connections opened and closed since, counted from events.

    A quarter of the limit (at least RESERVE_MIN) is the reserve: ZeroMQ stops accepting before
    ``in_use`` reaches it, so a burst of accepts between a count and the reaction still finds
    descriptors, and the daemon's own work (mapping an engine, a pidfd) always does. REGISTER is
    refused one reserve earlier (at half the limit by default).
    """

    def __init__(self, limit: int | None = None) -> None:
        self.limit = limit if limit is not None else resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        self.reserve = max(RESERVE_MIN, self.limit // RESERVE_FRACTION)
        self.zmq_conns = 0  # accepted minus disconnected (socket monitor)
        self.http_conns = 0
        self._other = 0  # descriptors the daemon took since the last measurement (an engine's mapping)
        self._measured = 0
        self._zmq_at = 0
        self._http_at = 0
        self.calibrate()

    def calibrate(self) -> None:
        self._measured = open_fds()
        self._zmq_at, self._http_at, self._other = self.zmq_conns, self.http_conns, 0

    def took(self, n: int = 1) -> None:
        """The daemon may hold ``n`` more descriptors (counted until the next measurement)."""
        self._other += n

    def in_use(self) -> int:
        return self._measured + self._other + (self.zmq_conns - self._zmq_at) + (self.http_conns - self._http_at)

    def headroom(self) -> int:
        """Descriptors left before the reserve."""
        return self.limit - self.reserve - self.in_use()

    def tight(self) -> bool:
        """New connections must wait (the reserve would be next)."""
        return self.headroom() <= 0

    def engines_refused(self) -> bool:
        """REGISTER waits earlier than connections: registered engines stay, and the descriptors they
        may hold must never be what keeps new connections (an operator's ``kvoffd ctl``) out."""
        return self.headroom() <= self.reserve

    def relaxed(self) -> bool:
        """Room again with a margin (hysteresis: do not flap between bound and unbound)."""
        return self.headroom() >= self.reserve // 2

    def describe(self) -> dict:
        return {"limit": self.limit, "reserve": self.reserve, "in_use": self.in_use(),
                "zmq_connections": self.zmq_conns, "http_connections": self.http_conns}


def open_listener(addr: str, backlog: int) -> socket.socket | None:
    """The listening socket for a ZeroMQ ``ipc://`` or ``tcp://`` endpoint, made here and handed to
    libzmq (ZMQ_USE_FD) so that the daemon can stop libzmq accepting without closing it (see
    ListenerGuard). ``inproc://`` has no descriptor: None. An ipc socket file is created 0600."""
    if addr.startswith("ipc://"):
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old = os.umask(0o177)
        try:
            s.bind(addr[6:])
        finally:
            os.umask(old)
        os.chmod(addr[6:], 0o600)
    elif addr.startswith("tcp://"):
        host, _, port = addr[6:].rpartition(":")
        host = host.strip("[]")
        host = {"*": "0.0.0.0", "": "0.0.0.0"}.get(host, host)
        family = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0][0]
        s = socket.socket(family, socket.SOCK_STREAM)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((host, int(port)))
    else:
        return None
    s.listen(backlog)
    s.setblocking(False)
    return s


class ListenerGuard:
    """Counts a ZeroMQ socket's connections (socket monitor) and, while the descriptor budget is
    tight, stops libzmq accepting on the listener without closing it.

    Why not ``zmq_unbind``: libzmq's accepted sessions are children of the listener, so an unbind
    drops every established client too (measured: the well-behaved client's LOOKUP never came back).
    Instead libzmq is given a duplicate of a listening socket the daemon owns (ZMQ_USE_FD); to pause,
    that descriptor number is pointed (dup2) at a private listening socket that never has a
    connection, so libzmq's accept gets EAGAIN (which it tolerates) and never EMFILE. Meanwhile the
    daemon accepts and closes what queues on the real listener itself, one descriptor at a time (a
    refused client sees the connection close and retries). To resume, the number is pointed back. The
    epoll registration libzmq made stays valid throughout: it belongs to the real listener's open file,
    which the daemon keeps open. Runs on the event loop.
    """

    def __init__(self, ctx: zmq.Context, sock: zmq.Socket, listener: socket.socket | None, zmq_fd: int,
                 budget: FdBudget) -> None:
        self.budget = budget
        self._sock = sock
        self._listener = listener
        self._zmq_fd = zmq_fd
        self._dummy: socket.socket | None = None
        self.on_event: Callable[[int, int], None] | None = None  # (event, descriptor): kvoffd.server.tcpgate
        self.endpoint = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        self.paused = False
        self.pauses = 0
        self.refused = 0
        self.connections = 0  # this socket's share of budget.zmq_conns
        addr = f"inproc://kvoffd-monitor-{id(self):x}"
        sock.monitor(addr, _ACCEPTED | _DISCONNECTED)
        self.mon = ctx.socket(zmq.PAIR)
        self.mon.setsockopt(zmq.LINGER, 0)
        self.mon.setsockopt(zmq.RCVHWM, 0)  # never drop an event: the count must not drift
        self.mon.connect(addr)

    @property
    def fd(self) -> int:
        return self.mon.getsockopt(zmq.FD)

    def drain(self) -> bool:
        """Count queued events. True if more are left (the caller schedules another pass)."""
        recv = self.mon.recv
        more = True
        for _ in range(MONITOR_BATCH):
            try:
                head = recv(zmq.NOBLOCK)
            except zmq.Again:
                more = False
                break
            while self.mon.getsockopt(zmq.RCVMORE):
                recv(zmq.NOBLOCK)
            ev = int.from_bytes(head[:2], "little")
            if self.on_event is not None:
                self.on_event(ev, int.from_bytes(head[2:6], "little"))
            if ev == _ACCEPTED:
                self.budget.zmq_conns += 1
                self.connections += 1
            elif ev == _DISCONNECTED:
                self.budget.zmq_conns -= 1
                self.connections -= 1
        self.check()
        return more

    def check(self) -> None:
        if not self.paused and self.budget.tight():
            self._pause()
        elif self.paused and self.budget.relaxed():
            self._resume()

    def _pause(self) -> None:
        if self._listener is None:
            return
        if self._dummy is None:
            d = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            d.bind("")  # an autobound abstract name nobody is told
            d.listen(1)
            d.setblocking(False)
            self._dummy = d
        os.dup2(self._dummy.fileno(), self._zmq_fd, inheritable=False)
        self.paused = True
        self.pauses += 1
        asyncio.get_running_loop().add_reader(self._listener.fileno(), self._refuse)
        b = self.budget
        log.warning("descriptors nearly exhausted (%d in use, limit %d, %d client connections): refusing "
                    "new connections on %s until they drop", b.in_use(), b.limit, b.zmq_conns, self.endpoint)

    def _resume(self) -> None:
        asyncio.get_running_loop().remove_reader(self._listener.fileno())
        os.dup2(self._listener.fileno(), self._zmq_fd, inheritable=False)
        self.paused = False
        log.warning("descriptors available again (%d in use, limit %d; %d connections refused): accepting "
                    "on %s", self.budget.in_use(), self.budget.limit, self.refused, self.endpoint)

    def _refuse(self) -> None:
        """Close what queues on the listener while paused (libzmq, pointed elsewhere, would spin on it)."""
        for _ in range(REFUSE_BATCH):
            try:
                conn, _ = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as e:  # EMFILE, ECONNABORTED...: the next readiness tries again
                log.debug("refusing a connection: %s", e)
                return
            conn.close()
            self.refused += 1

    def close(self) -> None:
        """Before the ZeroMQ socket closes: libzmq must find its own listener under its descriptor."""
        if self.paused:  # (quietly: the daemon is stopping, not accepting again)
            asyncio.get_running_loop().remove_reader(self._listener.fileno())
            os.dup2(self._listener.fileno(), self._zmq_fd, inheritable=False)
            self.paused = False
        try:
            self._sock.disable_monitor()
        except zmq.ZMQError:
            pass
        self.mon.close(0)
        if self._dummy is not None:
            self._dummy.close()
