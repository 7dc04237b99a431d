"""What the daemon and its KV-event outlet say to each other over their socketpair (kvoffd/server/outlet.py).

The outlet is the process that holds the KV-event endpoints: why it is a process of its own is in
kvoffd/server/outlet.py. Between the two there is one AF_UNIX stream socketpair, nothing anyone else
can reach, and it carries frames ``[kind: 1 byte][length: 4 bytes, big-endian][body]``:

* ``BATCH`` (daemon -> outlet): ``[seq: 8 bytes, big-endian][payload]``, one numbered msgpack EventBatch,
  published as it is and kept for replay. No decoding in between: the outlet never looks inside.
* ``CONTROL`` (both ways): one msgpack ``Control`` message: the daemon's ``Setup`` first, then the
  outlet's ``Bound`` (or ``Failed``) and its ``Report`` whenever its counts change (at most every
  ``REPORT_EVERY_S``), which is what the daemon's STATS and metrics show of the stream's endpoints.
"""

from __future__ import annotations

import socket
import struct
from typing import Union

import msgspec

BATCH = 1
CONTROL = 2
HEAD = struct.Struct(">BI")
MAX_FRAME = 1 << 30  # a batch the daemon made is far smaller; a bigger length is a broken stream
REPORT_EVERY_S = 0.2
READ_BYTES = 1 << 18
READS_PER_CALL = 64


class Setup(msgspec.Struct, tag="setup"):
    """The endpoints to bind and how (the daemon's configuration, checked already)."""

    publish: str
    replay: str
    topic: str = ""
    curve_dir: str = ""  # "": no CURVE (an ipc:// stream, or tcp:// with --kv-events-auth none)
    replay_batches: int = 10_000
    pub_hwm: int = 100_000
    log_level: str = "info"


class Bound(msgspec.Struct, tag="bound"):
    publish: str
    replay: str
    curve_public_key: str = ""  # Z85, when the endpoints take only CURVE clients


class Failed(msgspec.Struct, tag="failed"):
    message: str


class Report(msgspec.Struct, tag="report"):
    """The outlet's counts: connections now, by socket, and totals since it started."""

    connections: dict[str, int]
    batches: int = 0  # batches taken from the daemon (each published, then kept for replay)
    limit: int = 0  # its RLIMIT_NOFILE (its own descriptor table: none of the daemon's)
    in_use: int = 0
    paused: bool = False  # refusing new connections: its descriptor budget is tight
    refused: int = 0  # connections closed at once while paused
    pauses: int = 0
    replays: int = 0  # replay requests served (or being served)
    replays_active: int = 0
    replays_waiting: int = 0
    replays_dropped: int = 0  # requests dropped: too many waiting, or the peer left
    replay_bytes_in_flight: int = 0  # replayed bytes libzmq has not written yet (with a per-message cost)
    denied: int = 0  # CURVE handshakes refused (a key not in the allowed directory)


Control = Union[Setup, Bound, Failed, Report]  # noqa: UP007 - msgspec reads the annotation at runtime
_ENC = msgspec.msgpack.Encoder()
_DEC = msgspec.msgpack.Decoder(Control)


class BrokenChannel(Exception):
    """The other end closed, or sent something that is not a frame."""


def control_frame(msg: Setup | Bound | Failed | Report) -> bytes:
    body = _ENC.encode(msg)
    return HEAD.pack(CONTROL, len(body)) + body


def batch_frame(seq: int, payload: bytes) -> bytes:
    return HEAD.pack(BATCH, 8 + len(payload)) + seq.to_bytes(8, "big") + payload


def decode_control(body: bytes) -> Setup | Bound | Failed | Report:
    try:
        return _DEC.decode(body)
    except (msgspec.DecodeError, msgspec.ValidationError) as e:
        raise BrokenChannel(f"not a control message: {e}") from None


class FrameReader:
    """Frames out of a non-blocking stream socket, as they complete."""

    def __init__(self, sock: socket.socket) -> None:
        self._sock = sock
        self._buf = bytearray()

    def read(self) -> list[tuple[int, bytes]]:
        """The frames complete now (maybe none). BrokenChannel at EOF or on a bad header."""
        for _ in range(READS_PER_CALL):  # then the caller's loop runs (the socket stays readable)
            try:
                data = self._sock.recv(READ_BYTES)
            except (BlockingIOError, InterruptedError):
                break
            except OSError as e:
                raise BrokenChannel(str(e)) from None
            if not data:
                raise BrokenChannel("closed")
            self._buf += data
            if len(data) < READ_BYTES:
                break
        out: list[tuple[int, bytes]] = []
        buf = self._buf
        at = 0
        while len(buf) - at >= HEAD.size:
            kind, n = HEAD.unpack_from(buf, at)
            if kind not in (BATCH, CONTROL) or n > MAX_FRAME:
                raise BrokenChannel(f"bad frame header (kind {kind}, {n} bytes)")
            if len(buf) - at - HEAD.size < n:
                break
            out.append((kind, bytes(buf[at + HEAD.size:at + HEAD.size + n])))
            at += HEAD.size + n
        if at:
            del buf[:at]
        return out
