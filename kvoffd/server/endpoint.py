"""Where the daemon listens: the ROUTER's options, the ipc path policy, and the ledger of big replies
libzmq has not sent yet. The loop (kvoffd/server/loop.py) drives these; none of it decides anything.
"""

from __future__ import annotations

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
