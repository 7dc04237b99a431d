"""kvoffd wire protocol v1: the one definition both the daemon and its clients use.

Transport: the daemon binds a ZeroMQ ROUTER, clients connect DEALERs. Every message is one frame
holding one msgpack map: ``{"op": <Op>, "seq": <int>, ...fields}``. ``seq`` is chosen by the sender
of a request and echoed in the reply, so a client can keep several requests in flight and match the
answers. Completion notices for STORE/LOAD jobs arrive unsolicited (op NOTICE) and carry the job id.

This module imports only the standard library and msgspec (which vLLM itself depends on): vLLM
imports the connector (and so this file) in its API-server process, where nothing heavy may load.
See docs/protocol.md for the prose.
"""

from __future__ import annotations

import enum
import functools
import re
import struct
import sys
from array import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Union

import msgspec
from msgspec import Meta

PROTOCOL_VERSION = 1
#: Every block key is exactly this many bytes (vLLM's sha256 block hashes are; others are folded).
KEY_SIZE = 32
#: Largest frame the daemon reads. A step of a big batch (8k blocks) stays far below it.
MAX_FRAME_BYTES = 8 << 20
#: The most bytes of one fd-socket request or reply (a small msgpack map; docs/protocol.md, the fd socket).
MAX_FD_MESSAGE = 512
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
    UNAUTHORIZED = "unauthorized"  # HELLO over tcp:// without the daemon's auth token
    NOT_REGISTERED = "not_registered"  # the engine id is unknown (daemon restarted, or never registered)
    FOREIGN_ENGINE = "foreign_engine"  # the engine was registered by another connection
    DUPLICATE_JOB = "duplicate_job"
    LAYOUT_MISMATCH = "layout_mismatch"  # same namespace and rank, different bytes per block
    MEMORY_UNREACHABLE = "memory_unreachable"  # the daemon could not map the engine's memory
    UNKNOWN_LEASE = "unknown_lease"
    TOO_MANY = "too_many"  # a per-client bound (jobs in flight, leases, engines) was hit
    EXPIRED = "expired"  # a job reached the daemon after its expires_ns: nothing was done
    INTERNAL = "internal"


class NoticeCode(str, enum.Enum):
    """Why a NOTICE lists failed keys (its ``code``; empty when none failed). The daemon sends the
    first six; the client library makes up the last two for jobs of a daemon that is provably gone."""

    POOL_FULL = "pool_full"  # a STORE's key found no slot (every candidate held)
    NOT_ADMITTED = "not_admitted"  # the admission policy refused a STORE's new key: not copied
    NOT_RESIDENT = "not_resident"  # a LOAD's key is not in the pool
    COPY_FAILED = "copy_failed"  # the copy failed as a whole
    CHECKSUM_MISMATCH = "checksum_mismatch"  # --verify: a block's crc32 changed in the pool
    EXPIRED = "expired"  # the deadline passed before (the rest of) the copy could start
    DAEMON_LOST = "daemon_lost"  # the daemon that took the job is gone (client library)
    DAEMON_RESTARTED = "daemon_restarted"  # ...and another one answers now (client library)


class MissReason(str, enum.Enum):
    """Why a LOOKUP's first missing key missed (kvoffd_misses_total{reason}, ``kvoffctl explain``)."""

    ABSENT = "absent"  # never stored, or stored and cleared
    EVICTED = "evicted"  # evicted to make room
    NAMESPACE_MISMATCH = "namespace_mismatch"  # no engine of some rank registered in the namespace
    FAILED = "failed"  # its store failed, or it was found corrupt


class DropReason(str, enum.Enum):
    """Why a STORE could not keep a block (kvoffd_dropped_stores_total{reason})."""

    POOL_FULL = "pool_full"  # no slot could be freed
    CLEAR = "clear"  # a CLEAR ran while it was being copied
    FAILED = "failed"  # the copy failed


class ProtocolError(Exception):
    """A message that must be answered with ERROR; never crashes the daemon."""

    def __init__(self, code: ErrorCode, message: str, seq: int = 0, job_id: int | None = None):
        super().__init__(f"{code.value}: {message}")
        self.code = code
        self.message = message
        self.seq = seq
        self.job_id = job_id


# --------------------------------------------------------------------------------------------------
# Field types. Every message is a msgspec Struct: one C call decodes a frame, checks every field's type
# and bounds, and builds the message; what Meta cannot say (a binary of whole keys) is checked in
# __post_init__. Hand-written checks in Python cost 7x more per message (2.9 against 0.4 us to decode
# a LOOKUP), on both sides of every round trip (docs/benchmarks.md, control plane).

