"""REGISTER: an engine worker's KV memory, checked, mapped (in an executor: slow) and given its table.

A refused REGISTER changes nothing: every check that needs no mapping runs first, the table is
created only once the memory is mapped, and a registration that lost its connection or was
overtaken meanwhile unmaps again. A re-registration replaces the old engine only once the new
mapping works (kvoffd/server/sessions.py, ``Sessions.attach``).
"""

from __future__ import annotations

import asyncio
import logging

from kvoffd.cache.keyspace import Keyspace
from kvoffd.metrics import Metrics
from kvoffd.pool.allocator import MIN_SLOT_BYTES
from kvoffd.server.fdbudget import FdBudget
from kvoffd.server.fdserver import Handover
from kvoffd.server.limits import MAX_ENGINES_PER_CONN, MAX_SEGMENTS
from kvoffd.server.placement import place_engine
from kvoffd.server.sessions import Conn, Engine, Sessions
from kvoffd.transfer.base import AttachError, TransferBackend
from kvoffd_client import protocol as P
from kvoffd_client.protocol import ErrorCode, ProtocolError

log = logging.getLogger(__name__)


class Registrar:
    """Serves REGISTER for the sessions (an ``is_async`` row of the server's table). The keyspace
    checks and creates each engine's table, hears each namespace's ``layout.kv_events``
    (``Keyspace.note_identity``), and its ``topology`` (the host's NUMA nodes) places each engine's
    stores on a pool shard."""

    def __init__(self, *, sessions: Sessions, keyspace: Keyspace, metrics: Metrics, fds: FdBudget,
                 by_kind: dict[str, TransferBackend]) -> None:
        self.sessions = sessions
        self.keyspace = keyspace
        self.metrics = metrics
        self.fds = fds
        self.by_kind = by_kind

    async def register(self, conn: Conn, msg: P.Register) -> P.Message | None:
        """Map an engine's memory (in an executor: slow) and create its table; a refusal changes
        nothing. Answered only if the connection is still there once the mapping is done."""
        conn.registering += 1
        try:
            reply = await self._register(conn, msg)
        except ProtocolError as e:
            e.seq = msg.seq
            self.metrics.errors.labels(e.code.value).inc()
            log.warning("engine %s: registration refused: %s", msg.engine_id, e.message)
            reply = P.error_for(e)
        finally:
            conn.registering -= 1
        return reply if conn.ident in self.sessions.conns else None

    def _check_register(self, conn: Conn, msg: P.Register, segments: list[P.Segment]) -> Engine | None:
        """The checks that need no mapping, after the memory kind's; returns the engine this one would
        replace."""
        old = self.sessions.engines.get(msg.engine_id)
        if old is not None and old.conn is not conn and old.conn.ident in self.sessions.conns:
            raise ProtocolError(ErrorCode.FOREIGN_ENGINE, f"engine {msg.engine_id!r} is registered by "
                                "another live connection")
        if old is None and len(conn.engines) + conn.registering > MAX_ENGINES_PER_CONN:  # (this one included)
            raise ProtocolError(ErrorCode.TOO_MANY, f"at most {MAX_ENGINES_PER_CONN} engines per connection")
        if len(segments) > MAX_SEGMENTS:
            raise ProtocolError(ErrorCode.TOO_MANY, f"a block of {len(segments)} segments; at most {MAX_SEGMENTS}")
        if self.fds.engines_refused():
            raise ProtocolError(ErrorCode.TOO_MANY, f"the daemon's file descriptors are nearly exhausted "
                                f"({self.fds.in_use()} of {self.fds.limit}); try again later")
        slot_bytes = sum(s.length for s in segments)
        chunk_bytes = self.keyspace.pool.chunk_bytes
        if slot_bytes > chunk_bytes:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"a block of {slot_bytes} bytes exceeds the pool's "
                                f"{chunk_bytes}-byte chunks")
        if slot_bytes < MIN_SLOT_BYTES:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"a block of {slot_bytes} bytes is below the "
                                f"{MIN_SLOT_BYTES}-byte minimum (the index's bookkeeping would outweigh it)")
        try:  # checked now, created only once the memory is mapped: a refused REGISTER leaves nothing
            self.keyspace.check_table(msg.namespace, msg.rank, msg.world_size, tuple(s.length for s in segments),
                                   msg.replicas)
        except ValueError as e:
            raise ProtocolError(ErrorCode.LAYOUT_MISMATCH, str(e)) from None
        return old

    async def _register(self, conn: Conn, msg: P.Register) -> P.Message:
        """The descriptors a token names are claimed first and are this REGISTER's whatever follows: the
        backend takes them (and closes them), or they are closed here on a refusal, so a refused REGISTER
        leaves nothing waiting in the fd socket either (a token is good for one REGISTER)."""
        handover = self._claim(msg.memory)
        try:
            return await self._register_with(conn, msg, handover)
        finally:
            if handover is not None:
                handover.close()  # a no-op once the backend took the descriptors

    def _claim(self, memory: P.Memory) -> Handover | None:
        token = getattr(memory, "token", None)  # the kinds whose memory comes as descriptors
        handover = self.sessions.fd_handover
        return handover.claim(token) if token is not None and handover is not None else None

    async def _register_with(self, conn: Conn, msg: P.Register, handover: Handover | None) -> P.Message:
        if msg.rank >= msg.world_size:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"rank {msg.rank} is not below world_size {msg.world_size}")
        if msg.world_size % msg.replicas:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"replicas {msg.replicas} does not divide world_size "
                                f"{msg.world_size}")
        num_blocks, segments = msg.layout.num_blocks, msg.layout.runs()
        kind = msg.memory.KIND
        backend = self.by_kind.get(kind)
        if backend is None:
            raise ProtocolError(ErrorCode.MEMORY_UNREACHABLE, f"memory kind {kind!r:.40} is not served here; "
                                f"this daemon maps {sorted(self.by_kind)}")
        old = self._check_register(conn, msg, segments)
        slot_bytes, layout_fp = sum(s.length for s in segments), tuple(s.length for s in segments)
        handed = self._handed(msg.memory, handover)
        loop = asyncio.get_running_loop()
        try:
            mapped = await loop.run_in_executor(None, backend.attach, msg.engine_id, msg.memory, handed,
                                                num_blocks, segments)
        except AttachError as e:
            raise ProtocolError(ErrorCode.MEMORY_UNREACHABLE, str(e)) from None
        try:
            if conn.ident not in self.sessions.conns:
                raise ProtocolError(ErrorCode.NOT_REGISTERED, "the connection closed while mapping")
            if self.sessions.engines.get(msg.engine_id) is not old:
                raise ProtocolError(ErrorCode.NOT_REGISTERED, "the engine was registered again meanwhile")
            try:
                table = self.keyspace.table(msg.namespace, msg.rank, msg.world_size, slot_bytes, layout_fp,
                                            msg.replicas)
            except ValueError as e:
                raise ProtocolError(ErrorCode.LAYOUT_MISMATCH, str(e)) from None
        except ProtocolError:
            await loop.run_in_executor(None, backend.detach, mapped)
            raise
        self.keyspace.note_identity(msg.namespace, msg.layout.kv_events)  # whether its keys are block hashes
        placement = place_engine(self.keyspace.pool, self.keyspace.topology, mapped, conn.pid)
        self.sessions.attach(Engine(engine_id=msg.engine_id, conn=conn, namespace=msg.namespace, rank=msg.rank,
                                    world_size=msg.world_size, mapped=mapped, backend=backend, table=table,
                                    placement=placement), old)
        log.info("engine %s registered: pid %d, namespace %s rank %d/%d%s, %d blocks of %d bytes (%s, %s)%s",
                 msg.engine_id, conn.pid, msg.namespace, msg.rank, msg.world_size,
                 f" (reads rank {table.rank}'s copy)" if table.rank != msg.rank else "", num_blocks, slot_bytes,
                 backend.name, msg.layout.desc,
                 f"; NUMA node {placement.node} ({placement.source}), pool shard {placement.shard}"
                 if placement.shard >= 0 else "")
        return P.Registered(seq=msg.seq, engine_id=msg.engine_id, slot_bytes=slot_bytes, backend=backend.name)

    def _handed(self, memory: P.Memory, handover: Handover | None) -> Handover | None:
        """The descriptors the backend's ``attach`` takes with ``memory`` (its shape already checked by
        the decoder), checked against it: ``cpu_fd`` one, ``cuda_vmm`` one per piece, ``cuda_ipc`` none.
        Only the batch the token named, never the client's fields (which could name an ``fd`` of its
        own choosing); from here the backend owns them and closes them whatever happens (``handover``
        is emptied)."""
        if isinstance(memory, P.CudaIpc):
            return None
        if handover is None:
            raise ProtocolError(ErrorCode.MEMORY_UNREACHABLE, "unknown or expired memory token: hand the "
                                "descriptors to the fd socket again (a token is good for one REGISTER)")
        if isinstance(memory, P.CudaVmm):
            self._check_pieces(memory, handover)
        elif len(handover.fds) != 1:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"cpu_fd memory is one descriptor; the token names "
                                f"{len(handover.fds)}")
        return handover.pass_on()

    def _check_pieces(self, memory: P.CudaVmm, handover: Handover) -> None:
        """``cuda_vmm``: piece i is descriptor i of the batch; the batch must have one per piece, each
        declared with the piece's size (else the REGISTER is refused and the descriptors closed)."""
        if len(handover.fds) != len(memory.pieces):
            raise ProtocolError(ErrorCode.BAD_FIELD, f"memory.pieces lists {len(memory.pieces)} pieces; the "
                                f"token names {len(handover.fds)} descriptors")
        for i, (p, size) in enumerate(zip(memory.pieces, handover.sizes, strict=True)):
            if p.size != size:
                raise ProtocolError(ErrorCode.BAD_FIELD, f"memory.pieces[{i}] is {p.size} bytes; its descriptor "
                                    f"was handed over as {size}")
