"""kvoffd wire protocol v1: the one definition both the daemon and its clients use.

Transport: the daemon binds a ZeroMQ ROUTER, clients connect DEALERs. Every message is one frame
holding one msgpack map: ``{"op": <Op>, "seq": <int>, ...fields}``. ``seq`` is chosen by the sender
of a request and echoed in the reply, so a client can keep several requests in flight and match the
answers. Completion notices for STORE/LOAD jobs arrive unsolicited (op NOTICE) and carry the job id.

This module imports only the standard library and msgpack: vLLM imports the connector (and so this
file) in its API-server process, where nothing heavy may load. See docs/protocol.md for the prose.
"""

from __future__ import annotations

import dataclasses
import enum
import functools
import operator
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, ClassVar

import msgpack

PROTOCOL_VERSION = 1
#: Every block key is exactly this many bytes (vLLM's sha256 block hashes are; others are folded).
KEY_SIZE = 32
#: Largest frame the daemon reads. A step of a big batch (8k blocks) stays far below it.
MAX_FRAME_BYTES = 8 << 20
#: Most keys (and block ids) one message may carry.
MAX_KEYS = 65536
#: Longest namespace / engine id / free-text field.
MAX_NAME = 256


class Op(str, enum.Enum):
    # client -> daemon
    HELLO = "hello"
    REGISTER = "register"
    UNREGISTER = "unregister"
    LOOKUP = "lookup"
    RELEASE = "release"
    STORE = "store"
    LOAD = "load"
    STATS = "stats"
    CLEAR = "clear"
    PING = "ping"
    EXPLAIN = "explain"
    # daemon -> client
    HELLO_OK = "hello_ok"
    REGISTERED = "registered"
    LOOKUP_RESULT = "lookup_result"
    OK = "ok"
    STATS_RESULT = "stats_result"
    CLEARED = "cleared"
    PONG = "pong"
    EXPLAINED = "explained"
    NOTICE = "notice"
    ERROR = "error"


class ErrorCode(str, enum.Enum):
    """Stable error codes; the daemon's kvoffd_errors_total is labelled by these."""

    BAD_FRAME = "bad_frame"  # not msgpack, not a map, or several frames
    FRAME_TOO_LARGE = "frame_too_large"
    UNKNOWN_OP = "unknown_op"
    BAD_FIELD = "bad_field"  # a field missing, of the wrong type or out of range
    BAD_KEY = "bad_key"  # a key of the wrong size or type
    BAD_BLOCK_ID = "bad_block_id"  # outside the registered tensors
    VERSION_MISMATCH = "version_mismatch"
    HELLO_REQUIRED = "hello_required"
    NOT_REGISTERED = "not_registered"  # the engine id is unknown (daemon restarted, or never registered)
    FOREIGN_ENGINE = "foreign_engine"  # the engine was registered by another connection
    DUPLICATE_JOB = "duplicate_job"
    LAYOUT_MISMATCH = "layout_mismatch"  # same namespace and rank, different bytes per block
    MEMORY_UNREACHABLE = "memory_unreachable"  # the daemon could not map the engine's memory
    UNKNOWN_LEASE = "unknown_lease"
    TOO_MANY = "too_many"  # a per-client bound (jobs in flight, leases, engines) was hit
    EXPIRED = "expired"  # a job reached the daemon after its expires_ns: nothing was done
    INTERNAL = "internal"


class ProtocolError(Exception):
    """A message that must be answered with ERROR; never crashes the daemon."""

    def __init__(self, code: ErrorCode, message: str, seq: int = 0, job_id: int | None = None):
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
        self.seq = seq
        self.job_id = job_id


# --------------------------------------------------------------------------------------------------
# Field checks. A tiny schema language: each message class lists (field, check) pairs. The checks run
# in C where it matters (keys, ids) because a step's batch can hold thousands of entries.


def _int(v: Any, name: str, lo: int = 0, hi: int = (1 << 63) - 1) -> int:
    if type(v) is not int or not lo <= v <= hi:  # bool is not an int here
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{name} must be an integer in [{lo}, {hi}], got {v!r:.40}")
    return v


def _str(v: Any, name: str, *, empty: bool = False) -> str:
    if type(v) is not str or len(v) > MAX_NAME or (not empty and not v):
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{name} must be a non-empty string of at most {MAX_NAME} chars")
    return v


