"""The fd socket: clients hand the daemon their KV memory as file descriptors (SCM_RIGHTS), in batches.

Why a descriptor and not a path: with a path the daemon opens memory with its own rights, so any
client could name memory it could not open itself (a confused deputy). A
descriptor proves the client holds the memory. Why a batch under one token: VMM memory (``cuda_vmm``)
is one descriptor per physical allocation, thousands for a real KV cache; the daemon answers
one random one-time token for the whole ordered list, REGISTER names it, and the backend maps the
descriptors and closes them. ``cpu_fd`` memory is a batch of one. The exchange is
kvoffd_client.protocol.fdsocket's (docs/protocol.md, "The fd socket").

A small AF_UNIX SOCK_SEQPACKET listener served by the asyncio loop, never blocking it. Every resource
a client can make it hold is bounded, and counted in descriptors, not tokens: connections (MAX_CONNS,
each closed after one batch, CONN_TIMEOUT_S to say how many descriptors follow and BATCH_TIMEOUT_S to
send them; when all are taken a newcomer takes a slot from the process that holds the most, or one
that has said nothing for IDLE_GRACE_S: else one process holding every slot makes every engine's
REGISTER fail), descriptors per message (MAX_FDS_PER_MESSAGE; the control buffer has room for one more, so
one too many is seen and closed, the kernel closes anything beyond), descriptors held per client pid
and in all (promised by a batch in progress, received, or waiting for their REGISTER:
MAX_PENDING_FDS_PER_PID, MAX_PENDING_FDS), the daemon's descriptor budget (a batch that would reach
into the reserve REGISTER keeps is refused before any of its descriptors arrives), and how long a
batch waits for its REGISTER (TOKEN_TTL_S). Every descriptor received is kept under its token or
closed: on a malformed, short or overlong batch, a timeout, a client that leaves mid-batch, expiry.
"""

from __future__ import annotations

import array
import asyncio
import errno
import logging
import os
import secrets
import socket
import stat
import struct
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import msgspec

from kvoffd.server.ratelog import RateLimitedLog
from kvoffd_client.protocol import (
    FD_SOCKET_VERSION,
    MAX_BATCH_FDS,
    MAX_FD_MESSAGE,
    MAX_FDS_PER_MESSAGE,
    ErrorCode,
    FdBatch,
    FdChunk,
    FdReply,
)

if TYPE_CHECKING:
    from kvoffd.server.fdbudget import FdBudget

log = logging.getLogger(__name__)

MAX_CONNS = 32
#: one full ``cuda_vmm`` registration per process may wait; four of them in all (a TP-4 engine's start)
MAX_PENDING_FDS_PER_PID = MAX_BATCH_FDS
MAX_PENDING_FDS = 4 * MAX_BATCH_FDS
TOKEN_TTL_S = 30.0
CONN_TIMEOUT_S = 2.0  # connect to FdBatch
IDLE_GRACE_S = 0.5  # a connection silent this long may lose its slot to a newcomer (a client speaks at once)
BATCH_TIMEOUT_S = 10.0  # FdReply.ready to the last chunk (16,384 descriptors take ~50 ms)
_CMSG_SPACE = socket.CMSG_SPACE((MAX_FDS_PER_MESSAGE + 1) * 4)
_UCRED = struct.Struct("3i")  # the kernel's struct ucred (SO_PEERCRED): pid, uid, gid
_ENC = msgspec.msgpack.Encoder()
_BATCH = msgspec.msgpack.Decoder(FdBatch)
_CHUNK = msgspec.msgpack.Decoder(FdChunk)


