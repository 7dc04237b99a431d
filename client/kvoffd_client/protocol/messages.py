"""The messages: one msgspec Struct per op (``op`` is each class's wire tag), ``MESSAGES`` (tag ->
class) and ``REQUESTS`` (the ops a client may send)."""

from __future__ import annotations

from typing import Annotated, Any, ClassVar

import msgspec
from msgspec import Meta

from kvoffd_client.protocol.codes import ErrorCode, Op
from kvoffd_client.protocol.keys import idblob, keyblob
from kvoffd_client.protocol.limits import (
    MAX_KEYS,
    MAX_NAME,
    MAX_PARTS,
    PROTOCOL_VERSION,
    U63,
    EventIndex,
    LeaseMs,
    Name,
    Rank,
    WorldSize,
)
from kvoffd_client.protocol.memory import Layout, Memory

# --------------------------------------------------------------------------------------------------
# Messages. ``op`` is the wire tag of each class. Unknown extra fields are ignored, so a newer peer can
# add optional fields within v1. Keys and block ids are held packed, as they travel (see keyblob).


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
    fd_socket: str = ""  # the UNIX socket that takes memory descriptors, ``cpu_fd`` and ``cuda_vmm`` (empty: none)


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

    With ``lease_ms`` > 0 the hits are held (a ref each) against eviction for that long, or until a LOAD
    naming the lease consumes them, or a RELEASE drops them. The daemon checks ``keys`` mostly
    without splitting them (kvoffd/cache/index.py, ``Run``).
    """

    namespace: Name = ""
    keys: bytes = b""
    lease_ms: LeaseMs = 0

    def __post_init__(self) -> None:
        self.keys = keyblob(self.keys)


class LookupResult(Message, tag="lookup_result"):
    hits: int = 0
    lease_id: int = 0  # 0: no lease was taken (no hits or none asked)
    world_size: int = 0  # ranks the namespace has (0: namespace unknown to the daemon)


class Release(Message, tag="release"):
    lease_id: U63 = 0


class _Job(Message):
    """What STORE and LOAD share: one step's batch, ``keys[i]`` with engine block ``block_ids[i]``.

    ``ready_event`` (CUDA) is the index of the interprocess CUDA event in the ring shared at REGISTER
    that the copy must wait for; -1 means the engine's writes are already complete (CPU: after the
    step). (KV events, what routers read of the pool, are another thing: docs/vllm.md.)

    ``expires_ns`` (CLOCK_MONOTONIC; 0: never): the daemon refuses to start the copy after it. This
    protects against a daemon that hangs and then wakes up: a client that has given up on a job (and
    let vLLM reuse the blocks) must not see it run late. Every process on the host shares the clock.
    """

    engine_id: Name = ""
    job_id: U63 = 0
    keys: bytes = b""
    block_ids: bytes = b""  # little-endian int32
    ready_event: EventIndex = -1
    expires_ns: U63 = 0
    #: A job in parts (only to a daemon whose HELLO_OK lists ``parts``): strictly increasing byte
    #: offsets into a block's slot where a part starts; part p is slot bytes [cuts[p-1], cuts[p]) of
    #: every block (cuts[-1] = 0, the last part ends at the slot's end). The parts are copied in order,
    #: and a LOAD's parts are announced as they land (LANDED), so an engine computes layer by layer.
    cuts: Annotated[list[U63], Meta(max_length=MAX_PARTS - 1)] = []

    def __post_init__(self) -> None:
        self.keys = keyblob(self.keys)
        self.block_ids = idblob(self.block_ids)


class Store(_Job, tag="store"):
    """Copy engine blocks ``block_ids[i]`` into the pool under ``keys[i]``.

    ``tokens`` and ``parents`` (optional, only to a daemon whose HELLO_OK lists the ``kv_events``
    capability) describe the blocks for KV events: each block's token ids (little-endian uint32,
    the namespace's block size per key) and the key of the block before it (32 zero bytes: none).
    """

    tokens: bytes = b""
    parents: bytes = b""
    #: With ``cuts``: the event of the engine's ring that part p waits for (the forward wrote that
    #: part's layers), one per part; empty: every part waits for ``ready_event``.
    ready_events: Annotated[list[EventIndex], Meta(max_length=MAX_PARTS)] = []


class Load(_Job, tag="load"):
    """Copy the pool's blocks for ``keys[i]`` into engine block ``block_ids[i]``. ``lease_id`` names the
    LOOKUP's lease: the load consumes this rank's share of it (the copy holds what it reads itself)."""

    lease_id: U63 = 0


class Landed(Message, tag="landed"):
    """Parts 0..``parts``-1 of LOAD ``job_id`` (one in parts: ``cuts``) are in the engine's memory,
    visible to its next kernel. Sent in order as parts land; the job's NOTICE still ends it (and says
    whether every part landed: a job that failed after some parts landed fails as a whole)."""

    job_id: int = 0
    parts: int = 0


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
    removed_blocks: int = 0  # the pool's
    in_flight_jobs: int = 0  # jobs still running; their stores will not become visible
    removed_tier_blocks: dict[str, int] = {}  # each tier's below the pool, by name ("disk"); {} without one


class Explain(Message, tag="explain"):
    """Why would these keys miss? (operators' tool; not on the serving path)."""

    namespace: Name = ""
    keys: bytes = b""

    def __post_init__(self) -> None:
        self.keys = keyblob(self.keys)


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
                Load, Landed, Notice, Stats, StatsResult, Clear, Cleared, Explain, Explained, Ping, Pong, Ok, Error)
}
for _tag, _cls in MESSAGES.items():
    _cls.op = Op(_tag)
REQUESTS = frozenset({Op.HELLO, Op.REGISTER, Op.UNREGISTER, Op.LOOKUP, Op.RELEASE, Op.STORE, Op.LOAD,
                      Op.STATS, Op.CLEAR, Op.PING, Op.EXPLAIN})