U63 = Annotated[int, Meta(ge=0, le=(1 << 63) - 1)]
Name = Annotated[str, Meta(min_length=1, max_length=MAX_NAME)]
Rank = Annotated[int, Meta(ge=0, le=1 << 16)]
WorldSize = Annotated[int, Meta(ge=1, le=1 << 16)]
LeaseMs = Annotated[int, Meta(ge=0, le=600_000)]
EventIndex = Annotated[int, Meta(ge=-1, le=1 << 20)]  # -1: no event to wait for

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


def pack_keys(keys: Sequence[bytes] | bytes | bytearray | memoryview) -> bytes:
    """One binary of the keys back to back (given one already, checked and returned as bytes)."""
    if isinstance(keys, (bytes, bytearray, memoryview)):
        blob = bytes(keys)
        if len(blob) % KEY_SIZE:
            raise ValueError(f"every key must be exactly {KEY_SIZE} bytes")
        return blob
    blob = b"".join(keys)
    if len(blob) != KEY_SIZE * len(keys) or set(map(len, keys)) - {KEY_SIZE}:
        raise ValueError(f"every key must be exactly {KEY_SIZE} bytes")
    return blob


def pack_ids(ids: Sequence[int] | array) -> bytes:
    a = ids if isinstance(ids, array) and ids.typecode == "i" else array("i", ids)
    if _BIG_ENDIAN:
        a = array("i", a)
        a.byteswap()
    return a.tobytes()


def _keyblob(v: Sequence[bytes] | bytes, name: str = "keys") -> bytes:
    """Keys travel as one binary, KEY_SIZE bytes each, back to back: checking that is O(1), and
    splitting it (struct, in C) costs a fraction of unpacking thousands of separate msgpack items.
    A sequence of keys or a bytes-like blob (a sender's convenience) is packed here."""
    if type(v) is not bytes:
        try:
            v = pack_keys(v)
        except (TypeError, ValueError):
            raise ProtocolError(ErrorCode.BAD_KEY, f"{name}: every key must be exactly {KEY_SIZE} bytes") from None
    elif len(v) % KEY_SIZE:
        raise ProtocolError(ErrorCode.BAD_KEY, f"{name} must be one binary of {KEY_SIZE}-byte keys back to back")
    if len(v) > MAX_KEYS * KEY_SIZE:
        raise ProtocolError(ErrorCode.TOO_MANY, f"{name} holds {len(v) // KEY_SIZE} keys; at most {MAX_KEYS}")
    return v


def _idblob(v: Sequence[int] | bytes, name: str = "block_ids") -> bytes:
    """Block ids travel as one binary of little-endian int32 (a sequence of ints is packed here)."""
    if type(v) is not bytes:
        try:
            v = pack_ids(v)
        except (TypeError, OverflowError):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"{name} must be 32-bit integers") from None
    elif len(v) % 4:
        raise ProtocolError(ErrorCode.BAD_FIELD, f"{name} must be one binary of little-endian int32")
    if len(v) > MAX_KEYS * 4:
        raise ProtocolError(ErrorCode.TOO_MANY, f"{name} holds {len(v) // 4} entries; at most {MAX_KEYS}")
    return v


def count_keys(keys: bytes) -> int:
    return len(keys) // KEY_SIZE


# --------------------------------------------------------------------------------------------------
# Messages. ``op`` is the wire tag of each class. Unknown extra fields are ignored, so a newer peer can
# add optional fields within v1. Keys and block ids are held packed, as they travel (see _keyblob).


class Message(msgspec.Struct, tag_field="op", kw_only=True):
    op: ClassVar[Op]
    seq: U63 = 0

    def to_wire(self) -> dict[str, Any]:
        """The message as the plain map that travels (tests and tools print or forward it)."""
        return {"op": self.op.value, **msgspec.structs.asdict(self)}


def start_ticks(pid: int | None = None) -> int:
    """When process ``pid`` (None: this one) started, in clock ticks since boot: field 22 of
    /proc/PID/stat, read past the command name (which may hold spaces and parentheses). With the pid,
    HELLO's identity of a process (``Hello.start_ticks``): a reused pid has another. 0 if unknown."""
    try:
        with open(f"/proc/{'self' if pid is None else pid}/stat", "rb") as f:
            data = f.read()
        field = data[data.rindex(b")") + 2:].split()[19]
    except (OSError, ValueError, IndexError):
        return 0
    return int(field) if field.isdigit() else 0


