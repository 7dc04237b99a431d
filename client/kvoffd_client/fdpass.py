"""Local trust: check that a UNIX socket is the daemon's, and hand it memory as a file descriptor.

Two jobs, both about never giving memory or messages to a process that merely got to a path first:

  * ``check_socket_path`` — the socket's directory must belong to this user (or root) and be writable
    by nobody else, and the socket itself must belong to this user (or root). Only then can no other
    user have put a socket there, or replace it later (docs/security.md, "Who can connect").
  * ``send_fd`` — the CPU connector's KV memory is an anonymous, sealed memfd; it reaches the daemon
    as a file descriptor over the daemon's fd socket (SCM_RIGHTS), never as a path. The daemon answers
    with a one-time token that REGISTER then names (memory kind ``cpu_fd``, docs/protocol.md). The
    daemon can map only memory its client could open, and holds nothing that outlives both.

Standard library and msgspec only: imported in vLLM's processes.
"""

from __future__ import annotations

import os
import socket
import stat
import struct

import msgspec

from kvoffd_client.protocol import MAX_FD_MESSAGE

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


def send_fd(path: str, fd: int, size: int, timeout_s: float = 2.0) -> str:
    """Give ``fd`` (a sealed memfd of at least ``size`` bytes) to the daemon; returns the token.

    The daemon keeps its copy of the descriptor only until a REGISTER names the token (or it
    expires, docs/protocol.md), so a token is good for one REGISTER: call again to register again.
    Raises UntrustedSocket, FdRefused or OSError.
    """
    check_socket_path(path)
    s = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    try:
        s.settimeout(timeout_s)
        s.connect(path)
        uid = peer_uid(s)
        if not _trusted_owner(uid):
            raise UntrustedSocket(f"the process serving {path} runs as uid {uid}: not handing it memory")
        socket.send_fds(s, [msgspec.msgpack.encode({"v": 1, "size": size})], [fd])
        raw = s.recv(MAX_FD_MESSAGE)
    finally:
        s.close()
    try:
        reply = msgspec.msgpack.decode(raw)
    except msgspec.DecodeError:
        raise FdRefused("bad_frame", "the daemon's answer is not msgpack") from None
    if not isinstance(reply, dict):
        raise FdRefused("bad_frame", "the daemon's answer is not a map")
    if reply.get("error"):
        raise FdRefused(str(reply["error"]), str(reply.get("message", "")))
    token = reply.get("token")
    if not isinstance(token, str) or not token:
        raise FdRefused("bad_frame", "the daemon's answer carries no token")
    return token


def wire_memory(path: str, memory: dict, timeout_s: float) -> dict | None:
    """REGISTER's ``memory`` as it travels, for the kinds that hold this process's descriptors
    (``cpu_fd``: one; ``cuda_vmm``: one per piece): each is handed to the fd socket at ``path`` now and
    replaced by its one-time token. None for a kind with no descriptor. Raises as :func:`send_fd`."""
    kind = memory.get("kind")
    if kind == "cpu_fd" and "fd" in memory:
        return {"kind": "cpu_fd", "token": send_fd(path, memory["fd"], memory["size"], timeout_s),
                "size": memory["size"]}
    if kind == "cuda_vmm":
        pieces = [{"token": send_fd(path, p["fd"], p["size"], timeout_s), "offset": p["offset"], "size": p["size"]}
                  for p in memory["pieces"]]
        return {**memory, "pieces": pieces}
    return None
