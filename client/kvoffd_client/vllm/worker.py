"""Worker half of KvoffdConnector (one per TP/PP rank): registers the KV memory, submits jobs.

The daemon copies on its own, so the worker only sends one STORE per step (after the forward) and
one LOAD per loading request, and turns the daemon's NOTICEs into vLLM's finished/failed sets. It
waits only twice. To fence a preemption: vLLM frees a preempted request's blocks without telling
the connector and may hand them out in the same step, so stores still reading them must finish
before this step's forward writes there. And for a same-step load (kvoffd_client.vllm.syncload),
bounded: the forward reads its blocks. No job is given up on a timer: a load's request waits (as
vLLM's WAITING_FOR_REMOTE_KVS) and a finished request's blocks stay held until the job's notice, or
until the client fails the job because the daemon that took it is gone (kvoffd_client.liveness);
other requests go on meanwhile. Where TP ranks hold identical KV (MLA, ``CacheIdentity.replicas``)
only the first rank of each run stores; the others report their share of each store job done at once
(the scheduler still counts one per rank) and load the first rank's copy like any other.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorTransferResults

from kvoffd_client.client import DaemonUnavailable, KvoffdClient, KvoffdError
from kvoffd_client.protocol import Notice
from kvoffd_client.vllm.identity import CacheIdentity
from kvoffd_client.vllm.layerwise import LayerParts, StepLayers, StepSaves
from kvoffd_client.vllm.logs import log
from kvoffd_client.vllm.metadata import KvoffdMetadata, KvoffdWorkerMeta
from kvoffd_client.vllm.registration import KvRegistration
from kvoffd_client.vllm.settings import Settings
from kvoffd_client.vllm.stats import KvoffdStats

if TYPE_CHECKING:
    import torch

    from kvoffd_client.memory.cuda_ipc import CudaExport


@dataclass
class _StoreJob:
    req_ids: list[str]
    n: int
    events: list[int]  # the ring slots it holds until its notice


@dataclass
class _LoadJob:
    req_id: str
    n: int
    #: A same-step load: its blocks, for vLLM's load-error path (a failure is reported per block,
    #: never through finished_recving: vLLM is not waiting for this request).
    block_ids: list[int] | None = None
    late: bool = False  # the step's wait ran out: the daemon may still write its blocks


class KvoffdWorker:
    def __init__(self, settings: Settings, identity: CacheIdentity | None, engine_id: str, rank: int,
                 num_blocks: int, vllm_config: Any = None):
        self.s = settings
        self.engine_id = engine_id
        self.rank = rank
        #: False on a rank whose KV another rank stores for it (MLA at TP > 1: identity.replicas).
        self.sends_stores = identity is None or identity.stores(rank)
        self.stats = KvoffdStats()
        self.client: KvoffdClient | None = None
        #: this worker's KV memory as the daemon knows it (None: offload off, no identity)
        self.registration = (KvRegistration(settings, identity, engine_id, rank, num_blocks,
                                            sends_stores=self.sends_stores, vllm_config=vllm_config)
                             if identity is not None else None)
        self._stores: dict[int, _StoreJob] = {}
        self._req_stores: dict[str, set[int]] = {}
        self._loads: dict[int, _LoadJob] = {}
        self._awaiting: set[str] = set()
        self._finished_recving: set[str] = set()
        self._failed_recving: set[str] = set()
        self._invalid_blocks: set[int] = set()  # same-step loads that failed, for this step's output
        self._late: dict[str, set[int]] = {}  # req id -> same-step loads past their wait, still in flight
        self._meta = KvoffdWorkerMeta()
        #: Store jobs this worker is waiting for before a forward (empty otherwise); tests watch it.
        self.fencing: frozenset[int] = frozenset()
        #: Same-step loads layer by layer (None: whole loads; kvoffd_client.vllm.layerwise).
        self.layers: StepLayers | None = None
        self.saves: StepSaves | None = None
        if identity is not None:
            self.client = KvoffdClient(settings.address, name=f"vllm-worker:{engine_id}",
                                       timeout_s=max(settings.connect_timeout_s, 0.1),
                                       job_deadline_s=settings.job_timeout_s)
            if not self.client.connect(settings.connect_timeout_s):
                # The scheduler half logs the one warning; this is the per-worker detail.
                log.info("kvoffd: no daemon answering at %s yet (worker %s)", settings.address, engine_id)

    @property
    def active(self) -> bool:
        return self.client is not None and self.registration is not None and self.registration.registered

    @property
    def _cuda(self) -> CudaExport | None:
        return self.registration.cuda if self.registration is not None else None

    # --------------------------------------------------------------------------------------------
    # registration and sleep mode (kvoffd_client.vllm.registration)

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        reg = self.registration
        if self.client is None or reg is None or not kv_caches:
            return
        if not reg.register(self.client, kv_caches):
            self._shutdown_client()
            return
        single = reg.identity.num_groups < 2  # same-step loads are single-group only (syncload)
        parts = (LayerParts.of(kv_caches, reg.num_blocks, reg.block_bytes, self.s.layer_parts)
                 if self.s.layerwise and single else None)
        self.layers = StepLayers(parts) if parts is not None else None
        #: Stores in parts behind the forward (CUDA: the ring's events mark each part written).
        self.saves = StepSaves(parts) if parts is not None and reg.cuda is not None and self.sends_stores else None

    def unregister_kv_caches(self) -> None:
        """Drain this worker's jobs, then UNREGISTER (``KvRegistration.unregister``), before vLLM
        frees the KV memory for a sleep."""
        client, reg = self.client, self.registration
        if client is None or reg is None or not reg.sleeps:
            return
        pending = set(self._stores) | set(self._loads)
        if pending:
            self._complete(client.wait_notices(pending, self.s.job_timeout_s))
        reg.unregister(client)

    def restore_kv_caches(self) -> None:
        """After wake the KV tensors keep their addresses but are backed by new physical memory:
        export it again and register (a new mapping in the daemon)."""
        kv = self.registration.to_restore() if self.registration is not None else None
        if kv is not None:
            self.register_kv_caches(kv)

    def _shutdown_client(self) -> None:
        if self.client is not None:
            self.client.close()
            self.client = None
        if self.registration is not None:
            self.registration.registered = False

    # --------------------------------------------------------------------------------------------
    # per step

    def _complete(self, notices: list[Notice]) -> None:
        for nt in notices:
            sj = self._stores.pop(nt.job_id, None)
            if sj is not None:
                self._meta.stores_done[nt.job_id] = self._meta.stores_done.get(nt.job_id, 0) + 1
                if not nt.ok or nt.failed:
                    self._meta.stores_failed[nt.job_id] = self._meta.stores_failed.get(nt.job_id, 0) + 1
                    self.stats.add("store_failed_blocks", len(nt.failed) or sj.n)
                for r in sj.req_ids:
                    jobs = self._req_stores.get(r)
                    if jobs is not None:
                        jobs.discard(nt.job_id)
                        if not jobs:
                            del self._req_stores[r]
                if self._cuda is not None:
                    for e in sj.events:
                        self._cuda.ring.release(e)
                continue
            lj = self._loads.pop(nt.job_id, None)
            if lj is not None and lj.block_ids is not None:
                self._sync_done(nt, lj)
            elif lj is not None:
                self._finished_recving.add(lj.req_id)
                if not nt.ok or nt.failed:
                    self._failed_recving.add(lj.req_id)
                    self._meta.load_failed_at[lj.req_id] = min(nt.failed) if nt.failed else 0
                    self.stats.add("load_failed_jobs")
                    log.debug("kvoffd: load job %d for %s failed (%s: %s)", nt.job_id, lj.req_id, nt.code,
                              nt.message)

    def _sync_done(self, nt: Notice, lj: _LoadJob) -> None:
        """A same-step load ended: its blocks are the daemon's no more (the scheduler may free them)."""
        self._meta.sync_settled[nt.job_id] = self._meta.sync_settled.get(nt.job_id, 0) + 1
        if lj.late:
            jobs = self._late.get(lj.req_id, set())
            jobs.discard(nt.job_id)
            if not jobs:
                self._late.pop(lj.req_id, None)
            return  # already reported failed when its wait ran out
        if not nt.ok or nt.failed:
            self._sync_failed(lj, min(nt.failed) if nt.failed else 0)
            log.debug("kvoffd: same-step load %d for %s failed (%s: %s)", nt.job_id, lj.req_id, nt.code, nt.message)

    def _sync_failed(self, lj: _LoadJob, at: int) -> None:
        """Report blocks ``at..`` of a same-step load through vLLM's load-error path: vLLM cuts the
        request back to the first of them, drops this step's token for it and recomputes."""
        assert lj.block_ids is not None
        self._invalid_blocks.update(lj.block_ids[at:])
        self._meta.load_failed_at[lj.req_id] = min(at, self._meta.load_failed_at.get(lj.req_id, at))
        self.stats.add("load_failed_jobs")

    def _poll(self) -> None:
        # take_notices also drives reconnection, so call it while the link is down too.
        if self.client is not None and (self._stores or self._loads or not self.client.connected):
            self._complete(self.client.take_notices())

    def handle_preemptions(self, meta: KvoffdMetadata) -> None:
        if not (meta.preempted or meta.fence_jobs) or not (self._stores or self._late):
            return
        preempted = set(meta.preempted)
        jobs = {j for j, sj in self._stores.items() if preempted.intersection(sj.req_ids)}
        jobs.update(j for j in meta.fence_jobs if j in self._stores)
        # A same-step load past its wait may still write the preempted request's blocks.
        jobs.update(j for r in preempted.intersection(self._late) for j in self._late[r])
        if not jobs or self.client is None:
            return
        t0 = time.perf_counter()
        self.fencing = frozenset(jobs)  # (observable: the hybrid fence test gates on it)
        try:
            self._fence(jobs, t0)
        finally:
            self.fencing = frozenset()
        self.stats.add("fence_waits")
        self.stats.add("fence_wait_us", int((time.perf_counter() - t0) * 1e6))

    def _fence(self, jobs: set[int], t0: float) -> None:
        """Wait until no store in ``jobs`` can still read: its notice came, or the client failed it
        because its daemon is gone. Never on a timer alone: vLLM may hand the preempted blocks out in
        this very step, and a store still reading them would publish the new bytes under the old
        keys. A frozen daemon stalls this step (logged every ``fence_timeout_s``) until it thaws,
        answers or dies; stores normally end long before, so the wait is microseconds."""
        assert self.client is not None
        left = {j for j in jobs if j in self._stores or j in self._loads}
        logged = False
        while left:
            self._complete(self.client.wait_notices(left, self.s.fence_timeout_s))
            left = {j for j in left if j in self._stores or j in self._loads}
            if left:
                if not logged:
                    self.stats.add("fence_timeouts")
                    logged = True
                log.error("kvoffd: %d jobs may still touch freed blocks (preempted, or out of a sliding window) after %.1f s; "
                          "this step waits until the daemon answers or is gone (frozen or stalled daemon?)",
                          len(left), time.perf_counter() - t0)

    def start_load_kv(self, meta: KvoffdMetadata, hooks: bool = True) -> None:
        """Submit the step's loads; then wait for its same-step loads (vLLM calls this before the
        forward when the step has any: ``SchedulerOutput.has_sync_kv_loads``), or, layer-wise, let
        the forward wait for each layer (``wait_for_layer_load``). ``hooks``: whether this step's
        forward runs vLLM's per-layer hooks (not when it replays a full CUDA graph)."""
        sync: set[int] = set()
        layered: set[int] = set()
        cuts = (self.layers.parts.cuts if hooks and self.layers is not None and self.client is not None
                and self.client.supports_parts else ())
        for ld in meta.loads:
            self.stats.add("load_jobs")
            self.stats.add("load_blocks", len(ld.keys))
            lj = _LoadJob(ld.req_id, len(ld.keys), list(ld.block_ids) if ld.sync else None)
            try:
                if not self.active:
                    raise DaemonUnavailable()
                assert self.client is not None
                # A same-step load is not started after the step gave up on it (its blocks are
                # recomputed by then); it still ends only with its notice.
                self.client.submit_load(self.engine_id, ld.job_id, ld.keys, ld.block_ids, lease_id=ld.lease_id,
                                        deadline_s=self.s.sync_load_timeout_ms / 1000 if ld.sync else None,
                                        cuts=cuts if ld.sync else ())
                self._loads[ld.job_id] = lj
                if ld.sync:
                    (layered if cuts else sync).add(ld.job_id)
            except (DaemonUnavailable, KvoffdError):
                if ld.sync:  # nothing was sent: nothing can write its blocks
                    self._meta.sync_settled[ld.job_id] = self._meta.sync_settled.get(ld.job_id, 0) + 1
                    self._sync_failed(lj, 0)
                    continue
                # Reported as failed with this step's results: vLLM recomputes.
                self._finished_recving.add(ld.req_id)
                self._failed_recving.add(ld.req_id)
                self._meta.load_failed_at[ld.req_id] = 0
                self.stats.add("load_failed_jobs")
        if sync:
            self._wait_sync(sync)
        if layered:
            assert self.layers is not None
            self.layers.begin(layered, self.s.sync_load_timeout_ms / 1000)
            self.stats.add("layerwise_load_jobs", len(layered))

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Before a layer's attention: wait until the parts of this step's layer-wise loads holding
        that layer landed (at most until the step's deadline; a load still short is recomputed)."""
        if self.layers is None or not self.layers.active or self.client is None:
            return
        late = self.layers.wait(self.client, layer_name)
        if late:
            self._mark_late(late)

    def _settle_layers(self) -> None:
        """After the forward: the step's layer-wise loads end like whole same-step loads (their notices,
        within the step's deadline; late ones stay in flight). A forward that did not wait for every
        part (its layers ran no hooks) may have read blocks still loading: those loads are reported
        failed and every later same-step load is waited for whole."""
        layers = self.layers
        if layers is None or not layers.active or self.client is None:
            return
        jobs, complete = layers.end()
        jobs = {j for j in jobs if j in self._loads}
        if not complete:
            log.error("kvoffd: this step's forward did not wait for its layer-wise loads (no per-layer hooks: a "
                      "full CUDA graph?); they are recomputed, and same-step loads are now waited for whole")
            self.stats.add("layerwise_unwaited", len(jobs))
            self.layers = None
            self._mark_late(jobs, log_it=False)
            return
        self._settle_sync(jobs, layers.left_s(), layers.blocked_s)

    def _wait_sync(self, jobs: set[int]) -> None:
        """Wait (at most ``sync_load_timeout_ms``) for this step's same-step loads. A load still out
        then is reported failed (its blocks recomputed) but stays in flight: its blocks remain the
        request's, and a preemption or finish of the request waits for it (handle_preemptions, and
        the scheduler's delayed free), since the daemon may still write them."""
        self._settle_sync(jobs, self.s.sync_load_timeout_ms / 1000)

    def _settle_sync(self, jobs: set[int], timeout_s: float, blocked_s: float = 0.0) -> None:
        """Wait (at most ``timeout_s``) for the notices of same-step loads; ``blocked_s``: how long the
        step already waited for them (layer by layer). The wait counts towards the budget's measure."""
        assert self.client is not None
        t0 = time.perf_counter() - blocked_s
        blocks = sum(self._loads[j].n for j in jobs if j in self._loads)
        if jobs:
            self._complete(self.client.wait_notices(jobs, timeout_s))
        us = int((time.perf_counter() - t0) * 1e6)
        self.stats.add("sync_load_jobs", len(jobs))
        self.stats.add("sync_load_wait_us", us)
        late = {j for j in jobs if j in self._loads}
        self._mark_late(late)
        if not late and us > 0:
            assert self.registration is not None
            self._meta.sync_bytes += blocks * self.registration.block_bytes
            self._meta.sync_us += us

    def _mark_late(self, jobs: set[int], log_it: bool = True) -> None:
        """Same-step loads past their time: reported failed, but in flight until their notice (the
        daemon may still write their blocks, so the request keeps them and a preemption waits)."""
        for j in jobs:
            lj = self._loads.get(j)
            if lj is None or lj.late:
                continue
            lj.late = True
            self._late.setdefault(lj.req_id, set()).add(j)
            self._sync_failed(lj, 0)
        if jobs and log_it:
            self.stats.add("sync_load_timeouts", len(jobs))
            self._meta.sync_timeouts += len(jobs)
            log.warning("kvoffd: %d same-step load(s) not done after %d ms; vLLM recomputes those blocks, "
                        "and loads are asynchronous for a while", len(jobs), self.s.sync_load_timeout_ms)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._invalid_blocks = self._invalid_blocks, set()
        return out

    def wait_for_save(self, meta: KvoffdMetadata) -> None:
        """Submit the step's STORE. On CPU the forward is done when this runs; on CUDA an event marks it."""
        if not meta.store_job_id:
            return
        job = meta.store_job_id
        if not self.sends_stores:  # another rank stores the copy this one shares; its part is done at once
            self._meta.stores_done[job] = self._meta.stores_done.get(job, 0) + 1
            return
        n = len(meta.store_keys)
        self.stats.add("store_jobs")
        self.stats.add("store_blocks", n)
        cuts: tuple[int, ...] = ()
        events: list[int] = []
        holds: list[int] = []
        try:
            if not self.active or self.client is None or not self.client.connected:
                raise DaemonUnavailable()
            if self._cuda is not None:
                if self.saves is not None and self.client.supports_parts:
                    cuts, events, holds = self.saves.finish(self._cuda.ring, job)
                else:
                    events = holds = [self._cuda.ring.record()]
            described = self.rank == 0 and meta.store_tokens  # one rank describes blocks for KV events
            self.client.submit_store(self.engine_id, job, meta.store_keys, meta.store_block_ids,
                                     event=events[-1] if events else -1,
                                     tokens=meta.store_tokens if described else b"",
                                     parents=meta.store_parents if described else b"",
                                     cuts=cuts, events=events if cuts else ())
        except (DaemonUnavailable, KvoffdError):
            if self._cuda is not None:
                for e in holds:
                    self._cuda.ring.release(e)
                if self.saves is not None and not holds:
                    self.saves.drop(self._cuda.ring)
            # Nothing reads the blocks: done (and failed) at once, so nobody waits for it.
            self._meta.stores_done[job] = self._meta.stores_done.get(job, 0) + 1
            self._meta.stores_failed[job] = self._meta.stores_failed.get(job, 0) + 1
            self.stats.add("store_dropped_jobs")
            return
        self._stores[job] = _StoreJob(list(meta.store_req_ids), n, holds)
        for r in meta.store_req_ids:
            self._req_stores.setdefault(r, set()).add(job)

    def save_kv_layer(self, layer_name: str, job: int) -> None:
        """A layer's forward was launched in the step of store ``job`` (CUDA): mark its part's end."""
        if self.saves is not None and self._cuda is not None:
            self.saves.saved(layer_name, self._cuda.ring, job)

    def get_transfer_results(self, meta: KvoffdMetadata | None) -> KVConnectorTransferResults:
        self._settle_layers()  # first: their failures belong to this step's load errors
        if meta is not None and meta.await_stores:
            self._awaiting.update(meta.await_stores)
        self._poll()
        sending: set[str] = set()
        if self._awaiting:
            sending = {r for r in self._awaiting if r not in self._req_stores and r not in self._late}
            self._awaiting -= sending
        recving, self._finished_recving = self._finished_recving, set()
        failed, self._failed_recving = self._failed_recving, set()
        return KVConnectorTransferResults(finished_sending=sending, finished_recving=recving, failed_recving=failed)

    def build_worker_meta(self) -> KvoffdWorkerMeta | None:
        if self._meta.is_empty():
            return None
        out, self._meta = self._meta, KvoffdWorkerMeta()
        return out

    def get_stats(self) -> KvoffdStats | None:
        return self.stats.take()

    def shutdown(self) -> None:
        client = self.client
        if client is not None:
            if self._stores or self._late:
                self._complete(client.wait_notices(set(self._stores) | set().union(*self._late.values()),
                                                   min(self.s.fence_timeout_s, 2.0)))
            if self.active and client.connected:
                try:
                    client.unregister(self.engine_id, timeout_s=1.0)
                except (DaemonUnavailable, KvoffdError):
                    pass  # the daemon drops the engine anyway when this connection closes
            self._shutdown_client()
        if self.registration is not None:
            self.registration.release()