def _keyblob(v: Any, name: str = "keys") -> bytes:
    """Keys travel as one binary, KEY_SIZE bytes each, back to back: checking that is O(1), and
    splitting it (struct, in C) costs a fraction of unpacking thousands of separate msgpack items."""
    if type(v) is not bytes or len(v) % KEY_SIZE:
        raise ProtocolError(ErrorCode.BAD_KEY, f"{name} must be one binary of {KEY_SIZE}-byte keys back to back")
    n = len(v) // KEY_SIZE
    if n > MAX_KEYS:
        raise ProtocolError(ErrorCode.TOO_MANY, f"{name} holds {n} keys; at most {MAX_KEYS}")
    return v


def _keys(v: Any, name: str = "keys") -> list[bytes]:
    return split_keys(_keyblob(v, name))


def _ids(v: Any, name: str = "block_ids") -> array:
    """Block ids travel as one binary of little-endian int32."""
    if type(v) is not bytes or len(v) % 4:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{name} must be one binary of little-endian int32")
    if len(v) // 4 > MAX_KEYS:
        raise ProtocolError(ErrorCode.TOO_MANY, f"{name} holds {len(v) // 4} entries; at most {MAX_KEYS}")
    a = array("i", v)
    if _BIG_ENDIAN:
        a.byteswap()
    return a


def _intlist(v: Any, name: str) -> list[int]:
    if type(v) is not list or len(v) > MAX_KEYS or (v and set(map(type, v)) != {int}):
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{name} must be a list of integers")
    return v


_BIG_ENDIAN = sys.byteorder == "big"
_CHUNK = 1024
_CHUNK_STRUCT = struct.Struct(f"{KEY_SIZE}s" * _CHUNK)


@functools.lru_cache(maxsize=_CHUNK)
def _tail_struct(n: int) -> struct.Struct:
    return struct.Struct(f"{KEY_SIZE}s" * n)


def split_keys(blob: bytes) -> list[bytes]:
    n = len(blob) // KEY_SIZE
    if n <= 1:
        return [blob] if n else []
    out: list[bytes] = []
    full = n - n % _CHUNK
    for off in range(0, full * KEY_SIZE, _CHUNK * KEY_SIZE):
        out += _CHUNK_STRUCT.unpack_from(blob, off)
    if n > full:
        out += _tail_struct(n - full).unpack_from(blob, full * KEY_SIZE)
    return out


def pack_keys(keys: Sequence[bytes] | bytes) -> bytes:
    if type(keys) is bytes:  # already one binary
        if len(keys) % KEY_SIZE:
            raise ValueError(f"every key must be exactly {KEY_SIZE} bytes")
        return keys
    blob = b"".join(keys)
    if len(blob) != KEY_SIZE * len(keys):
        raise ValueError(f"every key must be exactly {KEY_SIZE} bytes")
    return blob


def pack_ids(ids: Sequence[int] | array) -> bytes:
    a = ids if isinstance(ids, array) and ids.typecode == "i" else array("i", ids)
    if _BIG_ENDIAN:
        a = array("i", a)
        a.byteswap()
    return a.tobytes()


def _bool(v: Any, name: str) -> bool:
    if type(v) is not bool:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{name} must be true or false")
    return v


def _map(v: Any, name: str) -> dict:
    if type(v) is not dict:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{name} must be a map")
    return v


def _opt(check):
    def f(v: Any, name: str):
        return None if v is None else check(v, name)

    return f


def _strs(v: Any, name: str) -> list[str]:
    if type(v) is not list or len(v) > 64 or any(type(s) is not str or len(s) > MAX_NAME for s in v):
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{name} must be a short list of strings")
    return v


def _any(v: Any, name: str) -> Any:
    return v


# --------------------------------------------------------------------------------------------------
# Messages. Each is a dataclass; `op` is the class's wire tag. Unknown extra fields are ignored so a
# newer peer can add optional fields within v1.


_WIRE: dict[type, tuple[tuple[str, ...], Any, bool, bool, str]] = {}


def _wire_shape(cls: type) -> tuple[tuple[str, ...], Any, bool, bool, str]:
    """Per class, once: field names and their getter, and the op tag (``Enum.value`` is slow)."""
    names = tuple(f.name for f in dataclasses.fields(cls))
    shape = _WIRE[cls] = (names, operator.attrgetter(*names), "keys" in names, "block_ids" in names,
                          cls.op.value)
    return shape


