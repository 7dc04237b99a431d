"""Hostile ZeroMQ peers, spoken by hand (ZMTP 3.0 over plain sockets), run as their own process.

Why by hand and not with pyzmq: a peer here costs one descriptor (a pyzmq socket costs two, its
mailbox too), starts in microseconds, and does exactly what a hostile client does: the handshake and
then nothing, or a frame no library would send. Used by tests/test_reliability_hostile_peers.py, often
under ``setpriv --reuid 65534 ...`` (another local user, without the daemon's token).

``python tests/support/zmtp_peers.py MODE ADDRESS ...`` prints JSON lines:

* ``silent ADDRESS N``: keeps N connections open that completed the handshake (the daemon's greeting
  and READY read) and then say nothing; a connection the daemon closes is counted, with how long it
  lived, and opened again at once. Prints ``{"held": N}`` once N are held at the same time, a line for
  each of the first N closes (``{"closed": k, "lived_s": ...}``), a progress line per 1,000 connections
  opened, and a summary line when stdin closes.
* ``hellos ADDRESS N WAIT_S``: N connections, each sends the handshake and, once the daemon's READY is
  read, a HELLO (without a token); all stay open until each is answered (or WAIT_S passed). One summary
  line.
* ``deep ADDRESS FRAMES DEPTH``: one connection sends FRAMES requests whose ``seq`` (odd frames) or
  ``job_id`` (even ones) is an array nested DEPTH deep, and reads each reply: one summary line with
  the reply codes and messages seen.
"""

from __future__ import annotations

import collections
import json
import resource
import selectors
import socket
import struct
import sys
import time
import uuid

GREETING = b"\xff" + b"\x00" * 8 + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\x00") + b"\x00" + b"\x00" * 31


def _frame(flags: int, body: bytes) -> bytes:
    if len(body) < 256:
        return bytes([flags]) + bytes([len(body)]) + body
    return bytes([flags | 0x02]) + len(body).to_bytes(8, "big") + body


def ready(identity: bytes) -> bytes:
    """The READY command of a DEALER with this routing id."""
    props = [(b"Socket-Type", b"DEALER"), (b"Identity", identity)]
    body = b"\x05READY" + b"".join(bytes([len(k)]) + k + len(v).to_bytes(4, "big") + v for k, v in props)
    return _frame(0x04, body)


def message(body: bytes) -> bytes:
    """One single-frame message (a DEALER's request)."""
    return _frame(0x00, body)


def _msgpack_str(s: str) -> bytes:
    b = s.encode()
    assert len(b) < 32
    return bytes([0xA0 | len(b)]) + b


def hello_frame() -> bytes:
    """``{"op": "hello", "seq": 1}``: no token, pid 0 (no pidfd)."""
    return b"\x82" + _msgpack_str("op") + _msgpack_str("hello") + _msgpack_str("seq") + b"\x01"


def deep_frame(field: str, depth: int) -> bytes:
    """A LOOKUP (``seq``) or STORE (``job_id``) whose field is ``[[[...0...]]]``, ``depth`` deep."""
    op = "lookup" if field == "seq" else "store"
    return (b"\x82" + _msgpack_str("op") + _msgpack_str(op) + _msgpack_str(field) + b"\x91" * depth + b"\x00")


def _split(address: str) -> tuple[int, object]:
    if address.startswith("ipc://"):
        return socket.AF_UNIX, address[6:]
    host, port = address[6:].rsplit(":", 1)
    return socket.AF_INET, (host.strip("[]"), int(port))


def _raise_nofile() -> int:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    return hard


