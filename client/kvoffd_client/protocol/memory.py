"""REGISTER's description of an engine's KV memory: how the daemon reaches the bytes (``memory``:
:class:`CpuFd`, :class:`CudaIpc` or :class:`CudaVmm`, told apart by ``kind``) and where each block
lives in them (:class:`Layout`, its ``kv_events`` included)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Annotated, Any, ClassVar, Literal, Union

import msgspec
from msgspec import Meta

from kvoffd_client.protocol.codes import ErrorCode, ProtocolError
from kvoffd_client.protocol.limits import (
    MAX_BLOCK_TOKENS,
    MAX_EVENTS,
    MAX_NAME,
    MAX_VMM_PIECES,
    U63,
    IpcHandle,
    SegmentLength,
)


@dataclass(slots=True)
class Segment:
    """One run of bytes per block: block b occupies [offset + b*stride, +length) in the region."""

    offset: int
    stride: int
    length: int


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
    """One physical allocation (``cuMemCreate``) behind a VMM-mapped KV range: where it starts in the range
    and how long it is. Its descriptor is the one at the same position in the batch the token names."""

    offset: U63
    size: Annotated[int, Meta(ge=1, le=(1 << 63) - 1)]


class CudaVmm(msgspec.Struct, tag_field="kind", tag="cuda_vmm", kw_only=True):
    """KV memory made with CUDA's virtual memory API (no legacy IPC handle): the physical pieces that
    back one contiguous range, in order and without gaps, from offset 0 (the daemon maps them the same
    way in one VA reservation); the KV region is ``[offset, +size)`` of that range (docs/cuda.md).
    ``token``: the fd-socket batch that holds the pieces' descriptors, one per piece, in the same order
    (kvoffd_client.fdpass.send_fds)."""

    KIND: ClassVar[str] = "cuda_vmm"
    token: Annotated[str, Meta(min_length=1, max_length=64)]
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


Memory = Union[CpuFd, CudaIpc, CudaVmm]  # noqa: UP007 - msgspec's tagged union (the tag is ``kind``)


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



def parse_layout(layout: dict[str, Any] | Layout) -> tuple[int, list[Segment]]:
    """A layout map (as ``describe_layout`` gives it) checked as REGISTER checks it: (num_blocks,
    segments). For tools and benches that attach a backend without the daemon."""
    if not isinstance(layout, Layout):
        try:
            layout = msgspec.convert(layout, Layout)
        except msgspec.ValidationError as e:
            raise ProtocolError(ErrorCode.BAD_FIELD, f"layout: {e}") from None
    return layout.num_blocks, layout.runs()