@dataclass(slots=True)
class Message:
    op: ClassVar[Op]
    checks: ClassVar[dict[str, Any]] = {}
    seq: int = 0

    def to_wire(self) -> dict[str, Any]:
        names, values, keys, ids, op = _WIRE.get(type(self)) or _wire_shape(type(self))
        d = dict(zip(names, values(self), strict=True)) if len(names) > 1 else {"seq": self.seq}
        if keys:
            d["keys"] = pack_keys(d["keys"])
        if ids:
            d["block_ids"] = pack_ids(d["block_ids"])
        d["op"] = op
        return d


@dataclass(slots=True)
class Hello(Message):
    """First message on a connection: version check and who is calling (pid for liveness)."""

    op: ClassVar[Op] = Op.HELLO
    version: int = PROTOCOL_VERSION
    client: str = "kvoffd_client"
    pid: int = 0
    start_ticks: int = 0  # the process's start time (/proc/PID/stat field 22): pid + this = identity
    capabilities: list[str] = field(default_factory=list)


@dataclass(slots=True)
class HelloOk(Message):
    op: ClassVar[Op] = Op.HELLO_OK
    version: int = PROTOCOL_VERSION
    daemon_id: str = ""  # changes when the daemon restarts: clients re-register then
    pid: int = 0
    capabilities: list[str] = field(default_factory=list)
    limits: dict[str, int] = field(default_factory=dict)
    heartbeat_s: float = 2.0


@dataclass(slots=True)
class Segment:
    """One run of bytes per block: block b occupies [offset + b*stride, +length) in the region."""

    offset: int
    stride: int
    length: int


@dataclass(slots=True)
class Register(Message):
    """Attach an engine worker's KV memory.

    ``memory`` says how the daemon reaches the bytes:
      * ``{"kind": "cpu_shm", "path": "/dev/shm/...", "size": n}`` — a file the daemon maps;
      * ``{"kind": "cuda_ipc", "handle": bytes, "size": n, "device_uuid": "GPU-...", "events": [bytes]}``.
    ``layout`` says where each block lives in it: ``{"num_blocks": N, "segments": [[offset, stride,
    length], ...], "desc": "free text (e.g. LBHNC fp32)"}``. A block's slot in the pool is the
    concatenation of its segments, so one slot holds every layer, K and V, of one block of one rank.
    """

    op: ClassVar[Op] = Op.REGISTER
    engine_id: str = ""
    namespace: str = ""
    rank: int = 0
    world_size: int = 1
    memory: dict[str, Any] = field(default_factory=dict)
    layout: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Registered(Message):
    op: ClassVar[Op] = Op.REGISTERED
    engine_id: str = ""
    slot_bytes: int = 0
    backend: str = ""


@dataclass(slots=True)
class Unregister(Message):
    op: ClassVar[Op] = Op.UNREGISTER
    engine_id: str = ""


@dataclass(slots=True)
class Lookup(Message):
    """How many leading ``keys`` are resident for every rank of ``namespace``.

    With ``lease_ms`` > 0 the hits are pinned against eviction for that long, or until a LOAD
    naming the lease consumes them, or a RELEASE drops them.

    ``keys`` may be given as one binary of keys back to back; decoded, it always is that binary: the
    daemon checks it mostly without splitting it (kvoffd/index.py, ``Run``).
    """

    op: ClassVar[Op] = Op.LOOKUP
    namespace: str = ""
    keys: Sequence[bytes] | bytes = field(default_factory=list)
    lease_ms: int = 0


@dataclass(slots=True)
class LookupResult(Message):
    op: ClassVar[Op] = Op.LOOKUP_RESULT
    hits: int = 0
    lease_id: int = 0  # 0: no lease was taken (no hits or none asked)
    world_size: int = 0  # ranks the namespace has (0: namespace unknown to the daemon)


@dataclass(slots=True)
class Release(Message):
    op: ClassVar[Op] = Op.RELEASE
    lease_id: int = 0


@dataclass(slots=True)
class Store(Message):
    """Copy engine blocks ``block_ids[i]`` into the pool under ``keys[i]`` (one step's batch).

    ``event`` (CUDA) is the index of the interprocess event in the ring shared at REGISTER that the
    copy must wait for; -1 means the engine's writes are already complete (CPU: after the step).
    """

    op: ClassVar[Op] = Op.STORE
    engine_id: str = ""
    job_id: int = 0
    keys: list[bytes] = field(default_factory=list)
    block_ids: Sequence[int] = field(default_factory=list)  # on the wire: little-endian int32
    event: int = -1
    expires_ns: int = 0  # CLOCK_MONOTONIC: the daemon refuses to start the copy after this (0: never)


