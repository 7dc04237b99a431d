"""The scheduler's store planning: each step's one STORE of every newly
full block of the scheduled requests, less what the daemon recently confirmed; sliding-window blocks
fenced once vLLM frees them; stores acknowledged by every worker."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kvoffd_client.vllm.events import NO_PARENT, block_tokens
from kvoffd_client.vllm.groups import NULL_BLOCK_ID
from kvoffd_client.vllm.metadata import KvoffdMetadata, KvoffdWorkerMeta
from kvoffd_client.vllm.sched_state import PlannedStore, RequestState, SchedulerState

if TYPE_CHECKING:
    from vllm.v1.core.sched.output import SchedulerOutput


@dataclass
class StoreBatch:
    """One step's STORE while it is planned. ``job`` is taken early when a sliding-window block is read
    (its read is recorded under the job); ``tokens``/``parents`` only when ``describe`` (KV events)."""

    describe: bool
    job: int = 0
    keys: list[bytes] = field(default_factory=list)
    block_ids: list[int] = field(default_factory=list)
    req_ids: list[str] = field(default_factory=list)
    seen: set[bytes] = field(default_factory=set)
    tokens: bytearray = field(default_factory=bytearray)
    parents: bytearray = field(default_factory=bytearray)


class StorePlanner:
    """Each step's STORE, fences of freed window blocks, and the workers' store results, over the
    scheduler's state."""

    def __init__(self, state: SchedulerState):
        self.state = state

    def plan(self, so: SchedulerOutput, meta: KvoffdMetadata, linked: bool) -> None:
        """This step's STORE into ``meta`` (``linked``: whether the daemon is reachable now)."""
        self._distrust_known(linked)
        self._commit_stores(self._plan_stores(so, so.kv_connector_block_state), meta)

    def fence_freed_windows(self, so: SchedulerOutput, meta: KvoffdMetadata) -> None:
        """Into ``meta``: the store jobs to fence before this step's forward (they read sliding-window
        blocks vLLM has freed). vLLM frees out-of-window blocks while scheduling this step, before
        build_connector_meta."""
        state = self.state
        block_state = so.kv_connector_block_state
        if state.window_groups:
            for req_id in so.num_scheduled_tokens:
                st = state.reqs.get(req_id)
                if st is not None and st.window_reads:
                    self.windows_left(st, block_state.get_block_ids(req_id) if block_state is not None else None)
        if state.fence_jobs:
            meta.fence_jobs, state.fence_jobs = sorted(state.fence_jobs), set()

    def _distrust_known(self, linked: bool) -> None:
        client = self.state.client
        if client is not None:
            self.state.known.distrust(linked, client.daemon_id)

    def _plan_stores(self, so: SchedulerOutput, block_state: Any) -> StoreBatch:
        now = time.monotonic()
        fresh = {r.req_id for r in so.scheduled_new_reqs}
        fresh.update(getattr(so.scheduled_cached_reqs, "resumed_req_ids", None) or ())
        new_ids = {r.req_id: r.block_ids for r in so.scheduled_new_reqs}
        state = self.state
        hello = state.client.hello if state.client is not None else None
        batch = StoreBatch(describe=state.describable and "kv_events" in (getattr(hello, "capabilities", None) or ()))
        for req_id, n_sched in so.num_scheduled_tokens.items():
            st = state.reqs.get(req_id)
            if st is None or n_sched <= 0 or st.sync_jobs:
                continue
            if req_id in fresh:
                # Re-offer the whole prefix: blocks vLLM found in its own cache may be missing from the
                # daemon (it restarted, evicted them, or was absent when they were computed). Those
                # the daemon recently confirmed are skipped below.
                st.next_store = 0
            self._plan_request(batch, st, req_id, n_sched, block_state, new_ids, now)
        return batch

    def _plan_request(self, batch: StoreBatch, st: RequestState, req_id: str, n_sched: int, block_state: Any,
                      new_ids: dict[str, Any], now: float) -> None:
        """Add the request's blocks that became full (since ``st.next_store``) to the step's batch."""
        state = self.state
        req, bs, G = st.request, state.block_size, state.ngroups
        # Tokens whose KV exists once this step's forward ran (spec-decode drafts excluded).
        end = min(req.num_computed_tokens + n_sched, req.num_tokens)
        if not state.s.store_decode:
            end = min(end, req.num_prompt_tokens)
        all_keys, _ = state.daemon_keys(st)
        n_full = min(end // bs, len(all_keys) // G)
        if n_full <= st.next_store:
            return
        table = block_state.get_block_ids(req_id) if block_state is not None else new_ids.get(req_id)
        if not table:
            return
        n_full = min(n_full, *(len(t) for t in table[:G]))
        added = False
        is_known = state.known.is_known
        for i in range(st.next_store, n_full):
            for g in range(G):
                b = table[g][i]
                k = all_keys[i * G + g]
                # A null block is a sliding window's block vLLM already freed: its bytes are gone.
                if b == NULL_BLOCK_ID or k in batch.seen or is_known(k, now):
                    continue
                batch.seen.add(k)
                batch.keys.append(k)
                batch.block_ids.append(b)
                if batch.describe:
                    batch.tokens += block_tokens(req.all_token_ids, i * bs, bs)
                    batch.parents += all_keys[i - 1] if i else NO_PARENT
                added = True
                if g in state.window_groups:
                    if not batch.job:
                        batch.job = state.next_job()
                    st.window_reads.append((batch.job, g, i, b))
        st.next_store = n_full
        if added:
            batch.req_ids.append(req_id)

    def _commit_stores(self, batch: StoreBatch, meta: KvoffdMetadata) -> None:
        if not batch.keys:
            return
        state = self.state
        job = batch.job or state.next_job()
        meta.store_job_id, meta.store_keys, meta.store_block_ids, meta.store_req_ids = (
            job, batch.keys, batch.block_ids, batch.req_ids)
        if batch.describe:
            meta.store_tokens, meta.store_parents = bytes(batch.tokens), bytes(batch.parents)
        state.store_jobs[job] = PlannedStore(batch.keys, batch.req_ids)
        for r in batch.req_ids:
            state.reqs[r].store_jobs.add(job)

    def windows_left(self, st: RequestState, tables: tuple[list[int], ...] | None) -> None:
        """Fence the store jobs still reading sliding-window blocks that vLLM has freed since (``tables``
        None: the request is gone, all of its blocks are free)."""
        live: list[tuple[int, int, int, int]] = []
        for job, g, i, b in st.window_reads:
            if job not in self.state.store_jobs:
                continue  # acknowledged by every worker: nothing reads the block any more
            if tables is None or i >= len(tables[g]) or tables[g][i] != b:
                self.state.fence_jobs.add(job)
            else:
                live.append((job, g, i, b))
        st.window_reads = live

    def store_results(self, wm: KvoffdWorkerMeta) -> None:
        """Stores failed or done on some workers; a job done on every worker confirms its keys."""
        state = self.state
        for job_id, n in wm.stores_failed.items():
            if job_id in state.store_jobs:
                state.store_jobs[job_id].failed += n
        for job_id, n in wm.stores_done.items():
            job = state.store_jobs.get(job_id)
            if job is None:
                continue
            job.done += n
            if job.done < state.world_size:
                continue
            del state.store_jobs[job_id]
            for r in job.req_ids:
                st = state.reqs.get(r)
                if st is not None:
                    st.store_jobs.discard(job_id)
            if not job.failed:
                state.known.stored(job.keys, time.monotonic())
