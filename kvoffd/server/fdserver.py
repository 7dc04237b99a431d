"""The fd socket: clients hand the daemon their CPU KV memory as a file descriptor (SCM_RIGHTS).

Why a descriptor and not a path: with a path the daemon opens memory with its own rights, so any
client could name memory it could not open itself (issue 18, defect 3: a confused deputy). A
descriptor proves the client holds the memory. The daemon answers with a random one-time token;
REGISTER names the token (memory kind ``cpu_fd``), the CPU backend maps the descriptor and closes it.

A small AF_UNIX SOCK_SEQPACKET listener served by the asyncio loop, never blocking it. Every resource
a client can make it hold is bounded: connections (MAX_CONNS, each closed after one request or
CONN_TIMEOUT_S), descriptors per message (one; the control buffer has room for MAX_FDS_PER_MSG so
extras are seen and closed, the kernel closes anything beyond), pending descriptors per client pid
and in all (MAX_PENDING_PER_PID, MAX_PENDING) and how long one waits for its REGISTER (TOKEN_TTL_S).
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
from dataclasses import dataclass

import msgspec

from kvoffd_client.protocol import MAX_FD_MESSAGE

log = logging.getLogger(__name__)

MAX_CONNS = 32
MAX_FDS_PER_MSG = 4
MAX_PENDING = 256
MAX_PENDING_PER_PID = 8
TOKEN_TTL_S = 30.0
CONN_TIMEOUT_S = 2.0
_CMSG_SPACE = socket.CMSG_SPACE(MAX_FDS_PER_MSG * 4)
_UCRED = struct.Struct("3i")  # the kernel's struct ucred (SO_PEERCRED): pid, uid, gid


@dataclass
class PendingFd:
    """A descriptor a client handed over, waiting for the REGISTER that names its token."""

    fd: int
    size: int
    pid: int  # as the daemon's pid namespace sees it (SO_PEERCRED)
    uid: int
    expires: float


@dataclass
class _Client:
    sock: socket.socket
    deadline: float


class FdServer:
    def __init__(self, path: str):
        self.path = path
        self._pending: dict[str, PendingFd] = {}
        self._clients: dict[int, _Client] = {}
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
        for p in self._pending.values():
            os.close(p.fd)
        self._pending.clear()
        try:  # not a newer daemon's socket that took the path over
            st = os.lstat(self.path)
            if stat.S_ISSOCK(st.st_mode) and st.st_ino == self._ino:
                os.unlink(self.path)
        except OSError:
            pass  # gone already

    @property
    def pending(self) -> int:
        return len(self._pending)

    def claim(self, token: str) -> PendingFd | None:
        """The descriptor under ``token``, once: the caller owns it from now on (must close it)."""
        p = self._pending.pop(token, None)
        if p is not None and p.expires < time.monotonic():
            os.close(p.fd)
            return None
        return p

    def expire(self, now: float) -> None:
        """Close descriptors nobody registered in time and connections that said nothing."""
        for token in [t for t, p in self._pending.items() if p.expires < now]:
            p = self._pending.pop(token)
            log.info("fd from pid %d expired unclaimed after %.0f s", p.pid, TOKEN_TTL_S)
            os.close(p.fd)
        for c in [c for c in self._clients.values() if c.deadline < now]:
            self._drop_client(c)

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
            if len(self._clients) >= MAX_CONNS:
                conn.close()
                continue
            conn.setblocking(False)
            c = _Client(conn, time.monotonic() + CONN_TIMEOUT_S)
            self._clients[conn.fileno()] = c
            self._loop.add_reader(conn.fileno(), self._read, c)

    def _drop_client(self, c: _Client) -> None:
        fd = c.sock.fileno()
        if self._clients.pop(fd, None) is not None:
            self._loop.remove_reader(fd)
        c.sock.close()

    def _read(self, c: _Client) -> None:
        try:
            data, anc, flags, _ = c.sock.recvmsg(MAX_FD_MESSAGE, _CMSG_SPACE)
        except BlockingIOError:
            return
        except OSError:
            self._drop_client(c)
            return
        fds = _fds_of(anc)
        try:
            reply = self._admit(c.sock, data, fds, flags)
        except Exception:
            log.exception("fd socket: internal error")
            reply = {"error": "internal", "message": "internal error; see the daemon log"}
        if "token" not in reply:
            for fd in fds:
                os.close(fd)
        try:
            c.sock.send(msgspec.msgpack.encode(reply))
        except OSError:
            pass  # the client left; a token it never learnt expires
        self._drop_client(c)

    def _admit(self, sock: socket.socket, data: bytes, fds: list[int], flags: int) -> dict:
        """Keep the one descriptor under a fresh token, or say why not (then the caller closes them)."""
        if flags & (socket.MSG_CTRUNC | socket.MSG_TRUNC) or len(fds) != 1:
            return {"error": "bad_frame", "message": "send exactly one descriptor with one small request"}
        try:
            req = msgspec.msgpack.decode(data)
        except msgspec.DecodeError:
            return {"error": "bad_frame", "message": "the request is not msgpack"}
        size = req.get("size") if isinstance(req, dict) else None
        if type(size) is not int or size <= 0:
            return {"error": "bad_field", "message": "size must be a positive integer"}
        pid, uid, _ = _UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size))
        now = time.monotonic()
        self.expire(now)
        if len(self._pending) >= MAX_PENDING or sum(p.pid == pid for p in self._pending.values()) \
                >= MAX_PENDING_PER_PID:
            return {"error": "too_many", "message": f"too many descriptors waiting for REGISTER (at most "
                                                    f"{MAX_PENDING_PER_PID} per process, {MAX_PENDING} in all)"}
        token = secrets.token_hex(16)
        self._pending[token] = PendingFd(fds[0], size, pid, uid, now + TOKEN_TTL_S)
        return {"token": token}


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
