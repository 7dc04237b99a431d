"""One RESP2 connection on a plain (or TLS) socket, used by one thread at a time.

Rules:
* Every blocking call takes an absolute ``deadline`` (``time.monotonic()``); the socket's timeout is
  set to what is left before each system call, so no call outlives its deadline by more than one
  system call's wake-up. A connection whose reply was cut (timeout, reset, a short read) is closed:
  its stream position is unknown.
* A large value is sent with ``sendmsg([header, slot, CRLF])`` and received with ``recv_into`` the
  destination slot: the kernel's copy is the only one. Only the bytes that arrived with a reply's
  header in the 16 KiB line buffer are copied in Python (one C-level slice assignment).
* On a plain socket a transfer of ``KERNEL_WAIT`` bytes or more waits in the kernel: the socket is
  put in blocking mode with ``SO_RCVTIMEO`` / ``SO_SNDTIMEO`` set to what is left, and one
  ``recv_into(..., MSG_WAITALL)`` / ``sendmsg`` moves the whole value. Python's own timeouts poll
  before every system call, and every call hands the GIL to the other lanes and the checksum
  threads and back: a plain reader of a 3-shard cluster measured 0.87 of its speed with Python's
  timeouts (docs/benchmarks.md, *Cluster tier*). Small replies keep the line buffer and Python's
  timeouts. A time left that rounds to zero microseconds is one (a zero ``timeval`` means none).
* TLS: the cluster's one :class:`~kvoffd.cache.tiers.remote.tls.Tls` wraps the socket at every
  (re)connect; a failed handshake is :class:`Broken` with the reason and what to do about it (a CA,
  a host name, a client certificate), so that it is logged once per shard like any failed connect.
* Error replies are values (:class:`RespError`), not raised, so that a pipeline reads every reply;
  ``kind`` is the first word (MOVED, ASK, OOM, NOAUTH, WRONGPASS, CLUSTERDOWN, TRYAGAIN, ERR...).
"""

from __future__ import annotations

import socket
import ssl
import struct
import time

from kvoffd.cache.tiers.remote.tls import Tls

CRLF = b"\r\n"
_BUF = 16 << 10
_DISCARD = 1 << 20
KERNEL_WAIT = 64 << 10  # bytes from which a plain socket's transfer waits in the kernel (above)
_TIMEVAL = struct.Struct("@ll")  # struct timeval: seconds, microseconds


class RespError(Exception):
    """An error reply."""

    def __init__(self, text: str):
        super().__init__(text)
        self.text = text
        self.kind = text.split(" ", 1)[0]


class Broken(OSError):
    """The connection failed or timed out; it is closed."""


def pack(*args: bytes | str | int) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n" % len(b))
        out.append(b)
        out.append(CRLF)
    return b"".join(out)


