"""The protocol's codes: the ops (wire tags), the ERROR codes, why a NOTICE failed keys, why a LOOKUP
missed, why a STORE dropped a block; and ``ProtocolError``, the exception an ERROR reply is made of.
docs/protocol.md lists every member (tests/test_docs_complete.py checks it)."""

from __future__ import annotations

import enum


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
    LANDED = "landed"
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

