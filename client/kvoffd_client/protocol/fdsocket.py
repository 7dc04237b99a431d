"""The fd socket's messages: how an engine hands the daemon a batch of descriptors under one token.

Why a batch: VMM memory (``cuda_vmm``) is one POSIX descriptor per physical allocation, and PyTorch's
expandable segments make an allocation of 20 MiB, so a real KV cache is thousands of descriptors. One
token per descriptor would make REGISTER carry thousands of tokens and the daemon keep thousands of
entries; one token naming the ordered list keeps REGISTER small and makes the batch live or die as one.

The exchange, on one SOCK_SEQPACKET connection (docs/protocol.md, "The fd socket"):

  1. client → :class:`FdBatch` ``{"v": 1, "count": N}``, no descriptor: the daemon checks N against its
     bounds *before* any descriptor reaches it (a refusal costs it none).
  2. daemon → :class:`FdReply` ``{"ready": N}``, or ``{"error", "message"}`` and closes.
  3. client → :class:`FdChunk` ``{"sizes": [...]}`` with exactly ``len(sizes)`` descriptors
     (1 … MAX_FDS_PER_MESSAGE), repeated until N have been sent, in order.
  4. daemon → ``{"token": "<32 hex>"}``, or ``{"error", "message"}``; then it closes.

``cpu_fd`` memory is a batch of one. Standard library and msgspec only (imported in vLLM's processes).
"""

from __future__ import annotations

from typing import Annotated

import msgspec
from msgspec import Meta

from kvoffd_client.protocol.limits import MAX_FDS_PER_MESSAGE, MAX_VMM_PIECES

#: The fd socket's own version (``v`` of FdBatch); an unknown one is refused with ``version_mismatch``.
FD_SOCKET_VERSION = 1
#: Most descriptors one batch (one token) may carry: as many as a ``cuda_vmm`` REGISTER may name.
MAX_BATCH_FDS = MAX_VMM_PIECES

Size = Annotated[int, Meta(ge=1, le=(1 << 63) - 1)]


class FdBatch(msgspec.Struct, kw_only=True):
    """Step 1: how many descriptors follow (all of them: one token names the list)."""

    v: int
    count: Annotated[int, Meta(ge=1, le=MAX_BATCH_FDS)]


class FdChunk(msgspec.Struct, kw_only=True):
    """Step 3: the bytes each descriptor of this message holds, one size per descriptor, in order."""

    sizes: Annotated[list[Size], Meta(min_length=1, max_length=MAX_FDS_PER_MESSAGE)]


class FdReply(msgspec.Struct, kw_only=True, omit_defaults=True):
    """Every daemon message: exactly one of ``ready`` (step 2), ``token`` (step 4) or ``error`` (with
    ``message``: a refusal, after which the daemon closes the connection)."""

    ready: int = 0
    token: str = ""
    error: str = ""
    message: str = ""
