"""The scheduler's load planning: a LOAD for the hits vLLM allocated
blocks for (asynchronous, or within the step: ``sync``), and what a failed or settled load changes."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

from kvoffd_client.vllm.groups import NULL_BLOCK_ID
from kvoffd_client.vllm.logs import log
from kvoffd_client.vllm.metadata import KvoffdWorkerMeta, LoadSpec
from kvoffd_client.vllm.sched_state import RequestState, SchedulerState

if TYPE_CHECKING:
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.request import Request


class LoadPlanner:
    """vLLM's ``update_state_after_alloc`` and the workers' load results, over the scheduler's state."""

    def __init__(self, state: SchedulerState):
        self.state = state

    def update_state_after_alloc(self, request: Request, blocks: KVCacheBlocks, num_external_tokens: int) -> None:
        state = self.state
        st = state.reqs.get(request.request_id)
        if num_external_tokens <= 0 or (st is not None and st.offer_sync):
            state.running.add(request.request_id)  # vLLM computes it in this step: the step is not idle
        if st is None:
            return
        if num_external_tokens <= 0 or not state.enabled:
            state.drop_lookup(st)
            return
        lk = st.lookup
        n = num_external_tokens // state.block_size
        if lk is None or lk.hits < 0 or n <= 0:  # cannot happen: we only offer answered lookups
            log.error("kvoffd: vLLM allocated %d external tokens for %s without an answered lookup",
                      num_external_tokens, request.request_id)
            return
        start = st.offer_start
        keys, block_ids = self._load_plan(st, blocks.get_block_ids(), start, n)
        job = state.next_job()
        state.pending_loads.append(LoadSpec(request.request_id, job, keys, block_ids, lk.lease_id, sync=st.offer_sync))
        state.unprefetch(lk)
        st.lookup = None  # the LOAD consumes the lease
        st.load_keys = keys
        if st.offer_sync:  # vLLM runs the request in this step: no finished_recving will come
            st.sync_jobs[job] = 0
            state.sync_owner[job] = request.request_id
            state.stats.add("sync_offers")
        else:
            st.load_job = job
        st.next_store = start + n
        state.stats.add("lookup_hit_blocks", n)

    def _load_plan(self, st: RequestState, tables: tuple[list[int], ...], start: int, n: int
                   ) -> tuple[list[bytes], list[int]]:
        """Blocks ``start..start+n`` of every group, except those vLLM keeps as the null block (a sliding
        window's blocks before the window: nothing reads them, so nothing is loaded there)."""
        G = self.state.ngroups
        all_keys = self.state.daemon_keys(st)[0]
        keys: list[bytes] = []
        block_ids: list[int] = []
        for i in range(start, start + n):
            for g in range(G):
                b = tables[g][i]
                if b != NULL_BLOCK_ID:
                    keys.append(all_keys[i * G + g])
                    block_ids.append(b)
        return keys, block_ids

    def load_failed(self, st: RequestState, at: int) -> None:
        """A load failed from its block ``at``: those keys are misses for a while (vLLM may ask again
        from zero), and the request is never offered a hit again."""
        bad = st.load_keys[min(at, max(len(st.load_keys) - 1, 0)):]
        self.state.known.failed(bad, time.monotonic() + self.state.s.negative_ttl_s)
        st.no_external = True
        st.next_store = 0

    def sync_results(self, wm: KvoffdWorkerMeta) -> None:
        """Same-step loads: the measured link speed, failures, and loads settled on every worker."""
        state = self.state
        state.sync_budget.observe(wm.sync_bytes, wm.sync_us, wm.sync_timeouts, time.monotonic())
        failed = 0
        for req_id, at in wm.load_failed_at.items():
            st = state.reqs.get(req_id)
            if st is not None and st.sync_jobs and not st.load_job:
                self.load_failed(st, at)
                failed += 1
        if failed:
            log.warning("kvoffd: %d same-step load(s) failed this step; vLLM recomputes those blocks", failed)
        for job, n in wm.sync_settled.items():
            req_id = state.sync_owner.get(job)
            st = state.reqs.get(req_id) if req_id is not None else None
            if st is None or job not in st.sync_jobs:
                state.sync_owner.pop(job, None)
                continue
            st.sync_jobs[job] += n
            if st.sync_jobs[job] >= state.world_size:
                del st.sync_jobs[job], state.sync_owner[job]
                if not st.sync_jobs:
                    st.load_keys = []
                    st.next_store = 0  # stores resume, from the start (what the daemon holds is skipped)