class Refused(Exception):
    """A batch the fd socket will not take: answered ``{"error": code, "message": ...}``, then the
    connection is closed with every descriptor it brought."""

    def __init__(self, code: ErrorCode, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class Handover:
    """A batch of descriptors a client handed over, in order, waiting for the REGISTER that names its
    token. Whoever claims it owns the descriptors (must close them)."""

    fds: list[int]
    sizes: list[int]  # as the client declared them, one per descriptor
    pid: int  # as the daemon's pid namespace sees it (SO_PEERCRED)
    uid: int
    expires: float

    def close(self) -> None:
        fds, self.fds = self.fds, []
        for fd in fds:
            os.close(fd)

    def pass_on(self) -> Handover:
        """These descriptors in a handover of their own, for whoever takes them next (a transfer
        backend's ``attach``); this one is emptied, so closing it no longer touches them."""
        fds, self.fds = self.fds, []
        return Handover(fds=fds, sizes=list(self.sizes), pid=self.pid, uid=self.uid, expires=self.expires)


@dataclass
class _Client:
    sock: socket.socket
    deadline: float
    pid: int = 0  # SO_PEERCRED, at accept: (uid, pid) is the peer that shares the table fairly
    uid: int = 0
    opened: float = 0.0  # monotonic
    count: int = 0  # descriptors promised (FdBatch.count); 0 until the client said
    fds: list[int] = field(default_factory=list)  # received so far: closed unless they become a Handover
    sizes: list[int] = field(default_factory=list)


class FdServer:
    """``budget`` (the daemon's FdBudget; None in tests of the socket alone) is consulted before a batch
    is accepted; ``per_pid`` and ``in_all`` bound the descriptors held (tests lower them)."""

    def __init__(self, path: str, budget: FdBudget | None = None, *, per_pid: int = MAX_PENDING_FDS_PER_PID,
                 in_all: int = MAX_PENDING_FDS):
        self.path = path
        self.budget = budget
        self.per_pid = per_pid
        self.in_all = in_all
        self._pending: dict[str, Handover] = {}
        self._clients: dict[int, _Client] = {}
        self._held: dict[int, int] = {}  # pid -> descriptors promised, received or pending
        self._held_total = 0
        self._conns_of: dict[tuple[int, int], int] = {}  # (uid, pid) -> its connections in _clients
        self.turned_away = 0  # connections refused (all slots taken by fair holders) or evicted for room
        self._warn = RateLimitedLog(log, 60.0)
        self._loop: asyncio.AbstractEventLoop | None = None
        self._timer: asyncio.TimerHandle | None = None
        self._sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)
        try:
            self._sock.bind(path)
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        self._ino = os.lstat(path).st_ino  # removed at close only while it is still ours
        self._sock.listen(64)
        self._sock.setblocking(False)

    # -- lifecycle --------------------------------------------------------------------------------

    def start(self, loop: asyncio.AbstractEventLoop) -> None:
        self._loop = loop
        loop.add_reader(self._sock.fileno(), self._accept)
        self._tick()

    def _tick(self) -> None:
        self.expire(time.monotonic())
        self._timer = self._loop.call_later(1.0, self._tick)

    def close(self) -> None:
        if self._loop is not None:
            self._timer.cancel()
            self._loop.remove_reader(self._sock.fileno())
            for c in list(self._clients.values()):
                self._drop_client(c)
        self._sock.close()
        for token in list(self._pending):
            self._forget(token).close()
        try:  # not a newer daemon's socket that took the path over
            st = os.lstat(self.path)
            if stat.S_ISSOCK(st.st_mode) and st.st_ino == self._ino:
                os.unlink(self.path)
        except OSError:
            pass  # gone already

    @property
    def pending(self) -> int:
        """Batches waiting for their REGISTER."""
        return len(self._pending)

    @property
    def held(self) -> int:
        """Descriptors held or promised: batches in progress and batches waiting for their REGISTER."""
        return self._held_total

    @property
    def receiving(self) -> int:
        """Descriptors received by batches still in progress."""
        return sum(len(c.fds) for c in self._clients.values())

    def claim(self, token: str) -> Handover | None:
        """The batch under ``token``, once: the caller owns its descriptors from now on (must close them)."""
        if token not in self._pending:
            return None
        h = self._forget(token)
        if h.expires < time.monotonic():
            h.close()
            return None
        return h

    def expire(self, now: float) -> None:
        """Close batches nobody registered in time, and connections past their deadline (with what they
        brought)."""
        self._expire_tokens(now)
        for c in [c for c in self._clients.values() if c.deadline < now]:
            if c.count:
                self._refuse(c, Refused(ErrorCode.BAD_FRAME, f"{len(c.fds)} of the {c.count} descriptors "
                                        f"announced arrived within {BATCH_TIMEOUT_S:.0f} s"))
            else:
                self._drop_client(c)

    def _expire_tokens(self, now: float) -> None:
        for token in [t for t, h in self._pending.items() if h.expires < now]:
            h = self._forget(token)
            log.info("%d descriptor(s) from pid %d expired unclaimed after %.0f s", len(h.fds), h.pid, TOKEN_TTL_S)
            h.close()

    # -- bookkeeping ------------------------------------------------------------------------------

    def _hold(self, pid: int, n: int) -> None:
        self._held[pid] = self._held.get(pid, 0) + n
        self._held_total += n

    def _release(self, pid: int, n: int) -> None:
        left = self._held.get(pid, 0) - n
        if left > 0:
            self._held[pid] = left
        else:
            self._held.pop(pid, None)
        self._held_total -= n

    def _forget(self, token: str) -> Handover:
        h = self._pending.pop(token)
        self._release(h.pid, len(h.fds))
        return h

    # -- serving ----------------------------------------------------------------------------------

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self._sock.accept()
            except BlockingIOError:
                return
            except OSError as e:  # EMFILE and friends: leave the backlog, try again on the next event
                log.warning("fd socket: accept failed: %s", e.strerror)
                return
            try:
                pid, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
            except OSError:
                conn.close()  # gone already
                continue
            now = time.monotonic()
            if len(self._clients) >= MAX_CONNS and not self._make_room((uid, pid), now):
                self._turn_away(conn, pid, uid)
                continue
            conn.setblocking(False)
            c = _Client(conn, now + CONN_TIMEOUT_S, pid=pid, uid=uid, opened=now)
            self._clients[conn.fileno()] = c
            self._conns_of[uid, pid] = self._conns_of.get((uid, pid), 0) + 1
            self._loop.add_reader(conn.fileno(), self._read, c)

    def _make_room(self, peer: tuple[int, int], now: float) -> bool:
        """A slot for a newcomer from ``peer`` when all are taken: the peer that holds the most (by at
        least two more than the newcomer's) gives up its oldest connection that has not started a batch
        (else its oldest); otherwise the oldest connection silent past IDLE_GRACE_S, from the peers that
        hold the most first. False: every slot is held fairly and is in use (the newcomer is turned away)."""
        mine = self._conns_of.get(peer, 0)
        top, most = max(self._conns_of.items(), key=lambda kv: kv[1])
        if most > mine + 1:
            victim = min((c for c in self._clients.values() if (c.uid, c.pid) == top),
                         key=lambda c: (c.count > 0, c.opened))
        else:
            idle = [c for c in self._clients.values() if not c.count and now - c.opened > IDLE_GRACE_S]
            if not idle:
                return False
            victim = min(idle, key=lambda c: (-self._conns_of[c.uid, c.pid], c.opened))
        held = self._conns_of[victim.uid, victim.pid]
        self.turned_away += 1
        self._warn("evicted", logging.WARNING, "fd socket: all %d connections in use; one of pid %d's %d gave its "
                   "slot to a newcomer", MAX_CONNS, victim.pid, held)
        self._refuse(victim, Refused(ErrorCode.TOO_MANY, f"all {MAX_CONNS} fd-socket connections were in use and "
                                     f"this process held {held} of them: its slot went to another process"))
        return True

    def _turn_away(self, conn: socket.socket, pid: int, uid: int) -> None:
        """A newcomer with no slot: told why (a client reports it), then closed."""
        self.turned_away += 1
        self._warn("refused", logging.WARNING, "fd socket: all %d connections in use by clients that are "
                   "sending batches; refused a connection from pid %d", MAX_CONNS, pid)
        msg = FdReply(error=ErrorCode.TOO_MANY.value, message=f"all {MAX_CONNS} fd-socket connections are in use; "
                      f"this process holds {self._conns_of.get((uid, pid), 0)} of them; try again")
        try:
            conn.setblocking(False)
            conn.send(_ENC.encode(msg))
        except OSError:
            pass
        conn.close()

    def _drop_client(self, c: _Client) -> None:
        """Close the connection and every descriptor it brought that did not become a Handover."""
        fd = c.sock.fileno()
        if self._clients.pop(fd, None) is not None:
            self._loop.remove_reader(fd)
            if c.count:
                self._release(c.pid, c.count)
            left = self._conns_of[c.uid, c.pid] - 1
            if left:
                self._conns_of[c.uid, c.pid] = left
            else:
                del self._conns_of[c.uid, c.pid]
        c.sock.close()
        fds, c.fds = c.fds, []
        for f in fds:
            os.close(f)

    def _refuse(self, c: _Client, e: Refused) -> None:
        if c.count:
            log.info("fd socket: batch of %d from pid %d refused: %s", c.count, c.pid, e.message)
        self._send(c, FdReply(error=e.code.value, message=e.message))
        self._drop_client(c)

    def _send(self, c: _Client, reply: FdReply) -> None:
        try:
            c.sock.send(_ENC.encode(reply))
        except OSError:
            pass  # the client left; a token it never learnt expires

    def _read(self, c: _Client) -> None:
        """Every message queued on the connection (level-triggered: what is left calls again)."""
        while c.sock.fileno() >= 0:
            try:
                data, anc, flags, _ = c.sock.recvmsg(MAX_FD_MESSAGE, _CMSG_SPACE)
            except BlockingIOError:
                return
            except OSError:
                self._drop_client(c)
                return
            fds = _fds_of(anc)
            c.fds.extend(fds)  # ours now: closed by _drop_client unless they become a Handover
            if fds and self.budget is not None:
                self.budget.took(len(fds))
            if not data and not fds:  # the client left (mid-batch: what it sent is closed)
                self._drop_client(c)
                return
            try:
                if not c.count:
                    self._begin(c, data, fds, flags)
                else:
                    self._chunk(c, data, fds, flags)
            except Refused as e:
                self._refuse(c, e)
                return
            except Exception:
                log.exception("fd socket: internal error")
                self._refuse(c, Refused(ErrorCode.INTERNAL, "internal error; see the daemon log"))
                return

    def _begin(self, c: _Client, data: bytes, fds: list[int], flags: int) -> None:
        """FdBatch: check the count against every bound before a descriptor may come, then promise it."""
        if fds or flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
            raise Refused(ErrorCode.BAD_FRAME, "first say how many descriptors follow ({\"v\": 1, \"count\": N}), "
                          "with no descriptor")
        batch = _decode(_BATCH, data, "batch", "the request is not an fd-socket batch (msgpack map)")
        if batch.v != FD_SOCKET_VERSION:
            raise Refused(ErrorCode.VERSION_MISMATCH, f"fd socket version {batch.v}; this daemon speaks "
                          f"{FD_SOCKET_VERSION}")
        now = time.monotonic()
        self._expire_tokens(now)  # (not the connections: this one may be past its deadline by now)
        n = batch.count
        if self._held.get(c.pid, 0) + n > self.per_pid or self._held_total + n > self.in_all:
            raise Refused(ErrorCode.TOO_MANY, f"{n} more descriptors would exceed what may wait for REGISTER (at "
                          f"most {self.per_pid} per process, {self.in_all} in all; this process has "
                          f"{self._held.get(c.pid, 0)})")
        if self.budget is not None:
            promised = sum(o.count - len(o.fds) for o in self._clients.values() if o.count)
            room = self.budget.headroom() - self.budget.reserve - promised
            if n >= room:
                log.warning("fd socket: refused a batch of %d descriptors from pid %d: the daemon has room "
                            "for %d before its reserve (%d in use, limit %d)", n, c.pid, max(room, 0),
                            self.budget.in_use(), self.budget.limit)
                raise Refused(ErrorCode.TOO_MANY, f"a batch of {n} descriptors would reach into the daemon's "
                              f"reserve of file descriptors ({max(room - 1, 0)} more fit now; RLIMIT_NOFILE "
                              f"{self.budget.limit}): raise the daemon's limit or register fewer pieces")
        c.count = n
        self._hold(c.pid, n)
        c.deadline = now + BATCH_TIMEOUT_S
        self._send(c, FdReply(ready=n))

    def _chunk(self, c: _Client, data: bytes, fds: list[int], flags: int) -> None:
        """FdChunk: its descriptors (already in ``c.fds``) with their sizes; the last one makes the token."""
        if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC):
            raise Refused(ErrorCode.BAD_FRAME, f"a message carries more than {MAX_FDS_PER_MESSAGE} descriptors "
                          f"or {MAX_FD_MESSAGE} bytes")
        chunk = _decode(_CHUNK, data, "chunk", "a chunk is not msgpack")
        if len(chunk.sizes) != len(fds):
            raise Refused(ErrorCode.BAD_FRAME, f"a chunk of {len(fds)} descriptors gives {len(chunk.sizes)} sizes")
        if len(c.fds) > c.count:
            raise Refused(ErrorCode.BAD_FRAME, f"more descriptors than the {c.count} announced")
        c.sizes.extend(chunk.sizes)
        if len(c.fds) < c.count:
            return
        token = secrets.token_hex(16)
        self._pending[token] = Handover(c.fds, c.sizes, c.pid, c.uid, time.monotonic() + TOKEN_TTL_S)
        c.fds, c.count = [], 0  # the Handover holds them (and the promise) now
        self._send(c, FdReply(token=token))
        self._drop_client(c)