@dataclass(slots=True)
class Load(Message):
    """Copy the pool's blocks for ``keys[i]`` into engine block ``block_ids[i]``.

    ``expires_ns`` protects against a daemon that hangs and then wakes up: a client that has given
    up on a job (and let vLLM reuse the blocks) must not see it run late. The clock is the host's
    CLOCK_MONOTONIC, which every process on the host shares.
    """

    op: ClassVar[Op] = Op.LOAD
    engine_id: str = ""
    job_id: int = 0
    keys: list[bytes] = field(default_factory=list)
    block_ids: Sequence[int] = field(default_factory=list)
    lease_id: int = 0
    event: int = -1
    expires_ns: int = 0


@dataclass(slots=True)
class Notice(Message):
    """A job is over. ``failed`` lists the indices (into the job's keys) that were not done."""

    op: ClassVar[Op] = Op.NOTICE
    job_id: int = 0
    ok: bool = True
    failed: list[int] = field(default_factory=list)
    code: str = ""
    message: str = ""


@dataclass(slots=True)
class Stats(Message):
    op: ClassVar[Op] = Op.STATS
    detail: bool = False


@dataclass(slots=True)
class StatsResult(Message):
    op: ClassVar[Op] = Op.STATS_RESULT
    stats: dict[str, Any] = field(default_factory=dict)


@dataclass(slots=True)
class Clear(Message):
    """Drop cached blocks: one namespace, or all when ``namespace`` is empty."""

    op: ClassVar[Op] = Op.CLEAR
    namespace: str = ""


@dataclass(slots=True)
class Cleared(Message):
    op: ClassVar[Op] = Op.CLEARED
    removed_blocks: int = 0
    in_flight_jobs: int = 0  # jobs still running; their stores will not become visible


@dataclass(slots=True)
class Explain(Message):
    """Why would these keys miss? (operators' tool; not on the serving path)."""

    op: ClassVar[Op] = Op.EXPLAIN
    namespace: str = ""
    keys: list[bytes] = field(default_factory=list)


@dataclass(slots=True)
class Explained(Message):
    op: ClassVar[Op] = Op.EXPLAINED
    entries: list[dict[str, Any]] = field(default_factory=list)


@dataclass(slots=True)
class Ping(Message):
    """Liveness; also a heartbeat that keeps the sender's engines registered."""

    op: ClassVar[Op] = Op.PING


@dataclass(slots=True)
class Pong(Message):
    op: ClassVar[Op] = Op.PONG
    daemon_id: str = ""


@dataclass(slots=True)
class Ok(Message):
    op: ClassVar[Op] = Op.OK


@dataclass(slots=True)
class Error(Message):
    op: ClassVar[Op] = Op.ERROR
    code: str = ErrorCode.INTERNAL.value
    message: str = ""
    job_id: int | None = None


_J = (1 << 63) - 1
Hello.checks = {"version": _int, "client": _str, "pid": _int, "start_ticks": _int, "capabilities": _strs}
Register.checks = {
    "engine_id": _str,
    "namespace": _str,
    "rank": lambda v, n: _int(v, n, 0, 1 << 16),
    "world_size": lambda v, n: _int(v, n, 1, 1 << 16),
    "memory": _map,
    "layout": _map,
}
Unregister.checks = {"engine_id": _str}
Lookup.checks = {"namespace": _str, "keys": _keyblob, "lease_ms": lambda v, n: _int(v, n, 0, 600_000)}
Release.checks = {"lease_id": _int}
Store.checks = {
    "engine_id": _str,
    "job_id": _int,
    "keys": _keys,
    "block_ids": _ids,
    "event": lambda v, n: _int(v, n, -1, 1 << 20),
    "expires_ns": _int,
}
Load.checks = {**Store.checks, "lease_id": _int}
Stats.checks = {"detail": _bool}
Clear.checks = {"namespace": lambda v, n: _str(v, n, empty=True)}
Explain.checks = {"namespace": _str, "keys": _keys}
# Replies are checked loosely (the client trusts the daemon's types but not its presence).
HelloOk.checks = {"version": _int, "daemon_id": _any, "pid": _any, "capabilities": _any, "limits": _any,
                  "heartbeat_s": _any}
