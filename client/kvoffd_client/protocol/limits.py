"""The protocol's bounds, and the field types (msgspec ``Annotated`` types) that carry them into every
message, so one C call checks them while it decodes (docs/security.md lists them for operators)."""

from __future__ import annotations

from typing import Annotated

from msgspec import Meta

#: v2: STORE's and LOAD's ``ready_event`` (was ``event``), EXPLAIN's ``held`` (was ``pinned``); docs/protocol.md.
PROTOCOL_VERSION = 2
#: Every block key is exactly this many bytes (vLLM's sha256 block hashes are; others are folded).
KEY_SIZE = 32
#: Largest frame the daemon reads. A step of a big batch (8k blocks) stays far below it.
MAX_FRAME_BYTES = 8 << 20
#: The most bytes of one fd-socket message (a small msgpack map: a chunk's sizes at most; docs/protocol.md,
#: the fd socket).
MAX_FD_MESSAGE = 2048
#: Descriptors one fd-socket message may carry (SCM_RIGHTS); a batch of more comes in several messages.
#: The kernel's own cap is 253 (SCM_MAX_FD); 128 keeps one chunk's ``sizes`` far below MAX_FD_MESSAGE.
MAX_FDS_PER_MESSAGE = 128
#: Most keys (and block ids) one message may carry.
MAX_KEYS = 65536
#: Longest namespace / engine id / free-text field.
MAX_NAME = 256

#: Parts one STORE or LOAD may be cut into (``cuts``): a group of layers each, so one per layer of the
#: deepest models with room to spare.
MAX_PARTS = 256

#: IPC events one CUDA engine may share (its ring of "writes done" markers)
MAX_EVENTS = 4096
#: Memory kinds REGISTER may name (the daemon says which it serves in HELLO_OK: ``memory:<kind>``).
MEMORY_KINDS = ("cpu_fd", "cuda_ipc", "cuda_vmm")
#: Physical allocations one ``cuda_vmm`` REGISTER may name, and descriptors one fd-socket batch may carry
#: (all of them under one token): 16,384 of PyTorch's 20 MiB expandable segments are a 320 GiB KV cache
#: (docs/cuda.md, "VMM memory", limits).
MAX_VMM_PIECES = 16384

#: Most tokens one block may hold (``KvEventsLayout.block_size``).
MAX_BLOCK_TOKENS = 1 << 20

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
IpcHandle = Annotated[bytes, Meta(min_length=64, max_length=64)]  # cudaIpcMemHandle_t / cudaIpcEventHandle_t
SegmentLength = Annotated[int, Meta(ge=1, le=1 << 40)]
