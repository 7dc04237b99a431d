"""Scheduler half of KvoffdConnector (EngineCore process): the vLLM hooks, over the state they share
(``sched_state.SchedulerState``: each request's keys among it) and the three planners that hold it:
lookups (``sched_lookup``), loads (``sched_load``), stores (``sched_store``).

The engine loop calls in here every step, so nothing here waits on the daemon while other requests
could run: a lookup is sent and answered "not yet" (``(None, False)``) until its reply is in; an
unreachable daemon is a miss. Only an engine with nothing else to run waits for a reply, at most
``kvoffd_lookup_wait_ms`` per step: "not yet" would cost it an empty step, longer than the reply.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from kvoffd_client.client import DaemonUnavailable, KvoffdClient, KvoffdError
from kvoffd_client.vllm.identity import CacheIdentity
from kvoffd_client.vllm.logs import log
from kvoffd_client.vllm.metadata import KvoffdMetadata, KvoffdWorkerMeta
from kvoffd_client.vllm.sched_load import LoadPlanner
from kvoffd_client.vllm.sched_lookup import LookupPlanner
from kvoffd_client.vllm.sched_state import SchedulerState
from kvoffd_client.vllm.sched_store import StorePlanner
from kvoffd_client.vllm.settings import Settings
from kvoffd_client.vllm.stats import KvoffdStats

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request


class KvoffdScheduler:
    """The scheduler half: ``state`` (kvoffd_client.vllm.sched_state) and the three planners over it."""

    def __init__(self, settings: Settings, identity: CacheIdentity | None, world_size: int, engine_id: str,
                 *, block_bytes: int = 0, device: str = "cpu"):
        self.state = state = SchedulerState(settings, identity, world_size, block_bytes=block_bytes, device=device)
        self.lookups = LookupPlanner(state)
        self.loads = LoadPlanner(state)
        self.stores = StorePlanner(state)
        if state.enabled:
            state.client = KvoffdClient(settings.address, name=f"vllm-scheduler:{engine_id}",
                                        timeout_s=max(settings.connect_timeout_s, 0.1),
                                        job_deadline_s=settings.job_timeout_s)
            if not state.client.connect(settings.connect_timeout_s):
                log.warning("kvoffd: no daemon answering at %s; vLLM serves without offload and the "
                            "connector connects when the daemon appears", settings.address)

    # --------------------------------------------------------------------------------------------
    # vLLM hooks

    def on_new_request(self, request: Request) -> None:
        self.lookups.on_new_request(request)

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        return self.lookups.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        self.loads.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, so: SchedulerOutput) -> KvoffdMetadata:
        state = self.state
        meta = KvoffdMetadata(loads=state.pending_loads, await_stores=state.await_stores,
                              preempted=sorted(so.preempted_req_ids or ()))
        state.pending_loads, state.await_stores = [], []
        state.sync_budget.new_step()  # this step's schedule is complete
        state.new_step(so.num_scheduled_tokens)
        self.stores.fence_freed_windows(so, meta)
        self.lookups.reap_orphans()
        client = state.client
        linked = client is not None and client.connected
        if client is not None and not linked:
            client.take_notices()  # drives reconnection while the engine steps
        if state.enabled:
            self.stores.plan(so, meta, linked)
        return meta

    def update_connector_output(self, out: KVConnectorOutput) -> None:
        state = self.state
        wm = out.kv_connector_worker_meta
        if isinstance(wm, KvoffdWorkerMeta):
            self.loads.sync_results(wm)
            self.stores.store_results(wm)
        failed = out.failed_recving or set()
        n_failed = 0
        for req_id in out.finished_recving or ():
            st = state.reqs.get(req_id)
            if st is None:
                continue
            if req_id in failed:
                self.loads.load_failed(st, wm.load_failed_at.get(req_id, 0) if isinstance(wm, KvoffdWorkerMeta) else 0)
                n_failed += 1
                log.debug("kvoffd: loading %d blocks for request %s failed", len(st.load_keys), req_id)
            st.load_job, st.load_keys = 0, []
        if n_failed:  # one line per step, not per request: a daemon death fails hundreds at once
            log.warning("kvoffd: %d load(s) failed this step; vLLM recomputes those blocks", n_failed)
        for req_id in out.finished_sending or ():
            state.reqs.pop(req_id, None)

    def request_finished(self, request: Request, block_ids: list[int] | tuple[list[int], ...]
                         ) -> tuple[bool, dict[str, Any] | None]:
        """``block_ids``: the blocks vLLM frees unless we hold them (one list, or one per group with HMA)."""
        state = self.state
        state.running.discard(request.request_id)
        st = state.reqs.get(request.request_id)
        if st is None:
            return False, None
        state.drop_lookup(st)
        if st.window_reads:
            # vLLM already freed the blocks that left the window; the ones still listed are held below.
            tables = tuple(block_ids) if block_ids and isinstance(block_ids[0], list) else None
            self.stores.windows_left(st, tables)
        if st.load_job:
            # vLLM itself holds the blocks until the load's finished_recving; a second hold via
            # finished_sending would free them twice. Stores from before a preemption were fenced.
            state.reqs.pop(request.request_id, None)
            return False, None
        if st.store_jobs or st.sync_jobs:
            # (a same-step load whose wait ran out may still be written into these blocks)
            state.await_stores.append(request.request_id)
            state.stats.add("delayed_frees")
            return True, None
        state.reqs.pop(request.request_id, None)
        return False, None

    def get_kv_connector_stats(self) -> KvoffdStats | None:
        return self.state.stats.take()

    def reset_cache(self) -> bool:
        """Forget this engine's view (answers, leases, negative entries); optionally empty the namespace.

        The daemon's cache is shared by every engine of the namespace, so by default a reset does not
        touch it (``kvoffd_reset_clears_namespace`` turns the purge on).
        """
        state = self.state
        for st in state.reqs.values():
            state.drop_lookup(st)
        state.known.clear()
        if not (state.s.reset_clears_namespace and state.enabled and state.client is not None):
            return True
        assert state.identity is not None
        ns = state.identity.namespace
        try:
            cleared = state.client.clear(ns, timeout_s=state.s.connect_timeout_s)
        except (DaemonUnavailable, KvoffdError) as e:
            log.warning("kvoffd: clearing namespace %s failed: %s", ns, e)
            return False
        log.info("kvoffd: cleared %d blocks of namespace %s", cleared.removed_blocks, ns)
        return True

    def shutdown(self) -> None:
        state = self.state
        if state.client is not None:
            for st in state.reqs.values():
                state.drop_lookup(st)
            state.client.close()
            state.client = None
