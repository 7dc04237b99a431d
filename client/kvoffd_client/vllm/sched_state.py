"""What the scheduler half keeps per request and per planned store (kvoffd_client.vllm.scheduler)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm.v1.request import Request


@dataclass
class PendingLookup:
    """A lookup in flight or answered. Hits count from block ``start``."""

    seq: int
    start: int
    sent_at: float
    prefetch: bool = False  # sent at arrival: counts against max_prefetch until used or dropped
    hits: int = -1  # -1: no answer yet
    lease_id: int = 0
    answered_at: float = 0.0


@dataclass
class RequestState:
    request: Request
    keys: list[bytes] = field(default_factory=list)  # folded keys of the full blocks, computed lazily
    last_hash: Any = None  # the block hash the last key was folded from (detects a rewritten tail)
    packed: bytearray = field(default_factory=bytearray)  # the same keys back to back (what LOOKUP sends)
    lookup: PendingLookup | None = None
    offer_start: int = 0  # block where the last offered hit starts
    offer_sync: bool = False  # the last offered hit is to be loaded within its step
    # Same-step loads some worker's daemon may still write (job -> workers known settled). While any
    # is listed, the request's stores wait (they could read blocks computed on a failed load) and a
    # finish holds the blocks.
    sync_jobs: dict[int, int] = field(default_factory=dict)
    load_job: int = 0  # load in flight (0: none)
    load_keys: list[bytes] = field(default_factory=list)
    no_external: bool = False  # a load for this request failed: recompute, never offer again
    next_store: int = 0  # first block not yet planned for a store
    store_jobs: set[int] = field(default_factory=set)  # planned store jobs not yet known finished
    # Several KV-cache groups: the daemon keys, block-major (block i, group g at i*G + g), and the last
    # block key they were derived from (to notice a rewritten hash list).
    gkeys: list[bytes] = field(default_factory=list)
    gpacked: bytearray = field(default_factory=bytearray)
    gsource: bytes = b""
    # Sliding-window blocks read by store jobs not yet acknowledged: (job, group, block index, block id).
    # vLLM frees such a block once it leaves the window; the job is then fenced before it is rewritten.
    window_reads: list[tuple[int, int, int, int]] = field(default_factory=list)


@dataclass
class PlannedStore:
    keys: list[bytes]
    req_ids: list[str]
    done: int = 0
    failed: int = 0