class _Reader:
    """Parses what the daemon sends on one connection: its greeting, READY, then messages."""

    def __init__(self) -> None:
        self.buf = b""
        self.greeted = False
        self.ready = False

    def feed(self, data: bytes) -> list[bytes]:
        self.buf += data
        out = []
        if not self.greeted:
            if len(self.buf) < 64:
                return out
            self.buf, self.greeted = self.buf[64:], True
        while len(self.buf) >= 2:
            flags = self.buf[0]
            if flags & 0x02:
                if len(self.buf) < 9:
                    break
                size, head = int.from_bytes(self.buf[1:9], "big"), 9
            else:
                size, head = self.buf[1], 2
            if len(self.buf) < head + size:
                break
            body, self.buf = self.buf[head:head + size], self.buf[head + size:]
            if flags & 0x04:
                self.ready = self.ready or body.startswith(b"\x05READY")
            else:
                out.append(body)
        return out


def _connect(family: int, addr: object, payload: bytes) -> socket.socket | None:
    s = socket.socket(family, socket.SOCK_STREAM)
    if family == socket.AF_UNIX:  # blocking, so that a full backlog is waited for (at most 2 s), not refused
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, struct.pack("ll", 2, 0))
    else:
        s.settimeout(2.0)
    try:
        s.connect(addr)
        s.sendall(payload)
    except OSError:
        s.close()
        return None
    s.setblocking(False)
    return s


def silent(address: str, n: int) -> None:
    _raise_nofile()
    family, addr = _split(address)
    sel = selectors.DefaultSelector()
    opened_at: dict[socket.socket, float] = {}
    readers: dict[socket.socket, _Reader] = {}
    held_ready = 0  # connections whose handshake the daemon completed
    stats = {"opened": 0, "closed_by_daemon": 0, "connect_failed": 0, "max_lifetime_s": 0.0,
             "min_lifetime_s": None, "peak_ready": 0}
    announced = False
    report_at = 1000
    stdin = sys.stdin.fileno()
    sel.register(stdin, selectors.EVENT_READ, None)
    while True:
        while len(opened_at) < n:
            s = _connect(family, addr, GREETING + ready(uuid.uuid4().bytes))
            if s is None:
                stats["connect_failed"] += 1
                break
            stats["opened"] += 1
            opened_at[s] = time.monotonic()
            readers[s] = _Reader()
            sel.register(s, selectors.EVENT_READ, s)
        for key, _ in sel.select(0.05 if len(opened_at) < n else 1.0):
            if key.data is None:
                if not sys.stdin.read(1):
                    for s in opened_at:
                        s.close()
                    print(json.dumps(stats), flush=True)
                    return
                continue
            s = key.data
            try:
                data = s.recv(65536)
            except (BlockingIOError, InterruptedError):
                continue
            except OSError:
                data = b""
            if data:
                r = readers[s]
                was = r.ready
                r.feed(data)
                if r.ready and not was:
                    held_ready += 1
                continue
            lived = time.monotonic() - opened_at.pop(s)
            held_ready -= readers.pop(s).ready
            sel.unregister(s)
            s.close()
            stats["closed_by_daemon"] += 1
            if stats["closed_by_daemon"] <= n:
                print(json.dumps({"closed": stats["closed_by_daemon"], "lived_s": round(lived, 3)}), flush=True)
            stats["max_lifetime_s"] = round(max(stats["max_lifetime_s"], lived), 3)
            low = stats["min_lifetime_s"]
            stats["min_lifetime_s"] = round(lived if low is None else min(low, lived), 3)
        stats["peak_ready"] = max(stats["peak_ready"], held_ready)
        if not announced and held_ready >= n:
            announced = True
            print(json.dumps({"held": held_ready}), flush=True)
        if stats["opened"] >= report_at:
            report_at += 1000
            print(json.dumps({"opened": stats["opened"], "ready": held_ready,
                              "closed_by_daemon": stats["closed_by_daemon"]}), flush=True)


