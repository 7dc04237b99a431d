"""The small seam between the server and the code that moves bytes.

The server owns the decisions (which blocks, which slots, visibility); a backend only maps an
engine's memory and copies batches between it and the pool. One call moves a whole job, never a block.
"""

from __future__ import annotations

import asyncio
import enum
import functools
import time
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Iterator
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from kvoffd.pool.allocator import Pool
from kvoffd_client import protocol as P
from kvoffd_client.protocol import Segment


class Direction(enum.Enum):
    STORE = "store"  # engine -> pool
    LOAD = "load"  # pool -> engine


class Descriptors(Protocol):
    """The descriptors REGISTER's memory token named (the server's fd-socket ``Handover``): in the
    order the client handed them over, each with the size it declared (already checked against the
    memory's fields). Whoever holds it owns the descriptors; ``close`` closes those still held."""

    fds: list[int]
    sizes: list[int]

    def close(self) -> None: ...


class AttachError(Exception):
    """The engine's memory description cannot be mapped (answered as MEMORY_UNREACHABLE)."""


class JobExpired(Exception):
    """The job's deadline passed before (the rest of) its copy could start, so it was not started.

    Raised by a backend only once nothing of the job can still move (answered with code ``expired``):
    a LOAD may have written some of its blocks (the engine recomputes them), a STORE is never
    committed. The client gave up at ``expires_ns`` and the engine may be about to reuse the blocks.
    """


def past(expires_ns: int) -> bool:
    """Whether a job's deadline (CLOCK_MONOTONIC ns, 0: none) has passed. Checked where a copy starts."""
    return expires_ns != 0 and time.monotonic_ns() > expires_ns


@dataclass(frozen=True, eq=False)
class Runs:
    """The byte runs of one block that a copy moves: run k lies at ``offset[k] + b*stride[k]`` in the
    engine's memory for block b, ``length[k]`` bytes, at ``pos[k]`` in the block's pool slot.

    A whole block is its segments back to back in the slot (:meth:`of`); a part of a block (a group
    of layers, :meth:`cut`) is the runs that cover a range of slot bytes, segments split where the
    range ends inside one (a block-contiguous layout, one run holding every layer, is cut by bytes).
    """

    offset: np.ndarray
    stride: np.ndarray
    length: np.ndarray
    pos: np.ndarray

    @classmethod
    def of(cls, segments: list[Segment]) -> Runs:
        n = len(segments)
        length = np.fromiter((s.length for s in segments), dtype=np.int64, count=n)
        return cls(offset=np.fromiter((s.offset for s in segments), dtype=np.int64, count=n),
                   stride=np.fromiter((s.stride for s in segments), dtype=np.int64, count=n),
                   length=length, pos=np.concatenate(([0], np.cumsum(length)[:-1])).astype(np.int64))

    def __len__(self) -> int:
        return len(self.length)

    @property
    def nbytes(self) -> int:
        """Bytes of one block these runs move."""
        return int(self.length.sum())

    def cut(self, cuts: list[int] | tuple[int, ...]) -> list[Runs]:
        """The parts ``cuts`` makes of these (whole-block) runs: part p covers slot bytes
        [cuts[p-1], cuts[p]) (from 0, to the slot's end). ValueError unless the cuts are strictly
        increasing and inside the slot, so that every part is a non-empty range."""
        total = self.nbytes
        edges = [0, *cuts, total]
        if any(b <= a for a, b in zip(edges, edges[1:], strict=False)):
            raise ValueError(f"cuts must increase strictly inside the {total}-byte slot; got {list(cuts)[:8]}")
        end = self.pos + self.length
        parts = []
        for a, b in zip(edges, edges[1:], strict=False):
            k = np.nonzero((self.pos < b) & (end > a))[0]
            lo = np.maximum(self.pos[k], a)
            hi = np.minimum(end[k], b)
            parts.append(Runs(offset=self.offset[k] + (lo - self.pos[k]), stride=self.stride[k], length=hi - lo,
                              pos=lo))
        return parts


#: Distinct ``cuts`` one mapping keeps the parts of (an engine uses one or two).
PART_CACHE = 8