Registered.checks = {"engine_id": _any, "slot_bytes": _any, "backend": _any}
LookupResult.checks = {"hits": _int, "lease_id": _int, "world_size": _int}
Notice.checks = {"job_id": _int, "ok": _bool, "failed": _intlist, "code": _any, "message": _any}
StatsResult.checks = {"stats": _map}
Cleared.checks = {"removed_blocks": _int, "in_flight_jobs": _int}
Explained.checks = {"entries": _any}
Pong.checks = {"daemon_id": _any}
Error.checks = {"code": _any, "message": _any, "job_id": _any}

MESSAGES: dict[str, type[Message]] = {
    cls.op.value: cls
    for cls in (Hello, HelloOk, Register, Registered, Unregister, Lookup, LookupResult, Release, Store,
                Load, Notice, Stats, StatsResult, Clear, Cleared, Explain, Explained, Ping, Pong, Ok, Error)
}
REQUESTS = frozenset({Op.HELLO, Op.REGISTER, Op.UNREGISTER, Op.LOOKUP, Op.RELEASE, Op.STORE, Op.LOAD,
                      Op.STATS, Op.CLEAR, Op.PING, Op.EXPLAIN})


def encode(msg: Message) -> bytes:
    return msgpack.packb(msg.to_wire())  # (a shared Packer would be faster, and unsafe across threads)


def decode(frame: bytes, *, requests_only: bool = False) -> Message:
    """Parse and validate one frame. Raises ProtocolError with the right code; never anything else."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(ErrorCode.FRAME_TOO_LARGE, f"frame of {len(frame)} bytes; at most {MAX_FRAME_BYTES}")
    try:
        obj = msgpack.unpackb(frame, raw=False, strict_map_key=True, max_bin_len=MAX_FRAME_BYTES,
                              max_str_len=1 << 20, max_array_len=MAX_KEYS + 1, max_map_len=256)
    except Exception as e:  # msgpack raises several types (ValueError, ExtraData, FormatError, ...)
        raise ProtocolError(ErrorCode.BAD_FRAME, f"not a msgpack message: {type(e).__name__}") from None
    if type(obj) is not dict:
        raise ProtocolError(ErrorCode.BAD_FRAME, "a message must be a msgpack map")
    seq = obj.get("seq", 0)
    if type(seq) is not int or not 0 <= seq < (1 << 63):
        raise ProtocolError(ErrorCode.BAD_FIELD, "seq must be a non-negative integer")
    op = obj.get("op")
    cls = MESSAGES.get(op) if type(op) is str else None
    if cls is None or (requests_only and cls.op not in REQUESTS):
        raise ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op {op!r:.40}", seq=seq)
    kwargs: dict[str, Any] = {"seq": seq}
    job_id = obj.get("job_id") if type(obj.get("job_id")) is int else None
    try:
        for name, check in cls.checks.items():
            if name in obj:
                kwargs[name] = check(obj[name], name)
    except ProtocolError as e:
        e.seq, e.job_id = seq, job_id
        raise
    return cls(**kwargs)


def error_for(exc: ProtocolError) -> Error:
    return Error(seq=exc.seq, code=exc.code.value, message=exc.message, job_id=exc.job_id)


def parse_layout(layout: dict[str, Any]) -> tuple[int, list[Segment]]:
    """Validate a REGISTER layout; returns (num_blocks, segments). Bounds vs the region are the daemon's."""
    num_blocks = _int(layout.get("num_blocks"), "layout.num_blocks", 1, 1 << 40)
    raw = layout.get("segments")
    if type(raw) is not list or not 1 <= len(raw) <= 65536:
        raise ProtocolError(ErrorCode.BAD_FIELD, "layout.segments must be a list of 1..65536 [offset, stride, length]")
    segs = []
    for i, s in enumerate(raw):
        if type(s) is not list or len(s) != 3:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"layout.segments[{i}] must be [offset, stride, length]")
        off = _int(s[0], f"layout.segments[{i}].offset")
        stride = _int(s[1], f"layout.segments[{i}].stride")
        length = _int(s[2], f"layout.segments[{i}].length", 1, 1 << 40)
        if num_blocks > 1 and stride < length:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"layout.segments[{i}]: stride {stride} < length {length} "
                                "would make blocks overlap")
        segs.append(Segment(off, stride, length))
    return num_blocks, segs