class Hello(Message, tag="hello"):
    """First message on a connection: version check and who is calling (pid for liveness)."""

    version: U63 = PROTOCOL_VERSION
    client: Name = "kvoffd_client"
    pid: U63 = 0
    start_ticks: U63 = 0  # the process's start time (see start_ticks()): pid + this = identity
    capabilities: Annotated[list[Annotated[str, Meta(max_length=MAX_NAME)]], Meta(max_length=64)] = []
    token: Annotated[str, Meta(max_length=MAX_NAME)] = ""  # tcp:// only: the daemon's auth token


class HelloOk(Message, tag="hello_ok"):
    version: int = PROTOCOL_VERSION
    daemon_id: str = ""  # changes when the daemon restarts: clients re-register then
    pid: int = 0
    capabilities: list[str] = []
    limits: dict[str, int] = {}
    heartbeat_s: float = 2.0
    fd_socket: str = ""  # the UNIX socket that takes ``cpu_fd`` memory (empty: none)


@dataclass(slots=True)
class Segment:
    """One run of bytes per block: block b occupies [offset + b*stride, +length) in the region."""

    offset: int
    stride: int
    length: int


IpcHandle = Annotated[bytes, Meta(min_length=64, max_length=64)]  # cudaIpcMemHandle_t / cudaIpcEventHandle_t
#: IPC events one CUDA engine may share (its ring of "writes done" markers)
MAX_EVENTS = 4096
#: Memory kinds REGISTER may name (the daemon says which it serves in HELLO_OK: ``memory:<kind>``).
MEMORY_KINDS = ("cpu_fd", "cuda_ipc", "cuda_vmm")
#: Physical allocations one ``cuda_vmm`` REGISTER may name (each is one descriptor handed to the fd socket,
#: which keeps at most 8 per process waiting: docs/cuda.md, "VMM memory", limits).
MAX_VMM_PIECES = 8


class CpuFd(msgspec.Struct, tag_field="kind", tag="cpu_fd", kw_only=True):
    """A sealed memfd the engine handed to the daemon's fd socket (HelloOk.fd_socket), named by the
    one-time token it answered (kvoffd_client.fdpass)."""

    KIND: ClassVar[str] = "cpu_fd"
    token: Annotated[str, Meta(min_length=1, max_length=64)]
    size: Annotated[int, Meta(ge=1, le=(1 << 63) - 1)]


class CudaIpc(msgspec.Struct, tag_field="kind", tag="cuda_ipc", kw_only=True):
    """A CUDA IPC handle of the allocation holding the KV tensors, the region's ``offset`` into it and
    ``size``, the GPU by UUID, and the engine's ring of IPC events (docs/cuda.md)."""

    KIND: ClassVar[str] = "cuda_ipc"
    handle: IpcHandle
    size: Annotated[int, Meta(ge=1, le=(1 << 63) - 1)]
    offset: U63 = 0
    device_uuid: Annotated[str, Meta(min_length=1, max_length=MAX_NAME)]
    events: Annotated[list[IpcHandle], Meta(max_length=MAX_EVENTS)] = []


class VmmPiece(msgspec.Struct, kw_only=True):
    """One physical allocation (``cuMemCreate``) behind a VMM-mapped KV range: the fd-socket token of its
    exported POSIX descriptor, where it starts in the range and how long it is."""

    token: Annotated[str, Meta(min_length=1, max_length=64)]
    offset: U63
    size: Annotated[int, Meta(ge=1, le=(1 << 63) - 1)]


class CudaVmm(msgspec.Struct, tag_field="kind", tag="cuda_vmm", kw_only=True):
    """KV memory made with CUDA's virtual memory API (no legacy IPC handle): the physical pieces that
    back one contiguous range, in order and without gaps, from offset 0 (the daemon maps them the same
    way in one VA reservation); the KV region is ``[offset, +size)`` of that range (docs/cuda.md)."""

    KIND: ClassVar[str] = "cuda_vmm"
    pieces: Annotated[list[VmmPiece], Meta(min_length=1, max_length=MAX_VMM_PIECES)]
    size: Annotated[int, Meta(ge=1, le=(1 << 63) - 1)]
    offset: U63 = 0
    device_uuid: Annotated[str, Meta(min_length=1, max_length=MAX_NAME)]
    events: Annotated[list[IpcHandle], Meta(max_length=MAX_EVENTS)] = []

    def __post_init__(self) -> None:
        end = 0
        for i, p in enumerate(self.pieces):
            if p.offset != end:
                raise ProtocolError(ErrorCode.BAD_FIELD, f"memory.pieces[{i}] starts at {p.offset}, not at "
                                    f"{end}: the pieces must tile the range in order, without gaps")
            end += p.size
        if self.offset + self.size > end:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"region [{self.offset}, +{self.size}) exceeds the "
                                f"{end} bytes of its pieces")
        if len({p.token for p in self.pieces}) != len(self.pieces):
            raise ProtocolError(ErrorCode.BAD_FIELD, "memory.pieces name one token twice")


