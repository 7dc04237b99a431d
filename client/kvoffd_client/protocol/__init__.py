"""kvoffd wire protocol v1: the one definition both the daemon and its clients use.

Transport: the daemon binds a ZeroMQ ROUTER, clients connect DEALERs. Every message is one frame
holding one msgpack map: ``{"op": <Op>, "seq": <int>, ...fields}``. ``seq`` is chosen by the sender
of a request and echoed in the reply, so a client can keep several requests in flight and match the
answers. Completion notices for STORE/LOAD jobs arrive unsolicited (op NOTICE) and carry the job id.

This package imports only the standard library and msgspec (which vLLM itself depends on): vLLM
imports the connector (and so this package) in its API-server process, where nothing heavy may load.
See docs/protocol.md for the prose. Callers import from here (``from kvoffd_client import protocol
as P``); the modules are: ``limits`` (bounds and field types), ``codes`` (ops, codes, reasons,
``ProtocolError``), ``keys`` (packed keys and ids), ``memory`` (REGISTER's memory and layout),
``messages`` (one Struct per op), ``codec`` (encode, decode, the ERROR for a refusal), ``fdsocket``
(the fd socket's batch hand-over).
"""

from kvoffd_client.protocol.codec import decode, encode, error_for
from kvoffd_client.protocol.codes import DropReason, ErrorCode, MissReason, NoticeCode, Op, ProtocolError
from kvoffd_client.protocol.fdsocket import FD_SOCKET_VERSION, MAX_BATCH_FDS, FdBatch, FdChunk, FdReply
from kvoffd_client.protocol.keys import count_keys, pack_ids, pack_keys, split_keys
from kvoffd_client.protocol.limits import (
    KEY_SIZE,
    MAX_BLOCK_TOKENS,
    MAX_EVENTS,
    MAX_FD_MESSAGE,
    MAX_FDS_PER_MESSAGE,
    MAX_FRAME_BYTES,
    MAX_KEYS,
    MAX_NAME,
    MAX_PARTS,
    MAX_VMM_PIECES,
    MEMORY_KINDS,
    PROTOCOL_VERSION,
    U63,
    EventIndex,
    IpcHandle,
    LeaseMs,
    Name,
    Rank,
    SegmentLength,
    WorldSize,
)
from kvoffd_client.protocol.memory import (
    CpuFd,
    CudaIpc,
    CudaVmm,
    KvEventsLayout,
    Layout,
    Memory,
    Segment,
    VmmPiece,
    parse_layout,
)
from kvoffd_client.protocol.messages import (
    MESSAGES,
    REQUESTS,
    Clear,
    Cleared,
    Error,
    Explain,
    Explained,
    Hello,
    HelloOk,
    Landed,
    Load,
    Lookup,
    LookupResult,
    Message,
    Notice,
    Ok,
    Ping,
    Pong,
    Register,
    Registered,
    Release,
    Stats,
    StatsResult,
    Store,
    Unregister,
    start_ticks,
)

__all__ = [
    "FD_SOCKET_VERSION", "KEY_SIZE", "MAX_BATCH_FDS", "MAX_BLOCK_TOKENS", "MAX_EVENTS", "MAX_FDS_PER_MESSAGE",
    "MAX_FD_MESSAGE", "MAX_FRAME_BYTES", "MAX_KEYS",
    "MAX_NAME", "MAX_PARTS", "MAX_VMM_PIECES", "MEMORY_KINDS", "MESSAGES", "PROTOCOL_VERSION", "REQUESTS", "U63",
    "Clear", "Cleared", "CpuFd", "CudaIpc", "CudaVmm", "DropReason", "Error", "ErrorCode", "EventIndex",
    "Explain", "Explained", "FdBatch", "FdChunk", "FdReply", "Hello", "HelloOk", "IpcHandle", "KvEventsLayout", "Layout", "Landed", "LeaseMs", "Load",
    "Lookup", "LookupResult", "Memory", "Message", "MissReason", "Name", "Notice", "NoticeCode", "Ok", "Op", "Ping",
    "Pong", "ProtocolError", "Rank", "Register", "Registered", "Release", "Segment", "SegmentLength",
    "Stats", "StatsResult", "Store", "Unregister", "VmmPiece", "WorldSize", "count_keys", "decode",
    "encode", "error_for", "pack_ids", "pack_keys", "parse_layout", "split_keys", "start_ticks",
]