def hellos(address: str, n: int, wait_s: float) -> dict:
    """(libzmq drops a peer whose first message comes in the same packet as its greeting: each HELLO
    goes out once the daemon's READY is read.)"""
    _raise_nofile()
    family, addr = _split(address)
    sel = selectors.DefaultSelector()
    readers: dict[socket.socket, _Reader] = {}
    failed = answered = closed = 0
    hello = message(hello_frame())
    t0 = time.monotonic()

    def take(s: socket.socket) -> bool:
        """What the daemon sent on ``s``; True when ``s`` is done with (answered or closed)."""
        nonlocal answered, closed
        try:
            data = s.recv(65536)
        except (BlockingIOError, InterruptedError):
            return False
        except OSError:
            data = b""
        if not data:
            closed += 1
            return True
        r = readers[s]
        was = r.ready
        got = r.feed(data)
        if r.ready and not was:
            s.sendall(hello)  # a few bytes into an empty buffer: never blocks
        if got:
            answered += 1
            return True
        return False

    for _ in range(n):
        s = _connect(family, addr, GREETING + ready(uuid.uuid4().bytes))
        if s is None:
            failed += 1
            continue
        readers[s] = _Reader()
        sel.register(s, selectors.EVENT_READ, s)
        for key, _ in sel.select(0):
            if take(key.data):
                sel.unregister(key.data)
    sent_s = time.monotonic() - t0
    deadline = t0 + wait_s
    while sel.get_map() and time.monotonic() < deadline:
        for key, _ in sel.select(min(1.0, max(deadline - time.monotonic(), 0.0))):
            if take(key.data):
                sel.unregister(key.data)
    out = {"connected": len(readers), "failed": failed, "answered": answered, "closed_by_daemon": closed,
           "connect_s": round(sent_s, 3), "seconds": round(time.monotonic() - t0, 3)}
    for s in readers:
        s.close()
    return out


def deep(address: str, frames: int, depth: int) -> dict:
    """``frames`` frames nested ``depth`` deep, each answered before the next. The daemon drops a
    connection that has not said HELLO with the token 3 s after its accept (kvoffd/server/tcpgate.py),
    which a loaded machine reaches before 200 such frames: then the peer connects again and sends the
    unanswered frame once more, as an attacker would (counted in ``reconnects``)."""
    family, addr = _split(address)

    def connect() -> socket.socket:
        s = socket.socket(family, socket.SOCK_STREAM)
        s.settimeout(30.0)
        s.connect(addr)
        s.sendall(GREETING + ready(uuid.uuid4().bytes))
        return s

    s, r = connect(), _Reader()
    codes: collections.Counter[str] = collections.Counter()
    messages: set[str] = set()
    reconnects = 0
    t0 = time.monotonic()
    i = 0
    while i < frames:
        got: list[bytes] = []
        try:
            s.sendall(message(deep_frame("seq" if i % 2 == 0 else "job_id", depth)))
            while not got:
                data = s.recv(65536)
                if not data:
                    raise ConnectionResetError("closed by the daemon")
                got = r.feed(data)
        except (ConnectionResetError, BrokenPipeError):
            s.close()
            reconnects += 1
            if reconnects > frames:
                raise SystemExit(f"the daemon closed {reconnects} connections, after {i} frames") from None
            s, r = connect(), _Reader()
            continue
        for body in got:
            reply = _decode_error(body)
            codes[reply.get("code", reply.get("op", "?"))] += 1
            messages.add(reply.get("message", ""))
        i += 1
    s.close()
    return {"frames": frames, "codes": dict(codes), "messages": sorted(messages), "reconnects": reconnects,
            "seconds": round(time.monotonic() - t0, 3)}


def _decode_error(body: bytes) -> dict:
    import msgpack  # the test's own dependency; only the reply is read with it

    return msgpack.unpackb(body, raw=False)


def main(argv: list[str]) -> None:
    mode, address = argv[0], argv[1]
    if mode == "silent":
        silent(address, int(argv[2]))
    elif mode == "hellos":
        print(json.dumps(hellos(address, int(argv[2]), float(argv[3]))), flush=True)
    elif mode == "deep":
        print(json.dumps(deep(address, int(argv[2]), int(argv[3]))), flush=True)
    else:
        raise SystemExit(f"unknown mode {mode}")


if __name__ == "__main__":
    main(sys.argv[1:])
