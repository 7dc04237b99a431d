"""Where the daemon listens: the ROUTER's options, the ipc path policy, and the ledger of big replies
libzmq has not sent yet. The loop (kvoffd/server/loop.py) drives these; none of it decides anything.
"""

from __future__ import annotations

import fcntl
import os
import socket
import stat
from collections import deque

import zmq

from kvoffd.runtime import ensure_private_dir
from kvoffd.server.fdbudget import HANDSHAKE_IVL_MS
from kvoffd.server.limits import (
    HARD_FRAME_LIMIT,
    MAX_UNREAD_REPLY_BYTES,
    MAX_UNREAD_REPLY_BYTES_PER_PEER,
    RCVHWM,
)


class AddressInUse(RuntimeError):
    pass


class AddressClaim:
    """This daemon's hold on its address, taken before anything else at start: a second daemon started
    on the same address stops there, with the one line that says why, before it opens a pool, a tier or
    a port (it used to log a pool-path tip and "disk tier disabled" first, both wrong: the pool and the
    tier were the first daemon's, locked by it).

    ipc://: a socket that answers is a daemon serving there (refused; a stale one is removed:
    ``prepare_ipc_path``), and ``<socket>.lock`` beside it, in the daemon's private directory, is
    locked (flock) from here until the socket is bound (``release``), so a daemon still starting there
    (adopting a large pool takes seconds) is found too. Once bound, the socket itself answers for it;
    an operator who removed a live daemon's socket file can start another there. tcp://: a listener
    on the port is refused (port 0, and a race with another start, are left to the bind, which
    refuses them too)."""

    def __init__(self, address: str):
        self.address = address
        self.lock_path = ""
        self._fd = -1
        if address.startswith("ipc://"):
            self._claim_ipc(address[6:])
        elif address.startswith("tcp://"):
            _refuse_a_listener(address)

    def _claim_ipc(self, path: str) -> None:
        ensure_private_dir(os.path.dirname(path) or ".")
        lock = path + ".lock"
        while True:
            fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                raise AddressInUse(f"another daemon is starting on {path} (it holds {lock})") from None
            try:
                same = os.fstat(fd).st_ino == os.lstat(lock).st_ino
            except FileNotFoundError:
                same = False
            if same:
                break
            os.close(fd)  # the daemon that held it stopped and removed it meanwhile: take the new one
        self._fd, self.lock_path = fd, lock
        try:
            prepare_ipc_path(path)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        """Once the socket is bound (or the start failed): the lock file goes, then the lock."""
        if self._fd >= 0:
            try:
                os.unlink(self.lock_path)
            except OSError:
                pass
            os.close(self._fd)
            self._fd = -1


def _refuse_a_listener(address: str) -> None:
    host, _, port = address[6:].rpartition(":")
    host = host.strip("[]")
    if not port.isdigit() or int(port) == 0:
        return
    try:
        family = socket.getaddrinfo(host, int(port), type=socket.SOCK_STREAM)[0][0]
    except OSError:
        return  # the bind says what is wrong with the host
    probe = socket.socket(family, socket.SOCK_STREAM)
    probe.settimeout(1.0)
    try:
        probe.connect((host, int(port)))
    except OSError:
        return
    finally:
        probe.close()
    raise AddressInUse(f"another process (another kvoffd?) listens on {host}:{port}; choose another --address port")


def new_router(ctx: zmq.Context) -> zmq.Socket:
    """The daemon's ROUTER, with the bounds that keep one client from costing the others."""
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.MAXMSGSIZE, HARD_FRAME_LIMIT)
    sock.setsockopt(zmq.RCVHWM, RCVHWM)
    sock.setsockopt(zmq.SNDHWM, 10_000)
    sock.setsockopt(zmq.ROUTER_HANDOVER, 1)  # a restarted client may reuse its routing id
    sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)  # a connect that never speaks costs an fd briefly
    sock.copy_threshold = 0  # big replies are sent zero-copy and tracked (UnreadReplies)
    return sock


def prepare_ipc_path(path: str) -> None:
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


def unlink_if_ours(path: str, ino: int) -> None:
    """Remove our socket file, unless it is no longer ours: a newer daemon that took the path over
    (after an operator removed ours) must not lose its socket when this one stops."""
    try:
        if os.lstat(path).st_ino == ino:
            os.unlink(path)
    except OSError:
        pass  # already gone (removed by an operator)


class UnreadReplies:
    """Big replies (EXPLAIN, STATS, a notice with a long failed list) counted until libzmq has handed
    them to the kernel. ROUTER's SNDHWM bounds messages, not bytes: a peer that asks and never reads
    would otherwise pile up gigabytes."""

    def __init__(self) -> None:
        self._by_peer: dict[bytes, deque[tuple[zmq.MessageTracker, int]]] = {}
        self.total = 0

    def pending(self, ident: bytes) -> int:
        """Bytes of the peer's replies not sent yet (forgetting those that have been)."""
        q = self._reclaim(ident)
        return sum(n for _, n in q) if q else 0

    def fits(self, pending: int, nbytes: int) -> bool:
        return (pending + nbytes <= MAX_UNREAD_REPLY_BYTES_PER_PEER
                and self.total + nbytes <= MAX_UNREAD_REPLY_BYTES)

    def track(self, ident: bytes, tracker: zmq.MessageTracker, nbytes: int) -> None:
        self._by_peer.setdefault(ident, deque()).append((tracker, nbytes))
        self.total += nbytes

    def reclaim_all(self) -> None:
        for ident in list(self._by_peer):
            self._reclaim(ident)

    def _reclaim(self, ident: bytes) -> deque | None:
        """Forget the peer's tracked replies that libzmq has sent (or dropped with the peer)."""
        q = self._by_peer.get(ident)
        if q is None:
            return None
        while q and q[0][0].done:
            self.total -= q.popleft()[1]
        if not q:
            del self._by_peer[ident]
            return None
        return q