@dataclass
class MappedMemory:
    """An engine's KV memory as the daemon sees it, plus the layout of one block in it.

    Each backend attaches a subclass of its own that holds its state (``cpu.FdMapping``: the address
    of the mapped memfd; ``cuda.CudaMapping``: device, streams, event ring), so no backend reads
    another's fields and a misspelt one is an AttributeError, not a silent default.
    """

    engine_id: str
    kind: str
    size: int
    num_blocks: int
    segments: list[Segment]
    slot_bytes: int
    in_flight: int = 0  # jobs using this mapping; detach waits for zero
    num_events: int = 0  # the engine's interprocess event ring: STORE/LOAD ``event`` must lie below it
    gpu_ordinal: int = -1  # the engine's GPU (CUDA ordinal in the daemon) where it has one: its NUMA node
    pci_bus_id: str = ""  # that GPU's PCI bus id (how sysfs names its NUMA node)

    def check_bounds(self) -> None:
        check_bounds(self.size, self.num_blocks, self.segments)

    @functools.cached_property
    def runs(self) -> Runs:
        """A whole block's runs."""
        return Runs.of(self.segments)

    def parts(self, cuts: list[int]) -> list[Runs]:
        """The runs of each part of a block cut at ``cuts`` (:meth:`Runs.cut`), kept for the next job
        with the same cuts. ValueError for cuts that do not cut this block's slot."""
        key = tuple(cuts)
        cache: dict[tuple[int, ...], list[Runs]] = self.__dict__.setdefault("_parts", {})
        got = cache.get(key)
        if got is None:
            got = self.runs.cut(key)
            if len(cache) >= PART_CACHE:
                cache.pop(next(iter(cache)))
            cache[key] = got
        return got


def check_bounds(size: int, num_blocks: int, segments: list[Segment]) -> None:
    """Every segment of every block lies inside the ``size``-byte region (else AttachError)."""
    last = num_blocks - 1
    for i, s in enumerate(segments):
        end = s.offset + last * s.stride + s.length
        if end > size:
            raise AttachError(f"segment {i} ends at byte {end}, past the {size}-byte region")


class TransferBackend(ABC):
    """Maps engine memory and copies batches; the server's job task awaits what ``submit`` returns."""

    name: str = "base"

    def __init__(self, pool: Pool):
        self.pool = pool

    def start(self) -> None:  # noqa: B027 - optional hook
        """Called once inside the running event loop (start pollers, pinning threads...)."""

    @abstractmethod
    def kinds(self) -> tuple[str, ...]:
        """Memory kinds (REGISTER memory.kind) this backend can map."""

    @abstractmethod
    def attach(self, engine_id: str, memory: P.Memory, handover: Descriptors | None, num_blocks: int,
               segments: list[Segment]) -> MappedMemory:
        """Map the engine's memory (REGISTER's, as decoded: its shape is checked, its values are the
        backend's to check). ``handover``: the descriptors its token named (None for a kind without
        descriptors); from here they are the backend's, which closes them whatever happens. Raises
        AttachError. Runs off the event loop (may be slow)."""

    @abstractmethod
    def detach(self, mapped: MappedMemory) -> None:
        """Unmap. Only called when no job is in flight on it. Runs off the event loop."""

    @abstractmethod
    def submit(self, direction: Direction, mapped: MappedMemory, block_ids: np.ndarray,
               slots: np.ndarray, event: int = -1, expires_ns: int = 0, runs: Runs | None = None
               ) -> Awaitable[None]:
        """Start moving ``block_ids[i]`` <-> pool slot at byte offset ``slots[i]``, as one batch:
        the whole of each block, or only ``runs`` of it (one part of a job in parts).

        The work must begin before this returns (the server does its per-key bookkeeping while the
        bytes move); the awaitable completes once they are in place (for a LOAD: visible to the
        engine's next kernel) and raises if the job failed as a whole. Called on the event loop.
        ``event`` is the index in the engine's event ring that a STORE must wait for (-1: none).
        No part of the job may start after ``expires_ns`` (CLOCK_MONOTONIC; 0: no deadline): the check
        is made where the bytes start to move (a copy thread taking the job from a backlog, each
        syscall batch, a GPU stream enqueue), not when the job is queued, so a backlog or a frozen
        daemon cannot start it late. A job stopped that way raises :class:`JobExpired`, and only once
        nothing of it is still moving: its notice tells the client that the blocks are free again.
        """

    def submit_parts(self, direction: Direction, mapped: MappedMemory, block_ids: np.ndarray, slots: np.ndarray,
                     parts: list[Runs], events: list[int], expires_ns: int = 0) -> list[Awaitable[None]]:
        """A job in parts: ``parts[p]`` of every block, gated on ``events[p]`` (-1: none), each with its
        own awaitable, queued in part order (a part that cannot be queued fails, and the later ones
        are not started: the list ends there). Called on the event loop. This default submits each
        part as a job of its own; a backend whose own queueing could reorder them overrides it."""
        out: list[Awaitable[None]] = []
        for runs, event in zip(parts, events, strict=True):
            try:
                out.append(self.submit(direction, mapped, block_ids, slots, event, expires_ns, runs))
            except Exception as e:  # noqa: BLE001 - the job fails once what was queued is done
                out.append(failed_future(e))
                break
        return out

    def abort(self, mapped: MappedMemory) -> int:
        """The engine died: fail its jobs that have not started (e.g. waiting on an event its GPU will
        never reach). Jobs already moving bytes finish. Returns how many were failed."""
        return 0

    def close(self) -> None:  # noqa: B027 - optional hook
        """Release everything (the daemon is stopping)."""

    def describe(self) -> dict[str, Any]:
        return {"name": self.name}