def _decode(decoder: msgspec.msgpack.Decoder, data: bytes, what: str, not_msgpack: str):
    """One fd-socket message, typed; Refused ``bad_field`` (wrong fields) or ``bad_frame`` (not msgpack)."""
    try:
        return decoder.decode(data)
    except msgspec.ValidationError as e:
        raise Refused(ErrorCode.BAD_FIELD, f"{what}: {e}") from None
    except msgspec.DecodeError:
        raise Refused(ErrorCode.BAD_FRAME, not_msgpack) from None
    except RecursionError:  # nested thousands deep: no fd-socket message nests at all
        raise Refused(ErrorCode.BAD_FRAME, "msgpack nested too deeply") from None


def _fds_of(anc: list[tuple[int, int, bytes]]) -> list[int]:
    fds: list[int] = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(data[: len(data) - len(data) % a.itemsize])
            fds.extend(a)
    return fds


def fd_socket_path(bound_address: str, runtime_dir: str) -> str:
    """Where the fd socket lives: beside the ipc socket, else in the daemon's runtime directory."""
    if bound_address.startswith("ipc://"):
        return bound_address[6:] + ".fd"
    if bound_address.startswith("tcp://"):
        return os.path.join(runtime_dir, f"kvoffd-tcp-{bound_address.rpartition(':')[2]}.fd")
    return os.path.join(runtime_dir, f"kvoffd-{os.getpid()}.fd")


def remove_stale_socket(path: str) -> None:
    """Unlink a left-over socket file (the caller has proven no daemon serves there)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(st.st_mode):
        raise OSError(errno.EEXIST, f"{path} exists and is not a socket; remove it")
    os.unlink(path)
