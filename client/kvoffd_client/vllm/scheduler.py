"""Scheduler half of KvoffdConnector (EngineCore process): the vLLM hooks, each request's keys, and
the planners it is made of: lookups (``sched_lookup``), loads (``sched_load``), stores (``sched_store``);
their per-request state is ``sched_state``.

The engine loop calls in here every step, so nothing here waits on the daemon: a lookup is sent and
answered "not yet" (``(None, False)``) until its reply is in; an unreachable daemon is a miss.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import TYPE_CHECKING, Any

from kvoffd_client import protocol as P
from kvoffd_client.client import DaemonUnavailable, KvoffdClient, KvoffdError
from kvoffd_client.vllm.common import KvoffdStats, KvoffdWorkerMeta, LoadSpec, Settings, log
from kvoffd_client.vllm.events import kv_events_layout
from kvoffd_client.vllm.groups import GroupKind, group_key
from kvoffd_client.vllm.identity import CacheIdentity, fold_key
from kvoffd_client.vllm.sched_load import LoadPlanner
from kvoffd_client.vllm.sched_lookup import LookupPlanner
from kvoffd_client.vllm.sched_state import PlannedStore, RequestState
from kvoffd_client.vllm.sched_store import StorePlanner
from kvoffd_client.vllm.syncload import SyncLoadBudget

if TYPE_CHECKING:
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KvoffdScheduler(LookupPlanner, LoadPlanner, StorePlanner):
    def __init__(self, settings: Settings, identity: CacheIdentity | None, world_size: int, engine_id: str,
                 *, block_bytes: int = 0, device: str = "cpu"):
        self.s = settings
        self.identity = identity
        self.enabled = identity is not None
        self.world_size = world_size
        self.stats = KvoffdStats()
        self._reqs: dict[str, RequestState] = {}
        self._store_jobs: dict[int, PlannedStore] = {}
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

    def _state(self, request: Request) -> RequestState:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._reqs[request.request_id] = RequestState(request)
        return st

    def _keys(self, st: RequestState) -> list[bytes]:
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
        self._drop_lookup(st)  # it asked about keys that may be gone

    def _daemon_keys(self, st: RequestState) -> tuple[list[bytes], bytearray]:
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

    # --------------------------------------------------------------------------------------------
    # vLLM hooks (the planners' own: sched_lookup, sched_load, sched_store)

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        wm = out.kv_connector_worker_meta
        if isinstance(wm, KvoffdWorkerMeta):
            self._sync_results(wm)
            self._store_results(wm)
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