def failed_future(exc: BaseException) -> asyncio.Future:
    """A future (on the running loop) already failed with ``exc``: a copy that could not start."""
    fut = asyncio.get_running_loop().create_future()
    fut.set_exception(exc)
    return fut


def first_failure(errors: list[BaseException]) -> BaseException:
    """The error a job of several copies (threads, parts) fails with: the first that is not an expiry
    (a real failure says more than "not started in time"), else the first."""
    return next((e for e in errors if not isinstance(e, JobExpired)), errors[0])


def run_descriptors(mapped: MappedMemory, block_ids: np.ndarray, slots: np.ndarray, pool_base: int,
                    runs: Runs | None = None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Byte runs for a batch, built with numpy: (engine offsets, pool addresses, lengths).

    Run k of block i is run k of ``runs`` (default: the block's segments, back to back in its slot)
    for that block. Order is block-major so neighbouring runs on both sides can be coalesced.
    """
    r = mapped.runs if runs is None else runs
    b = block_ids.astype(np.int64)[:, None]
    eng = (r.offset[None, :] + b * r.stride[None, :]).ravel()
    pool = (pool_base + slots.astype(np.int64)[:, None] + r.pos[None, :]).ravel()
    lens = np.broadcast_to(r.length, (len(block_ids), len(r))).ravel()
    return eng, pool, lens


DESCRIBE_RUNS = 1 << 16  # runs described at a time: ~4 MB of descriptors, a few ms of numpy


def describe_in_chunks(mapped: MappedMemory, block_ids: np.ndarray, slots: np.ndarray, pool_base: int,
                       max_runs: int = DESCRIBE_RUNS, runs: Runs | None = None
                       ) -> Iterator[tuple[np.ndarray, np.ndarray, np.ndarray]]:
    """:func:`run_descriptors` for consecutive ranges of blocks, about ``max_runs`` runs each.

    Why: a job's runs are blocks x segments, millions for a large job of a many-segment layout. Built
    at once they cost seconds and gigabytes; built a chunk at a time on a copy thread their memory is
    bounded and the event loop never waits for them.
    """
    step = max(1, max_runs // max(1, len(mapped.runs if runs is None else runs)))
    for a in range(0, len(block_ids), step):
        yield run_descriptors(mapped, block_ids[a:a + step], slots[a:a + step], pool_base, runs)


def pool_chunks(pool_addrs: np.ndarray, pool: Pool) -> np.ndarray:
    """The pool chunk each address lies in: the ``region`` ids :func:`coalesce` keeps runs within."""
    return (pool_addrs - pool.base_address) // pool.chunk_bytes


def coalesce(src: np.ndarray, dst: np.ndarray, lens: np.ndarray, region: np.ndarray | None = None
             ) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Merge runs that continue the previous one on both sides (contiguous blocks -> one run).

    ``region``: an id per run (its pool chunk, :func:`pool_chunks`); runs merge only within one id.
    The pool is page-locked in regions of whole chunks, and the CUDA driver refuses a single copy
    whose host range spans two registrations (CUDA_ERROR_INVALID_VALUE: seen on the H200 when
    freshly carved slots of neighbouring chunks met contiguous engine blocks in one 400 MiB run).
    """
    if len(lens) <= 1:
        return src, dst, lens
    cont = (src[1:] == src[:-1] + lens[:-1]) & (dst[1:] == dst[:-1] + lens[:-1])
    if region is not None:
        cont &= region[1:] == region[:-1]
    if not cont.any():
        return src, dst, lens
    starts = np.concatenate(([True], ~cont))
    group = np.cumsum(starts) - 1
    new_lens = np.bincount(group, weights=lens).astype(np.int64)
    return src[starts], dst[starts], new_lens