Memory = Union[CpuFd, CudaIpc, CudaVmm]  # noqa: UP007 - msgspec's tagged union (the tag is ``kind``)
SegmentLength = Annotated[int, Meta(ge=1, le=1 << 40)]


#: Most tokens one block may hold (``KvEventsLayout.block_size``).
MAX_BLOCK_TOKENS = 1 << 20


class KvEventsLayout(msgspec.Struct, kw_only=True):
    """``layout.kv_events``: this engine's keys *are* its block hashes, so a daemon that publishes KV
    events (``kv_events`` in HELLO_OK) may show them to routers. ``hash``: how the engine's vLLM shows
    a hash in its events (``int64``: the low 64 bits, vLLM's default; ``bytes``: the hash itself);
    ``block_size``: tokens per block (the size of a described STORE's ``tokens``)."""

    hash: Literal["int64", "bytes"]
    block_size: Annotated[int, Meta(ge=1, le=MAX_BLOCK_TOKENS)]


class Layout(msgspec.Struct, kw_only=True):
    """Where each block lives in the engine's memory: block b occupies [offset + b*stride, +length)
    of every segment. Bounds against the region are the backend's (they need the mapping).
    ``kv_events`` (optional): see :class:`KvEventsLayout`; absent, nothing is published of the
    engine's namespace."""

    num_blocks: Annotated[int, Meta(ge=1, le=1 << 40)]
    segments: Annotated[list[tuple[U63, U63, SegmentLength]], Meta(min_length=1, max_length=65536)]
    desc: str = ""  # free text (e.g. "LBHNC fp32"), logged
    kv_events: KvEventsLayout | None = None

    def __post_init__(self) -> None:
        if self.num_blocks > 1:
            for i, (_, stride, length) in enumerate(self.segments):
                if stride < length:
                    raise ProtocolError(ErrorCode.BAD_FIELD, f"layout.segments[{i}]: stride {stride} < length "
                                        f"{length} would make blocks overlap")

    def runs(self) -> list[Segment]:
        return [Segment(off, stride, length) for off, stride, length in self.segments]


class Register(Message, tag="register", kw_only=True):
    """Attach an engine worker's KV memory.

    ``memory`` says how the daemon reaches the bytes (:class:`CpuFd`, :class:`CudaIpc` or
    :class:`CudaVmm`, told apart by ``kind``); ``layout`` says where each block lives in it (:class:`Layout`). A block's
    slot in the pool is the concatenation of its segments, so one slot holds every layer, K and V,
    of one block of one rank. Senders may give plain maps of the same shape.

    ``replicas`` > 1 says that runs of that many consecutive ranks hold identical KV (an MLA model's
    latents on every TP rank): the daemon keeps one copy per run, stored by its first rank and loaded
    by all of them. Every engine of a namespace must give the same value (``layout_mismatch``).
    """

    engine_id: Name = ""
    namespace: Name = ""
    rank: Rank = 0
    world_size: WorldSize = 1
    memory: Memory
    layout: Layout
    replicas: WorldSize = 1


class Registered(Message, tag="registered"):
    engine_id: str = ""
    slot_bytes: int = 0
    backend: str = ""


class Unregister(Message, tag="unregister"):
    engine_id: Name = ""


class Lookup(Message, tag="lookup"):
    """How many leading ``keys`` are resident for every rank of ``namespace``.

    With ``lease_ms`` > 0 the hits are pinned against eviction for that long, or until a LOAD
    naming the lease consumes them, or a RELEASE drops them. The daemon checks ``keys`` mostly
    without splitting them (kvoffd/cache/index.py, ``Run``).
    """

    namespace: Name = ""
    keys: bytes = b""
    lease_ms: LeaseMs = 0

    def __post_init__(self) -> None:
        self.keys = _keyblob(self.keys)