class Connection:
    def __init__(self, host: str, port: int, tls: Tls | None = None,
                 user: str | None = None, password: str | None = None):
        self.host, self.port = host, port
        self._tls = tls
        self._user, self._password = user, password
        self._sock: socket.socket | None = None
        self._rb = bytearray(_BUF)
        self._rv = memoryview(self._rb)
        self._r0 = self._r1 = 0
        self._fresh = False  # connected over TLS and nothing received yet (a refusal shows up there)

    @property
    def connected(self) -> bool:
        return self._sock is not None

    def connect(self, deadline: float) -> None:
        """Connect and authenticate. Raises :class:`Broken` (network) or :class:`RespError` (AUTH)."""
        self.close()
        left = deadline - time.monotonic()
        if left <= 0:
            raise Broken("deadline passed before connecting")
        try:
            s = socket.create_connection((self.host, self.port), timeout=left)
            s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except OSError as e:
            raise Broken(f"connect {self.host}:{self.port}: {e}") from e
        if self._tls is not None:
            try:
                s = self._tls.wrap(s, self.host)  # the handshake, within the connect's timeout
            except (OSError, ssl.SSLError, ValueError) as e:
                s.close()
                raise Broken(f"TLS handshake with {self.host}:{self.port} failed: {self._tls.explain(e, self.host)}") from e
        self._sock = s
        self._r0 = self._r1 = 0
        self._fresh = self._tls is not None
        if self._password is not None:
            args = ("AUTH", self._user, self._password) if self._user else ("AUTH", self._password)
            self.send(pack(*args), deadline)
            r = self.reply(deadline)
            if isinstance(r, RespError):
                self.close()
                raise r

    def close(self) -> None:
        s, self._sock = self._sock, None
        if s is not None:
            try:
                s.close()
            except OSError:
                pass
        self._r0 = self._r1 = 0

    def abort(self) -> None:
        """From another thread: make a call blocked in this connection return now (it then fails). The
        TCP socket is shut down under a TLS one (``SSLSocket.shutdown`` would drop its TLS state while
        the owning thread may be inside a read)."""
        s = self._sock
        if s is not None:
            try:
                socket.socket.shutdown(s, socket.SHUT_RDWR)
            except OSError:
                pass

    def _broken(self, what: str, e: BaseException) -> Broken:
        """The connection is closed; before a TLS connection's first reply, the error says what a
        refusal by the shard means (``Tls.explain_refusal``)."""
        self.close()
        text = self._tls.explain_refusal(e) if self._fresh and self._tls is not None else str(e)
        self._fresh = False
        return Broken(f"{what}: {text}")

    def _left(self, deadline: float) -> tuple[socket.socket, float]:
        """The socket and the seconds left before ``deadline``; closed and Broken when none are."""
        s = self._sock
        if s is None:
            raise Broken("not connected")
        left = deadline - time.monotonic()
        if left <= 0:
            self.close()
            raise Broken("timed out")
        return s, left

    def _timeout(self, deadline: float) -> socket.socket:
        s, left = self._left(deadline)
        s.settimeout(left)
        return s

    def _kernel_wait(self, deadline: float, option: int) -> socket.socket:
        """The plain socket in blocking mode, its ``option`` (``SO_RCVTIMEO`` or ``SO_SNDTIMEO``) set to
        what is left before ``deadline``: the next call returns by then, with what it moved."""
        s, left = self._left(deadline)
        if s.gettimeout() is not None:
            s.settimeout(None)
        sec = int(left)
        s.setsockopt(socket.SOL_SOCKET, option, _TIMEVAL.pack(sec, max(1, int((left - sec) * 1e6))))
        return s

    def send(self, data: bytes, deadline: float) -> None:
        try:
            self._timeout(deadline).sendall(data)
        except Broken:
            raise
        except (OSError, ssl.SSLError) as e:
            raise self._broken("send", e) from e

    def send_parts(self, parts: list, deadline: float) -> None:
        """Send the buffers in order (a header, a pool slot's memoryview, CRLF) without joining them."""
        try:
            if self._tls is not None:  # SSLSocket has no sendmsg
                for p in parts:
                    self._timeout(deadline).sendall(p)
                return
            views = [memoryview(p).cast("B") for p in parts]
            left = sum(len(v) for v in views)
            while views:
                if left >= KERNEL_WAIT:
                    s = self._kernel_wait(deadline, socket.SO_SNDTIMEO)
                else:
                    s = self._timeout(deadline)
                n = s.sendmsg(views)
                left -= n
                while views and n >= len(views[0]):
                    n -= len(views[0])
                    views.pop(0)
                if views and n:
                    views[0] = views[0][n:]
        except Broken:
            raise
        except BlockingIOError as e:  # SO_SNDTIMEO ran out with nothing sent
            raise self._broken("send timed out", e) from e
        except (OSError, ssl.SSLError) as e:
            raise self._broken("send", e) from e

    def _fill(self, deadline: float) -> None:
        if self._r0 == self._r1:
            self._r0 = self._r1 = 0
        elif self._r1 == len(self._rb):
            k = self._r1 - self._r0
            self._rb[:k] = self._rb[self._r0:self._r1]
            self._r0, self._r1 = 0, k
        try:
            n = self._timeout(deadline).recv_into(self._rv[self._r1:])
        except Broken:
            raise
        except (OSError, ssl.SSLError) as e:
            raise self._broken("recv", e) from e
        if not n:
            raise self._broken("recv", ConnectionError("connection closed by the server"))
        self._r1 += n
        self._fresh = False

    def _line(self, deadline: float) -> bytes:
        while True:
            i = self._rb.find(CRLF, self._r0, self._r1)
            if i >= 0:
                line = bytes(self._rb[self._r0:i])
                self._r0 = i + 2
                return line
            if self._r1 - self._r0 >= len(self._rb):
                self.close()
                raise Broken("reply line longer than the buffer")
            self._fill(deadline)

    def read_into(self, dest: memoryview, deadline: float) -> None:
        """Exactly ``len(dest)`` bytes of the stream into ``dest``."""
        n = len(dest)
        got = min(n, self._r1 - self._r0)
        if got:
            dest[:got] = self._rv[self._r0:self._r0 + got]
            self._r0 += got
        kernel = self._tls is None
        while got < n:
            try:
                if kernel and n - got >= KERNEL_WAIT:
                    k = self._kernel_wait(deadline, socket.SO_RCVTIMEO).recv_into(dest[got:], n - got,
                                                                                 socket.MSG_WAITALL)
                else:
                    k = self._timeout(deadline).recv_into(dest[got:], n - got)
            except Broken:
                raise
            except BlockingIOError as e:  # SO_RCVTIMEO ran out with nothing received
                raise self._broken("recv timed out", e) from e
            except (OSError, ssl.SSLError) as e:
                raise self._broken("recv", e) from e
            if not k:
                raise self._broken("recv", ConnectionError("connection closed by the server"))
            got += k

    def skip(self, n: int, deadline: float) -> None:
        """Drop ``n`` bytes of the stream (a value of the wrong size)."""
        scratch = memoryview(bytearray(min(n, _DISCARD)))
        while n:
            k = min(n, len(scratch))
            self.read_into(scratch[:k], deadline)
            n -= k

    def _crlf(self, deadline: float) -> None:
        end = bytearray(2)
        self.read_into(memoryview(end), deadline)
        if end != CRLF:
            self.close()
            raise Broken("protocol error: a bulk reply without its CRLF")

    def reply(self, deadline: float):
        """One reply, decoded: bytes (simple and bulk strings), int, list, None, or a RespError."""
        line = self._line(deadline)
        t, rest = line[:1], line[1:]
        if t == b"+":
            return rest
        if t == b"-":
            return RespError(rest.decode(errors="replace"))
        if t == b":":
            return int(rest)
        if t == b"$":
            n = int(rest)
            if n < 0:
                return None
            buf = bytearray(n)
            self.read_into(memoryview(buf), deadline)
            self._crlf(deadline)
            return bytes(buf)
        if t == b"*":
            n = int(rest)
            return None if n < 0 else [self.reply(deadline) for _ in range(n)]
        self.close()
        raise Broken(f"protocol error: unexpected reply {line[:40]!r}")

    def bulk_into(self, head: memoryview, dest: memoryview, deadline: float):
        """Read one GET reply whose value should be ``len(head) + len(dest)`` bytes: the head into
        ``head``, the rest into ``dest``. Returns the value's length when it had that size (the bytes
        are in place), -1 for nil, the length (bytes dropped) for another size, or a RespError."""
        line = self._line(deadline)
        t = line[:1]
        if t == b"-":
            return RespError(line[1:].decode(errors="replace"))
        if t != b"$":
            self.close()
            raise Broken(f"protocol error: a GET answered {line[:40]!r}")
        n = int(line[1:])
        if n < 0:
            return -1
        if n != len(head) + len(dest):
            self.skip(n, deadline)
            self._crlf(deadline)
            return n
        self.read_into(head, deadline)
        self.read_into(dest, deadline)
        self._crlf(deadline)
        return n

    def call(self, deadline: float, *args):
        self.send(pack(*args), deadline)
        return self.reply(deadline)
