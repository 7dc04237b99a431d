"""What the scheduler half keeps (kvoffd_client.vllm.scheduler): ``SchedulerState``, the one place the
state its planners share is declared (settings, the client, the requests, the jobs planned, the keys
the daemon confirmed), and what it keeps per request, per lookup and per planned store.

The planners (``sched_lookup``, ``sched_load``, ``sched_store``) each take this state; the rules that
keep it consistent across them (a request's keys, dropping a lookup) are its methods.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvoffd_client import protocol as P
from kvoffd_client.vllm.events import kv_events_layout
from kvoffd_client.vllm.groups import GroupKind, group_key
from kvoffd_client.vllm.identity import CacheIdentity, fold_key
from kvoffd_client.vllm.metadata import LoadSpec
from kvoffd_client.vllm.settings import Settings
from kvoffd_client.vllm.stats import KvoffdStats
from kvoffd_client.vllm.syncload import SyncLoadBudget

if TYPE_CHECKING:
    from vllm.v1.request import Request

    from kvoffd_client.client import KvoffdClient

#: ~8 MiB of confirmed keys
MAX_KNOWN = 1 << 17


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


class KnownKeys:
    """What the daemon recently confirmed holding (a lookup hit or an acknowledged store), so a block
    vLLM found in its own prefix cache is not sent again, and what recently failed to load (negative:
    a miss until it expires or is stored again). Confirmations age out (the daemon evicts too) and are
    dropped when the daemon restarts or is out of reach (``distrust``)."""

    def __init__(self, known_ttl_s: float):
        self.known_ttl_s = known_ttl_s
        self.known: OrderedDict[bytes, float] = OrderedDict()
        self.daemon: str | None = None  # the daemon the confirmations came from
        self.negative: dict[bytes, float] = {}  # key -> until when it is a miss

    def confirm(self, keys: list[bytes], now: float) -> None:
        known = self.known
        for k in keys:
            known[k] = now
            known.move_to_end(k)
        while len(known) > MAX_KNOWN:
            known.popitem(last=False)

    def is_known(self, key: bytes, now: float) -> bool:
        t = self.known.get(key)
        return t is not None and now - t < self.known_ttl_s

    def is_negative(self, key: bytes, now: float) -> bool:
        exp = self.negative.get(key)
        if exp is None:
            return False
        if exp <= now:
            del self.negative[key]
            return False
        return True

    def failed(self, bad: list[bytes], until: float) -> None:
        """A load failed from ``bad[0]`` on: that key is a miss until ``until``; none of them is known."""
        if bad:
            self.negative[bad[0]] = until
        for k in bad:
            self.known.pop(k, None)

    def stored(self, keys: list[bytes], now: float) -> None:
        """Stored on every worker: confirmed, and loadable again."""
        self.confirm(keys, now)
        if self.negative:
            for k in keys:
                self.negative.pop(k, None)

    def distrust(self, linked: bool, daemon_id: str | None) -> None:
        """A restarted daemon holds nothing, and one out of reach may come back restarted: what it
        confirmed is not to be trusted. (The scheduler's client may learn of a restart after the
        worker's client has already registered with the new daemon.)"""
        if not linked or daemon_id != self.daemon:
            if self.known:
                self.known.clear()
            self.daemon = daemon_id

    def clear(self) -> None:
        self.negative.clear()
        self.known.clear()


class SchedulerState:
    """The scheduler half's state, shared by its planners. ``client`` is None while offload is off
    (no identity) or once shut down; ``identity`` None: the connector passes everything through."""

    def __init__(self, settings: Settings, identity: CacheIdentity | None, world_size: int, *,
                 block_bytes: int = 0, device: str = "cpu"):
        self.s = settings
        self.identity = identity
        self.enabled = identity is not None
        self.world_size = world_size
        self.client: KvoffdClient | None = None
        self.stats = KvoffdStats()
        self.reqs: dict[str, RequestState] = {}
        self.store_jobs: dict[int, PlannedStore] = {}  # planned store jobs, until every worker answered
        self.pending_loads: list[LoadSpec] = []  # planned since the last build_connector_meta
        self.await_stores: list[str] = []  # finished requests whose blocks wait for their stores
        self.fence_jobs: set[int] = set()  # store jobs reading window blocks vLLM freed: fenced next step
        groups = identity.groups if identity is not None else ()
        self.ngroups = max(1, len(groups))
        self.window_groups = tuple(g.index for g in groups if g.kind is GroupKind.SLIDING)
        self.sync_budget = SyncLoadBudget.from_settings(settings, block_bytes, device, single_group=self.ngroups == 1)
        self.sync_owner: dict[int, str] = {}  # same-step load job -> request id, until settled
        self.known = KnownKeys(settings.known_ttl_s)
        # keys are block hashes: a daemon that publishes KV events is sent each stored block's tokens
        self.describable = identity is not None and bool(kv_events_layout(identity))
        self.orphans: dict[int, float] = {}  # lookups abandoned in flight: seq -> give-up time
        self.prefetched = 0  # lookups sent at arrival and not yet used or dropped
        # Requests vLLM scheduled in the last step and has not finished since: while none is, a
        # request that waits for its lookup's reply would leave the engine an empty step.
        self.running: set[str] = set()
        self.wait_left_s = settings.lookup_wait_ms / 1000  # of the idle wait for replies, this step
        self._job_ids = iter(range(1, 1 << 62))

    @property
    def block_size(self) -> int:
        assert self.identity is not None
        return self.identity.block_size

    def new_step(self, scheduled: dict[str, int]) -> None:
        """A step's schedule is complete: its requests are the ones running; the idle wait is fresh."""
        self.running = set(scheduled)
        self.wait_left_s = self.s.lookup_wait_ms / 1000

    def idle_except(self, req_id: str) -> bool:
        """Whether the step being scheduled would run nothing but ``req_id`` (as far as this half
        knows: vLLM may still schedule another waiting request after it)."""
        return not self.running or self.running == {req_id}

    def next_job(self) -> int:
        return next(self._job_ids)

    def request(self, request: Request) -> RequestState:
        st = self.reqs.get(request.request_id)
        if st is None:
            st = self.reqs[request.request_id] = RequestState(request)
        return st

    def keys(self, st: RequestState) -> list[bytes]:
        """Keys of the request's full blocks (the last hash of each block; hashes chain the prefix)."""
        hashes = st.request.block_hashes
        per = self.identity.hashes_per_block if self.identity else 1
        n = len(hashes) // per
        if st.keys and (n < len(st.keys) or hashes[len(st.keys) * per - 1] != st.last_hash):
            self._rewind(st, n, per)
        while len(st.keys) < n:
            key = fold_key(bytes(hashes[(len(st.keys) + 1) * per - 1]))
            st.keys.append(key)
            st.packed += key
        if st.keys:
            st.last_hash = hashes[len(st.keys) * per - 1]
        return st.keys

    def _rewind(self, st: RequestState, n: int, per: int) -> None:
        """The hash list shrank or its tail changed under the same request id (a streaming-input session
        resumed: vLLM drops the hashes past the computed tokens and regrows them from the new input).
        Keep the keys that still match (hashes chain, so the last match vouches for all before it),
        drop the rest, and plan stores again from there: a stale key would file new bytes under it."""
        hashes = st.request.block_hashes
        keep = min(len(st.keys), n)
        while keep and fold_key(bytes(hashes[keep * per - 1])) != st.keys[keep - 1]:
            keep -= 1
        del st.keys[keep:]
        del st.packed[keep * P.KEY_SIZE:]
        st.next_store = min(st.next_store, keep)
        self.drop_lookup(st)  # it asked about keys that may be gone

    def daemon_keys(self, st: RequestState) -> tuple[list[bytes], bytearray]:
        """The daemon keys of the request's full blocks, all groups, block-major (``keys`` for one group)."""
        keys = self.keys(st)
        if self.ngroups == 1:
            return keys, st.packed
        G = self.ngroups
        have = len(st.gkeys) // G
        if have > len(keys) or (have and st.gsource != keys[have - 1]):
            st.gkeys, st.gpacked, have = [], bytearray(), 0  # the hash list was rewritten: derive again
        for i in range(have, len(keys)):
            for g in range(G):
                k = group_key(keys[i], g)
                st.gkeys.append(k)
                st.gpacked += k
        if keys:
            st.gsource = keys[-1]
        return st.gkeys, st.gpacked

    def drop_lookup(self, st: RequestState, *, release: bool = True) -> None:
        """Forget the request's lookup: its lease is released (once its reply is in, if still in flight)."""
        lk, st.lookup = st.lookup, None
        if lk is None or self.client is None:
            return
        self.unprefetch(lk)
        if lk.hits < 0:  # still in flight: its lease (if any) is released when the reply lands
            self.orphans[lk.seq] = time.monotonic() + self.s.lookup_timeout_ms / 1000
        elif lk.lease_id and release:
            self.client.release(lk.lease_id)
            self.stats.add("leases_released")

    def unprefetch(self, lk: PendingLookup) -> None:
        if lk.prefetch:
            lk.prefetch = False
            self.prefetched -= 1