class LookupResult(Message, tag="lookup_result"):
    hits: int = 0
    lease_id: int = 0  # 0: no lease was taken (no hits or none asked)
    world_size: int = 0  # ranks the namespace has (0: namespace unknown to the daemon)


class Release(Message, tag="release"):
    lease_id: U63 = 0


class _Job(Message):
    """What STORE and LOAD share: one step's batch, ``keys[i]`` with engine block ``block_ids[i]``.

    ``event`` (CUDA) is the index of the interprocess event in the ring shared at REGISTER that the
    copy must wait for; -1 means the engine's writes are already complete (CPU: after the step).

    ``expires_ns`` (CLOCK_MONOTONIC; 0: never): the daemon refuses to start the copy after it. This
    protects against a daemon that hangs and then wakes up: a client that has given up on a job (and
    let vLLM reuse the blocks) must not see it run late. Every process on the host shares the clock.
    """

    engine_id: Name = ""
    job_id: U63 = 0
    keys: bytes = b""
    block_ids: bytes = b""  # little-endian int32
    event: EventIndex = -1
    expires_ns: U63 = 0

    def __post_init__(self) -> None:
        self.keys = _keyblob(self.keys)
        self.block_ids = _idblob(self.block_ids)


class Store(_Job, tag="store"):
    """Copy engine blocks ``block_ids[i]`` into the pool under ``keys[i]``.

    ``tokens`` and ``parents`` (optional, only to a daemon whose HELLO_OK lists the ``kv_events``
    capability) describe the blocks for KV events: each block's token ids (little-endian uint32,
    the namespace's block size per key) and the key of the block before it (32 zero bytes: none).
    """

    tokens: bytes = b""
    parents: bytes = b""


class Load(_Job, tag="load"):
    """Copy the pool's blocks for ``keys[i]`` into engine block ``block_ids[i]``. ``lease_id`` names the
    LOOKUP's lease: the load consumes this rank's share of it (the copy pins what it reads itself)."""

    lease_id: U63 = 0


class Notice(Message, tag="notice"):
    """A job is over. ``failed`` lists the indices (into the job's keys) that were not done."""

    job_id: int = 0
    ok: bool = True
    failed: Annotated[list[int], Meta(max_length=MAX_KEYS)] = []
    code: str = ""  # a NoticeCode value (a str on the wire: a newer peer may send a code this one lacks)
    message: str = ""


class Stats(Message, tag="stats"):
    detail: bool = False


class StatsResult(Message, tag="stats_result"):
    stats: dict[str, Any] = {}


class Clear(Message, tag="clear"):
    """Drop cached blocks: one namespace, or all when ``namespace`` is empty."""

    namespace: Annotated[str, Meta(max_length=MAX_NAME)] = ""


class Cleared(Message, tag="cleared"):
    removed_blocks: int = 0
    in_flight_jobs: int = 0  # jobs still running; their stores will not become visible


class Explain(Message, tag="explain"):
    """Why would these keys miss? (operators' tool; not on the serving path)."""

    namespace: Name = ""
    keys: bytes = b""

    def __post_init__(self) -> None:
        self.keys = _keyblob(self.keys)


class Explained(Message, tag="explained"):
    entries: list[dict[str, Any]] = []


class Ping(Message, tag="ping"):
    """Liveness; also a heartbeat that keeps the sender's engines registered."""


class Pong(Message, tag="pong"):
    daemon_id: str = ""


class Ok(Message, tag="ok"):
    pass


class Error(Message, tag="error"):
    code: str = ErrorCode.INTERNAL.value
    message: str = ""
    job_id: int | None = None


MESSAGES: dict[str, type[Message]] = {
    cls.__struct_config__.tag: cls
    for cls in (Hello, HelloOk, Register, Registered, Unregister, Lookup, LookupResult, Release, Store,
                Load, Notice, Stats, StatsResult, Clear, Cleared, Explain, Explained, Ping, Pong, Ok, Error)
}
for _tag, _cls in MESSAGES.items():
    _cls.op = Op(_tag)
REQUESTS = frozenset({Op.HELLO, Op.REGISTER, Op.UNREGISTER, Op.LOOKUP, Op.RELEASE, Op.STORE, Op.LOAD,
                      Op.STATS, Op.CLEAR, Op.PING, Op.EXPLAIN})
