"""Local trust: check that a UNIX socket is the daemon's, and hand it memory as a file descriptor.

Two jobs, both about never giving memory or messages to a process that merely got to a path first:

  * ``check_socket_path`` — the socket's directory must belong to this user (or root) and be writable
    by nobody else, and the socket itself must belong to this user (or root). Only then can no other
    user have put a socket there, or replace it later (docs/security.md, "Who can connect").
  * ``send_fds`` — the CPU connector's KV memory is an anonymous, sealed memfd, a VMM engine's is one
    descriptor per physical allocation; they reach the daemon as file descriptors over its fd socket
    (SCM_RIGHTS), never as paths, as one batch. The daemon answers with one one-time token naming the
    whole ordered list, which REGISTER then names (memory kinds ``cpu_fd``, ``cuda_vmm``;
    docs/protocol.md). The daemon can map only memory its client could open, and holds nothing that
    outlives both.

Standard library and msgspec only: imported in vLLM's processes.
"""

from __future__ import annotations

import os
import socket
import stat
import struct

import msgspec

from kvoffd_client import protocol as P
from kvoffd_client.memory.local import LocalMemory
from kvoffd_client.protocol import (
    FD_SOCKET_VERSION,
    MAX_FD_MESSAGE,
    MAX_FDS_PER_MESSAGE,
    FdBatch,
    FdChunk,
    FdReply,
)

UCRED = struct.Struct("3i")  # pid, uid, gid


class UntrustedSocket(OSError):
    """A socket path another user could have placed or could replace: never connected to."""


class FdRefused(Exception):
    """The daemon did not accept the descriptor (``code`` as in protocol.ErrorCode)."""

    def __init__(self, code: str, message: str):
        super().__init__(f"{code}: {message}")
        self.code = code
        self.message = message


def _trusted_owner(uid: int) -> bool:
    return uid in (os.getuid(), 0)


def check_socket_path(path: str, must_exist: bool = True) -> None:
    """Raise UntrustedSocket unless ``path`` and its directory can only be this user's (or root's).

    The directory is followed through links (an operator may link a runtime dir), the socket is not.
    """
    d = os.path.dirname(path) or "."
    try:
        st = os.stat(d)
    except FileNotFoundError:
        if must_exist:
            raise UntrustedSocket(f"no socket directory {d}") from None
        return  # no daemon yet: nothing to connect to, nothing to trust
    except OSError as e:
        raise UntrustedSocket(e.errno, f"socket directory {d}: {e.strerror}") from None
    if not _trusted_owner(st.st_uid):
        raise UntrustedSocket(f"socket directory {d} belongs to uid {st.st_uid}, not to this user "
                              f"({os.getuid()}) or root: refusing to connect")
    if stat.S_IMODE(st.st_mode) & 0o022:
        raise UntrustedSocket(f"socket directory {d} is writable by other users (mode "
                              f"{stat.S_IMODE(st.st_mode):o}): refusing to connect")
    try:
        sst = os.lstat(path)
    except FileNotFoundError:
        if must_exist:
            raise UntrustedSocket(f"no socket at {path}") from None
        return
    if not stat.S_ISSOCK(sst.st_mode):
        raise UntrustedSocket(f"{path} is not a socket")
    if not _trusted_owner(sst.st_uid):
        raise UntrustedSocket(f"socket {path} belongs to uid {sst.st_uid}, not to this user or root: "
                              "refusing to connect")


def peer_uid(sock: socket.socket) -> int:
    return UCRED.unpack(sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, UCRED.size))[1]


def send_fds(path: str, fds: list[int], sizes: list[int], timeout_s: float = 2.0) -> str:
    """Give ``fds`` (each holding ``sizes[i]`` bytes) to the daemon as one batch; returns the one token
    that names the ordered list (protocol.fdsocket: count first, then chunks of MAX_FDS_PER_MESSAGE).

    The daemon keeps its copies only until a REGISTER names the token (or it expires, docs/protocol.md),
    so a token is good for one REGISTER: call again to register again. This process's descriptors stay
    open (SCM_RIGHTS duplicates them). Raises UntrustedSocket, FdRefused or OSError.
    """
    if not fds or len(fds) != len(sizes):
        raise ValueError(f"{len(fds)} descriptors with {len(sizes)} sizes")
    check_socket_path(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        s.settimeout(timeout_s)
        s.connect(path)
        uid = peer_uid(s)
        if not _trusted_owner(uid):
            raise UntrustedSocket(f"the process serving {path} runs as uid {uid}: not handing it memory")
        s.send(_ENC.encode(FdBatch(v=FD_SOCKET_VERSION, count=len(fds))))
        ready = _reply(s)  # the bounds are checked before a descriptor travels
        if ready.ready != len(fds):
            raise FdRefused("bad_frame", f"the daemon is ready for {ready.ready} descriptors, not {len(fds)}")
        try:
            for i in range(0, len(fds), MAX_FDS_PER_MESSAGE):
                chunk = FdChunk(sizes=list(sizes[i:i + MAX_FDS_PER_MESSAGE]))
                socket.send_fds(s, [_ENC.encode(chunk)], fds[i:i + MAX_FDS_PER_MESSAGE])
        except (BrokenPipeError, ConnectionResetError):
            _reply(s)  # the daemon refused mid-batch and closed: its reason is queued for us
            raise
        done = _reply(s)
    finally:
        s.close()
    if not done.token:
        raise FdRefused("bad_frame", "the daemon's answer carries no token")
    return done.token


def send_fd(path: str, fd: int, size: int, timeout_s: float = 2.0) -> str:
    """Give ``fd`` (a sealed memfd of at least ``size`` bytes) to the daemon: a batch of one."""
    return send_fds(path, [fd], [size], timeout_s)


_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(FdReply)


def _reply(s: socket.socket) -> FdReply:
    """The daemon's next message; a refusal raises FdRefused (the daemon closes the connection then)."""
    raw = s.recv(MAX_FD_MESSAGE)
    if not raw:
        raise FdRefused("bad_frame", "the daemon closed the fd socket without an answer")
    try:
        reply = _DEC.decode(raw)
    except (msgspec.DecodeError, msgspec.ValidationError):
        raise FdRefused("bad_frame", "the daemon's answer is not an fd-socket reply") from None
    if reply.error:
        raise FdRefused(reply.error, reply.message)
    return reply


def wire_memory(path: str, memory: LocalMemory, timeout_s: float) -> P.Memory:
    """REGISTER's ``memory`` as it travels: the Struct with the one-time token of this process's
    descriptors (``cpu_fd``: one; ``cuda_vmm``: one per piece), handed to the fd socket at ``path``
    now, as one batch. A kind with no descriptor (``cuda_ipc``) travels as it is. Raises as
    :func:`send_fds`."""
    if not memory.fds:
        return memory.spec
    return msgspec.structs.replace(memory.spec, token=send_fds(path, memory.fds, memory.sizes, timeout_s))
