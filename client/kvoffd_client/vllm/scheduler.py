"""Scheduler half of KvoffdConnector (EngineCore process): lookups, leases, load and store planning.

The engine loop calls in here every step, so nothing here waits on the daemon: a lookup is sent and
answered "not yet" (``(None, False)``) until its reply is in; an unreachable daemon is a miss.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvoffd_client import protocol as P
from kvoffd_client.client import DaemonUnavailable, KvoffdClient, KvoffdError
from kvoffd_client.vllm.common import (
    KvoffdMetadata,
    KvoffdStats,
    KvoffdWorkerMeta,
    LoadSpec,
    Settings,
    log,
)
from kvoffd_client.vllm.events import NO_PARENT, block_tokens, kv_events_layout
from kvoffd_client.vllm.groups import NULL_BLOCK_ID, GroupKind, group_key
from kvoffd_client.vllm.identity import CacheIdentity, fold_key
from kvoffd_client.vllm.syncload import SyncLoadBudget

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


@dataclass
class _Lookup:
    """A lookup in flight or answered. Hits count from block ``start``."""

    seq: int
    start: int
    sent_at: float
    prefetch: bool = False  # sent at arrival: counts against max_prefetch until used or dropped
    hits: int = -1  # -1: no answer yet
    lease_id: int = 0
    answered_at: float = 0.0


@dataclass
class _Req:
    request: Request
    keys: list[bytes] = field(default_factory=list)  # folded keys of the full blocks, computed lazily
    last_hash: Any = None  # the block hash the last key was folded from (detects a rewritten tail)
    packed: bytearray = field(default_factory=bytearray)  # the same keys back to back (what LOOKUP sends)
    lookup: _Lookup | None = None
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
class _StoreJob:
    keys: list[bytes]
    req_ids: list[str]
    done: int = 0
    failed: int = 0


_MAX_KNOWN = 1 << 17  # ~8 MiB of confirmed keys


class KvoffdScheduler:
    def __init__(self, settings: Settings, identity: CacheIdentity | None, world_size: int, engine_id: str,
                 *, block_bytes: int = 0, device: str = "cpu"):
        self.s = settings
        self.identity = identity
        self.enabled = identity is not None
        self.world_size = world_size
        self.stats = KvoffdStats()
        self._reqs: dict[str, _Req] = {}
        self._store_jobs: dict[int, _StoreJob] = {}
        self._pending_loads: list[LoadSpec] = []
        self._await_stores: list[str] = []
        self._fence_jobs: set[int] = set()
        groups = identity.groups if identity is not None else ()
        self._ngroups = max(1, len(groups))
        self._window_groups = tuple(g.index for g in groups if g.kind is GroupKind.SLIDING)
        self.sync_budget = SyncLoadBudget.from_settings(settings, block_bytes, device, single_group=self._ngroups == 1)
        self._sync_owner: dict[int, str] = {}  # same-step load job -> request id, until settled
        self._negative: dict[bytes, float] = {}
        # Keys the daemon recently confirmed holding (a lookup hit or an acknowledged store), so a block
        # vLLM found in its own prefix cache is not sent again. Entries age out (the daemon evicts too)
        # and are dropped when the daemon restarts.
        self._known: OrderedDict[bytes, float] = OrderedDict()
        self._known_daemon: str | None = None
        # keys are block hashes: a daemon that publishes KV events is sent each stored block's tokens
        self._describable = identity is not None and bool(kv_events_layout(identity))
        self._orphans: dict[int, float] = {}  # lookups abandoned in flight: seq -> give-up time
        self._prefetched = 0
        self._job_ids = iter(range(1, 1 << 62))
        self.client: KvoffdClient | None = None
        if self.enabled:
            self.client = KvoffdClient(settings.address, name=f"vllm-scheduler:{engine_id}",
                                       timeout_s=max(settings.connect_timeout_s, 0.1),
                                       job_deadline_s=settings.job_timeout_s)
            if not self.client.connect(settings.connect_timeout_s):
                log.warning("kvoffd: no daemon answering at %s; vLLM serves without offload and the "
                            "connector connects when the daemon appears", settings.address)

    # --------------------------------------------------------------------------------------------
    # helpers

    @property
    def block_size(self) -> int:
        assert self.identity is not None
        return self.identity.block_size

    def _state(self, request: Request) -> _Req:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = _Req(request)
        return st

    def _keys(self, st: _Req) -> list[bytes]:
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

    def _rewind(self, st: _Req, n: int, per: int) -> None:
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
        self._drop_lookup(st)  # it asked about keys that may be gone

    def _daemon_keys(self, st: _Req) -> tuple[list[bytes], bytearray]:
        """The daemon keys of the request's full blocks, all groups, block-major (``_keys`` for one group)."""
        keys = self._keys(st)
        if self._ngroups == 1:
            return keys, st.packed
        G = self._ngroups
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

    def _is_negative(self, key: bytes, now: float) -> bool:
        exp = self._negative.get(key)
        if exp is None:
            return False
        if exp <= now:
            del self._negative[key]
            return False
        return True

    def _confirm(self, keys: list[bytes], now: float) -> None:
        known = self._known
        for k in keys:
            known[k] = now
            known.move_to_end(k)
        while len(known) > _MAX_KNOWN:
            known.popitem(last=False)

    def _is_known(self, key: bytes, now: float) -> bool:
        t = self._known.get(key)
        return t is not None and now - t < self.s.known_ttl_s

    def _drop_lookup(self, st: _Req, *, release: bool = True) -> None:
        lk, st.lookup = st.lookup, None
        if lk is None or self.client is None:
            return
        self._unprefetch(lk)
        if lk.hits < 0:  # still in flight: its lease (if any) is released when the reply lands
            self._orphans[lk.seq] = time.monotonic() + self.s.lookup_timeout_ms / 1000
        elif lk.lease_id and release:
            self.client.release(lk.lease_id)
            self.stats.add("leases_released")

    def _unprefetch(self, lk: _Lookup) -> None:
        if lk.prefetch:
            lk.prefetch = False
            self._prefetched -= 1

    def _reap_orphans(self) -> None:
        if not self._orphans or self.client is None:
            return
        now = time.monotonic()
        for seq, give_up in list(self._orphans.items()):
            reply = self.client.take_reply(seq)
            if isinstance(reply, P.LookupResult) and reply.lease_id:
                self.client.release(reply.lease_id)
                self.stats.add("leases_released")
            if reply is not None or now > give_up:
                if reply is None:
                    self.client.forget(seq)
                del self._orphans[seq]

    def _log_miss(self, st: _Req, first: int, end: int) -> None:
        """At DEBUG, name a lookup's missed keys so an operator can ask the daemon why
        (``kvoffctl explain``, docs/operations.md): the first key that missed and the last key asked,
        in hex. Only called with debug logging on: no hex work on the scheduler's step otherwise."""
        keys = self._daemon_keys(st)[0]
        if first >= min(end, len(keys)) or self.identity is None:
            return
        ns, a, b = self.identity.namespace, keys[first].hex(), keys[min(end, len(keys)) - 1].hex()
        log.debug("kvoffd: request %s missed %d of its lookup's keys; first missed key %s, last key %s "
                  "(kvoffctl explain --namespace %s %s %s)", st.request.request_id,
                  min(end, len(keys)) - first, a, b, ns, a, b)

    def _send_lookup(self, st: _Req, start: int, limit: int, now: float, prefetch: bool = False) -> bool:
        assert self.client is not None and self.identity is not None
        keys, all_packed = self._daemon_keys(st)
        G = self._ngroups
        end = min(limit, len(keys) // G)
        if self._negative:  # usually empty: then no per-key work here at all
            for i in range(start * G, end * G):
                if self._is_negative(keys[i], now):
                    end = i // G
                    break
        if end <= start:
            return False
        # one slice of the packed keys: no join of a long prompt's keys on the scheduler's step. With
        # several groups the daemon's "leading hits" counts keys, so whole blocks are hits // G.
        packed = bytes(memoryview(all_packed)[start * G * P.KEY_SIZE:end * G * P.KEY_SIZE])
        seq = self.client.send_lookup(self.identity.namespace, packed, self.s.lease_ms)
        if seq is None:
            return False
        st.lookup = _Lookup(seq=seq, start=start, sent_at=now, prefetch=prefetch)
        self._prefetched += prefetch
        self.stats.add("lookups")
        return True

    # --------------------------------------------------------------------------------------------
    # vLLM hooks

    def on_new_request(self, request: Request) -> None:
        st = self._state(request)
        if not (self.enabled and self.s.prefetch_lookups) or self.client is None:
            return
        if self._prefetched >= self.s.max_prefetch or not self.client.connected:
            return
        limit = min((request.num_tokens - 1) // self.block_size, len(self._keys(st)))
        if limit > 0:
            self._send_lookup(st, 0, limit, time.monotonic(), prefetch=True)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        if not self.enabled or self.client is None:
            return 0, False
        st = self._state(request)
        if st.no_external:
            return 0, False
        bs = self.block_size
        start = num_computed_tokens // bs
        # Whole blocks only, and never the block holding the last prompt token: vLLM must compute
        # at least one token itself to sample from.
        limit = min((request.num_tokens - 1) // bs, len(self._keys(st)))
        if limit <= start:
            self._drop_lookup(st)
            return 0, False
        now = time.monotonic()
        lk = st.lookup
        if lk is not None and lk.hits >= 0:
            stale = (now - lk.answered_at) * 1000 > 0.8 * self.s.lease_ms
            if lk.start > start or stale:
                self._drop_lookup(st)
                lk = None
        if lk is None:
            if not self.client.connected:
                self.client.take_notices()  # drives reconnection
                return 0, False
            if not self._send_lookup(st, start, limit, now):
                return 0, False
            lk = st.lookup
            assert lk is not None
        if lk.hits < 0:
            reply = self.client.take_reply(lk.seq)
            if reply is None:
                if (now - lk.sent_at) * 1000 > self.s.lookup_timeout_ms:
                    self.stats.add("lookup_timeouts")
                    self._drop_lookup(st)
                    return 0, False
                return None, False  # ask again next step
            if not isinstance(reply, P.LookupResult):
                self._unprefetch(lk)
                st.lookup = None
                return 0, False
            G = self._ngroups
            lk.hits, lk.lease_id, lk.answered_at = reply.hits // G, reply.lease_id, now
            self._confirm(self._daemon_keys(st)[0][lk.start * G:lk.start * G + reply.hits], now)
            self.stats.add("lookup_miss_blocks", max(0, limit - start - reply.hits))
            if log.isEnabledFor(logging.DEBUG):
                self._log_miss(st, lk.start * G + reply.hits, limit * G)
        n = max(0, min(lk.start + lk.hits, limit) - start)
        if n == 0:
            self._drop_lookup(st)
            return 0, False
        st.offer_start = start
        st.offer_sync = self.sync_budget.take(n, now)
        return n * bs, not st.offer_sync

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        if num_external_tokens <= 0 or not self.enabled:
            self._drop_lookup(st)
            return
        lk = st.lookup
        n = num_external_tokens // self.block_size
        if lk is None or lk.hits < 0 or n <= 0:  # cannot happen: we only offer answered lookups
            log.error("kvoffd: vLLM allocated %d external tokens for %s without an answered lookup",
                      num_external_tokens, request.request_id)
            return
        start = st.offer_start
        keys, block_ids = self._load_plan(st, blocks.get_block_ids(), start, n)
        job = next(self._job_ids)
        self._pending_loads.append(LoadSpec(request.request_id, job, keys, block_ids, lk.lease_id, sync=st.offer_sync))
        self._unprefetch(lk)
        st.lookup = None  # the LOAD consumes the lease
        st.load_keys = keys
        if st.offer_sync:  # vLLM runs the request in this step: no finished_recving will come
            st.sync_jobs[job] = 0
            self._sync_owner[job] = request.request_id
            self.stats.add("sync_offers")
        else:
            st.load_job = job
        st.next_store = start + n
        self.stats.add("lookup_hit_blocks", n)

    def _load_plan(self, st: _Req, tables: tuple[list[int], ...], start: int, n: int
                   ) -> tuple[list[bytes], list[int]]:
        """Blocks ``start..start+n`` of every group, except those vLLM keeps as the null block (a sliding
        window's blocks before the window: nothing reads them, so nothing is loaded there)."""
        G = self._ngroups
        all_keys = self._daemon_keys(st)[0]
        keys: list[bytes] = []
        block_ids: list[int] = []
        for i in range(start, start + n):
            for g in range(G):
                b = tables[g][i]
                if b != NULL_BLOCK_ID:
                    keys.append(all_keys[i * G + g])
                    block_ids.append(b)
        return keys, block_ids

    def _windows_left(self, st: _Req, tables: tuple[list[int], ...] | None) -> None:
        """Fence the store jobs still reading sliding-window blocks that vLLM has freed since (``tables``
        None: the request is gone, all of its blocks are free)."""
        live: list[tuple[int, int, int, int]] = []
        for job, g, i, b in st.window_reads:
            if job not in self._store_jobs:
                continue  # acknowledged by every worker: nothing reads the block any more
            if tables is None or i >= len(tables[g]) or tables[g][i] != b:
                self._fence_jobs.add(job)
            else:
                live.append((job, g, i, b))
        st.window_reads = live

    def build_connector_meta(self, so: SchedulerOutput) -> KvoffdMetadata:
        meta = KvoffdMetadata(loads=self._pending_loads, await_stores=self._await_stores,
                              preempted=sorted(so.preempted_req_ids or ()))
        self._pending_loads, self._await_stores = [], []
        self.sync_budget.new_step()  # this step's schedule is complete
        block_state = so.kv_connector_block_state
        if self._window_groups:
            # vLLM frees out-of-window blocks while scheduling this step, before this call.
            for req_id in so.num_scheduled_tokens:
                st = self._reqs.get(req_id)
                if st is not None and st.window_reads:
                    self._windows_left(st, block_state.get_block_ids(req_id) if block_state is not None else None)
        if self._fence_jobs:
            meta.fence_jobs, self._fence_jobs = sorted(self._fence_jobs), set()
        self._reap_orphans()
        linked = self.client is not None and self.client.connected
        if self.client is not None and not linked:
            self.client.take_notices()  # drives reconnection while the engine steps
        if not self.enabled:
            return meta
        bs = self.block_size
        now = time.monotonic()
        if self.client is not None and (not linked or self.client.daemon_id != self._known_daemon):
            # A restarted daemon holds nothing, and one out of reach may come back restarted: what it
            # confirmed is not to be trusted. (This client may learn of a restart after the worker's
            # client has already registered with the new daemon.)
            if self._known:
                self._known.clear()
            self._known_daemon = self.client.daemon_id
        fresh = {r.req_id for r in so.scheduled_new_reqs}
        fresh.update(getattr(so.scheduled_cached_reqs, "resumed_req_ids", None) or ())
        new_ids = {r.req_id: r.block_ids for r in so.scheduled_new_reqs}
        job = 0
        keys: list[bytes] = []
        block_ids: list[int] = []
        req_ids: list[str] = []
        seen: set[bytes] = set()
        hello = self.client.hello if self.client is not None else None
        describe = self._describable and "kv_events" in (getattr(hello, "capabilities", None) or ())
        tokens, parents = bytearray(), bytearray()
        for req_id, n_sched in so.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None or n_sched <= 0 or st.sync_jobs:
                continue
            req = st.request
            if req_id in fresh:
                # Re-offer the whole prefix: blocks vLLM found in its own cache may be missing from the
                # daemon (it restarted, evicted them, or was absent when they were computed). Those
                # the daemon recently confirmed are skipped below.
                st.next_store = 0
            # Tokens whose KV exists once this step's forward ran (spec-decode drafts excluded).
            end = min(req.num_computed_tokens + n_sched, req.num_tokens)
            if not self.s.store_decode:
                end = min(end, req.num_prompt_tokens)
            all_keys, _ = self._daemon_keys(st)
            G = self._ngroups
            n_full = min(end // bs, len(all_keys) // G)
            if n_full <= st.next_store:
                continue
            table = block_state.get_block_ids(req_id) if block_state is not None else new_ids.get(req_id)
            if not table:
                continue
            n_full = min(n_full, *(len(t) for t in table[:G]))
            added = False
            for i in range(st.next_store, n_full):
                for g in range(G):
                    b = table[g][i]
                    k = all_keys[i * G + g]
                    # A null block is a sliding window's block vLLM already freed: its bytes are gone.
                    if b == NULL_BLOCK_ID or k in seen or self._is_known(k, now):
                        continue
                    seen.add(k)
                    keys.append(k)
                    block_ids.append(b)
                    if describe:
                        tokens += block_tokens(req.all_token_ids, i * bs, bs)
                        parents += all_keys[i - 1] if i else NO_PARENT
                    added = True
                    if g in self._window_groups:
                        if not job:
                            job = next(self._job_ids)
                        st.window_reads.append((job, g, i, b))
            st.next_store = n_full
            if added:
                req_ids.append(req_id)
        if keys:
            job = job or next(self._job_ids)
            meta.store_job_id, meta.store_keys, meta.store_block_ids, meta.store_req_ids = job, keys, block_ids, req_ids
            if describe:
                meta.store_tokens, meta.store_parents = bytes(tokens), bytes(parents)
            self._store_jobs[job] = _StoreJob(keys, req_ids)
            for r in req_ids:
                self._reqs[r].store_jobs.add(job)
        return meta

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        wm = out.kv_connector_worker_meta
        if isinstance(wm, KvoffdWorkerMeta):
            self._sync_results(wm)
            for job_id, n in wm.stores_failed.items():
                if job_id in self._store_jobs:
                    self._store_jobs[job_id].failed += n
            for job_id, n in wm.stores_done.items():
                job = self._store_jobs.get(job_id)
                if job is None:
                    continue
                job.done += n
                if job.done < self.world_size:
                    continue
                del self._store_jobs[job_id]
                for r in job.req_ids:
                    st = self._reqs.get(r)
                    if st is not None:
                        st.store_jobs.discard(job_id)
                if not job.failed:
                    self._confirm(job.keys, time.monotonic())
                    if self._negative:
                        for k in job.keys:  # stored again: loadable again
                            self._negative.pop(k, None)
        failed = out.failed_recving or set()
        n_failed = 0
        for req_id in out.finished_recving or ():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            if req_id in failed:
                self._load_failed(st, wm.load_failed_at.get(req_id, 0) if isinstance(wm, KvoffdWorkerMeta) else 0)
                n_failed += 1
                log.debug("kvoffd: loading %d blocks for request %s failed", len(st.load_keys), req_id)
            st.load_job, st.load_keys = 0, []
        if n_failed:  # one line per step, not per request: a daemon death fails hundreds at once
            log.warning("kvoffd: %d load(s) failed this step; vLLM recomputes those blocks", n_failed)
        for req_id in out.finished_sending or ():
            self._reqs.pop(req_id, None)

    def _load_failed(self, st: _Req, at: int) -> None:
        """A load failed from its block ``at``: those keys are misses for a while (vLLM may ask again
        from zero), and the request is never offered a hit again."""
        bad = st.load_keys[min(at, max(len(st.load_keys) - 1, 0)):]
        if bad:
            self._negative[bad[0]] = time.monotonic() + self.s.negative_ttl_s
        for k in bad:
            self._known.pop(k, None)
        st.no_external = True
        st.next_store = 0

    def _sync_results(self, wm: KvoffdWorkerMeta) -> None:
        """Same-step loads: the measured link speed, failures, and loads settled on every worker."""
        self.sync_budget.observe(wm.sync_bytes, wm.sync_us, wm.sync_timeouts, time.monotonic())
        failed = 0
        for req_id, at in wm.load_failed_at.items():
            st = self._reqs.get(req_id)
            if st is not None and st.sync_jobs and not st.load_job:
                self._load_failed(st, at)
                failed += 1
        if failed:
            log.warning("kvoffd: %d same-step load(s) failed this step; vLLM recomputes those blocks", failed)
        for job, n in wm.sync_settled.items():
            req_id = self._sync_owner.get(job)
            st = self._reqs.get(req_id) if req_id is not None else None
            if st is None or job not in st.sync_jobs:
                self._sync_owner.pop(job, None)
                continue
            st.sync_jobs[job] += n
            if st.sync_jobs[job] >= self.world_size:
                del st.sync_jobs[job], self._sync_owner[job]
                if not st.sync_jobs:
                    st.load_keys = []
                    st.next_store = 0  # stores resume, from the start (what the daemon holds is skipped)

    def request_finished(self, request: Request, block_ids: list[int] | tuple[list[int], ...]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """``block_ids``: the blocks vLLM frees unless we hold them (one list, or one per group with HMA)."""
        st = self._reqs.get(request.request_id)
        if st is None:
            return False, None
        self._drop_lookup(st)
        if st.window_reads:
            # vLLM already freed the blocks that left the window; the ones still listed are held below.
            tables = tuple(block_ids) if block_ids and isinstance(block_ids[0], list) else None
            self._windows_left(st, tables)
        if st.load_job:
            # vLLM itself holds the blocks until the load's finished_recving; a second hold via
            # finished_sending would free them twice. Stores from before a preemption were fenced.
            self._reqs.pop(request.request_id, None)
            return False, None
        if st.store_jobs or st.sync_jobs:
            # (a same-step load whose wait ran out may still be written into these blocks)
            self._await_stores.append(request.request_id)
            self.stats.add("delayed_frees")
            return True, None
        self._reqs.pop(request.request_id, None)
        return False, None

    def get_kv_connector_stats(self) -> KvoffdStats | None:
        return self.stats.take()

    def reset_cache(self) -> bool:
        """Forget this engine's view (answers, leases, negative entries); optionally empty the namespace.

        The daemon's cache is shared by every engine of the namespace, so by default a reset does not
        touch it (``kvoffd_reset_clears_namespace`` turns the purge on).
        """
        for st in self._reqs.values():
            self._drop_lookup(st)
        self._negative.clear()
        self._known.clear()
        if not (self.s.reset_clears_namespace and self.enabled and self.client is not None):
            return True
        assert self.identity is not None
        try:
            cleared = self.client.clear(self.identity.namespace, timeout_s=self.s.connect_timeout_s)
        except (DaemonUnavailable, KvoffdError) as e:
            log.warning("kvoffd: clearing namespace %s failed: %s", self.identity.namespace, e)
            return False
        log.info("kvoffd: cleared %d blocks of namespace %s", cleared.removed_blocks, self.identity.namespace)
        return True

    def shutdown(self) -> None:
        if self.client is not None:
            for st in self._reqs.values():
                self._drop_lookup(st)
            self.client.close()
            self.client = None
