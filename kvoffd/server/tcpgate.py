"""tcp:// connections that have not shown the token yet: a short deadline and a budget of their own.

Why: over tcp:// any local user can connect; only token holders may talk (kvoffd.server.sessions). A
peer that completes the ZeroMQ handshake and then says nothing keeps its descriptor for as long as it
likes: libzmq drops only peers that do not finish the handshake (HANDSHAKE_IVL), and a ROUTER has no
call to drop one peer. Enough of them (~1,500 at 2,048 descriptors) stop the daemon accepting anyone,
token holders included (the descriptor guard, kvoffd.server.fdbudget), for as long as they stay.

So every connection the listener accepts (the socket monitor names its descriptor) is *unverified*
until a HELLO carrying the token arrives on it (each message says which descriptor it came on,
ZMQ_SRCFD). An unverified connection is dropped DEADLINE_S after it was accepted, and at most ``limit``
are open at once: a newcomer past it drops the oldest (a token holder says HELLO within milliseconds of
connecting; a silent peer has had its chance). The limit is an eighth of the descriptor limit, far below
where the guard stops accepting, so these peers never take what token holders need. Dropping is
shutdown(2) on the connection: libzmq sees its peer go and closes the descriptor itself (it stays
libzmq's to close).

Monitor events and messages are handled at different moments, and libzmq reuses descriptor numbers at
once. So what an event or a message says about a descriptor is checked against the socket's inode
(fstat) when it is handled, and a connection is dropped only through a duplicate of the descriptor whose
inode is the one recorded: a number reused by another connection (or a file) is never shut down.
"""

from __future__ import annotations

import errno
import logging
import os
import socket
import time

import zmq

from kvoffd.server.ratelog import RateLimitedLog

log = logging.getLogger(__name__)

DEADLINE_S = 3.0  # from accept to a HELLO with the token (a client sends it as soon as it is connected)
LIMIT_FRACTION = 8  # at most this part of RLIMIT_NOFILE is open unverified at once...
LIMIT_MIN, LIMIT_MAX = 16, 1024  # ...within these bounds
WARN_EVERY_S = 60.0
_ACCEPTED, _DISCONNECTED = int(zmq.EVENT_ACCEPTED), int(zmq.EVENT_DISCONNECTED)


def _inode(fd: int) -> int | None:
    """The inode of what ``fd`` is now (a socket's is unique while it is open); None if closed."""
    try:
        return os.fstat(fd).st_ino
    except OSError:
        return None


class TcpGate:
    """Which accepted tcp:// connections have not said HELLO with the token, and dropping them in time.
    Fed by the listener's socket monitor (``accepted``, ``disconnected``) and the loop (``hello``,
    ``expire``); runs on the event loop."""

    def __init__(self, fd_limit: int, deadline_s: float = DEADLINE_S):
        self.limit = max(LIMIT_MIN, min(LIMIT_MAX, fd_limit // LIMIT_FRACTION))
        self.deadline_s = deadline_s
        self._unverified: dict[int, tuple[int, float]] = {}  # fd -> (inode, deadline), oldest first
        self._verified: dict[int, int] = {}  # fd -> inode: a HELLO with the token came on it
        self.dropped = {"deadline": 0, "room": 0}
        self._warn = RateLimitedLog(log, WARN_EVERY_S)

    @property
    def pending(self) -> int:
        """Unverified connections open now."""
        return len(self._unverified)

    def describe(self) -> dict:
        return {"connections": len(self._unverified), "limit": self.limit, "deadline_s": self.deadline_s,
                "dropped": dict(self.dropped)}

    def on_event(self, ev: int, fd: int) -> None:
        """A socket monitor event of the listener (kvoffd.server.fdbudget.ListenerGuard)."""
        if ev == _ACCEPTED:
            self.accepted(fd, time.monotonic())
        elif ev == _DISCONNECTED:
            self.disconnected(fd)

    def accepted(self, fd: int, now: float) -> None:
        """The listener accepted a connection on ``fd``: unverified, unless its HELLO was read first."""
        ino = _inode(fd)
        if ino is None:
            return  # closed already (its disconnect event follows)
        if self._verified.get(fd) == ino:
            return  # the same connection: its HELLO was handled before this event
        self._verified.pop(fd, None)
        self._unverified.pop(fd, None)
        self._unverified[fd] = (ino, now + self.deadline_s)
        while len(self._unverified) > self.limit:
            self._drop(next(iter(self._unverified)), "room")

    def disconnected(self, fd: int) -> None:
        """A connection on ``fd`` ended: forget what was recorded, unless ``fd`` is already a newer one's."""
        ino = _inode(fd)
        entry = self._unverified.get(fd)
        if entry is not None and entry[0] != ino:
            del self._unverified[fd]
        if fd in self._verified and self._verified[fd] != ino:
            del self._verified[fd]

    def hello(self, fd: int, authentic: bool) -> None:
        """A HELLO came on ``fd``; ``authentic``: it carried the token. Only then is the connection kept."""
        if not authentic or fd < 0:
            return
        ino = _inode(fd)
        if ino is None:
            return
        self._unverified.pop(fd, None)
        self._verified[fd] = ino

    def expire(self, now: float) -> None:
        """Drop the unverified connections past their deadline (oldest first: deadlines are in order)."""
        while self._unverified:
            fd, (_, deadline) = next(iter(self._unverified.items()))
            if deadline > now:
                return
            self._drop(fd, "deadline")

    def _drop(self, fd: int, why: str) -> None:
        ino, _ = self._unverified.pop(fd)
        try:
            dup = os.dup(fd)  # pins the open file: its inode cannot change under the check
        except OSError as e:
            if e.errno == errno.EBADF:
                return  # closed already
            dup = -1  # out of descriptors: check and shut down through the number itself
        try:
            if _inode(dup if dup >= 0 else fd) != ino or not _shutdown(dup if dup >= 0 else fd):
                return  # the number is another connection's (or a file's) now, or it is not connected
        finally:
            if dup >= 0:
                os.close(dup)
        self.dropped[why] += 1
        if why == "deadline":
            self._warn(why, logging.WARNING, "tcp:// connections that did not say HELLO with the auth token "
                       "within %.0f s are dropped (%d so far)", self.deadline_s, self.dropped[why])
        else:
            self._warn(why, logging.WARNING, "more than %d tcp:// connections without the auth token at once: "
                       "the oldest are dropped (%d so far)", self.limit, self.dropped[why])


def _shutdown(fd: int) -> bool:
    """shutdown(2) on the socket ``fd``, which stays open (the socket object only borrows it)."""
    try:
        s = socket.socket(fileno=fd)
    except OSError:
        return False  # not a socket
    try:
        s.shutdown(socket.SHUT_RDWR)
        return True
    except OSError:
        return False
    finally:
        s.detach()