_DECODERS = {
    only_requests: msgspec.msgpack.Decoder(Union[tuple(c for c in MESSAGES.values()  # noqa: UP007
                                                       if not only_requests or c.op in REQUESTS)])
    for only_requests in (False, True)
}
_encode = msgspec.msgpack.Encoder().encode


class _Envelope(msgspec.Struct):
    """What an ERROR reply echoes from a refused frame, read only when the frame is refused."""

    seq: Any = 0
    job_id: Any = None


_ENVELOPE = msgspec.msgpack.Decoder(_Envelope)
_HINTS = {"keys": f"must be one binary of {KEY_SIZE}-byte keys back to back",
          "block_ids": "must be one binary of little-endian int32"}
_FIELD = re.compile(r"`\$\.([A-Za-z_]\w*)")


def encode(msg: Message) -> bytes:
    return _encode(msg)


def decode(frame: bytes, *, requests_only: bool = False) -> Message:
    """Parse and validate one frame. Raises ProtocolError with the right code; never anything else."""
    if len(frame) > MAX_FRAME_BYTES:
        raise ProtocolError(ErrorCode.FRAME_TOO_LARGE, f"frame of {len(frame)} bytes; at most {MAX_FRAME_BYTES}")
    try:
        return _DECODERS[requests_only].decode(frame)
    except msgspec.ValidationError as e:  # (a DecodeError: first)
        err = _refusal(str(e))
    except msgspec.DecodeError as e:
        err = ProtocolError(ErrorCode.BAD_FRAME, f"not a msgpack message: {e}")
    except ProtocolError as e:  # raised by a __post_init__ check
        err = e
    except RecursionError:  # msgspec's answer to maps nested thousands deep: no message is that deep
        err = ProtocolError(ErrorCode.BAD_FRAME, "msgpack nested too deeply")
    if err.code is not ErrorCode.BAD_FRAME:
        err.seq, err.job_id = _echo(frame)
    raise err


def _refusal(text: str) -> ProtocolError:
    """An ERROR for msgspec's complaint, e.g. "Expected `int` >= 0 - at `$.seq`": the field names the code."""
    reason, _, where = text.partition(" - at ")
    m = _FIELD.search(where)
    if m is None:  # about the whole message
        if "`op`" in reason:  # "Object missing required field `op`"
            return ProtocolError(ErrorCode.UNKNOWN_OP, "a message needs an op")
        if reason.startswith("Object missing required field"):
            return ProtocolError(ErrorCode.BAD_FIELD, reason)
        return ProtocolError(ErrorCode.BAD_FRAME, f"a message must be a msgpack map ({reason})")
    if where == "`$.memory.kind`":  # a kind this protocol does not know (e.g. the old path kind)
        return ProtocolError(ErrorCode.MEMORY_UNREACHABLE, f"memory.kind: {reason}; this protocol knows "
                             f"{list(MEMORY_KINDS)} (a daemon says which it serves in hello_ok)")
    name = m.group(1)
    if name == "op":
        return ProtocolError(ErrorCode.UNKNOWN_OP, f"unknown op ({reason})")
    if name in _HINTS:
        return ProtocolError(ErrorCode.BAD_KEY if name == "keys" else ErrorCode.BAD_FIELD,
                             f"{name} {_HINTS[name]} ({reason})")
    inside = "" if where == f"`$.{name}`" else f" (at {where})"  # e.g. "`key` in `$.memory`"
    return ProtocolError(ErrorCode.BAD_FIELD, f"{name}: {reason}{inside}")


def _echo(frame: bytes) -> tuple[int, int | None]:
    """The seq (and job id) a refused frame carried, where they are well-formed."""
    try:
        env = _ENVELOPE.decode(frame)
    except msgspec.DecodeError:
        return 0, None
    seq = env.seq if type(env.seq) is int and 0 <= env.seq < (1 << 63) else 0
    return seq, env.job_id if type(env.job_id) is int else None


def error_for(exc: ProtocolError) -> Error:
    return Error(seq=exc.seq, code=exc.code.value, message=exc.message, job_id=exc.job_id)


def parse_layout(layout: dict[str, Any] | Layout) -> tuple[int, list[Segment]]:
    """A layout map (as ``describe_layout`` gives it) checked as REGISTER checks it: (num_blocks,
    segments). For tools and benches that attach a backend without the daemon."""
    if not isinstance(layout, Layout):
        try:
            layout = msgspec.convert(layout, Layout)
        except msgspec.ValidationError as e:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"layout: {e}") from None
    return layout.num_blocks, layout.runs()
