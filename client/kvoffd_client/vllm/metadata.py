"""What crosses between the connector's two roles every step: the scheduler's plan for the workers
(``KvoffdMetadata``, its loads as ``LoadSpec``) and the workers' results for the scheduler
(``KvoffdWorkerMeta``), each a small picklable dataclass of plain lists: block ids, 32-byte keys,
job ids."""

from __future__ import annotations

from dataclasses import dataclass, field

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)


@dataclass
class LoadSpec:
    """One request's load: pool blocks ``keys[i]`` -> engine block ``block_ids[i]``."""

    req_id: str
    job_id: int
    keys: list[bytes]
    block_ids: list[int]
    lease_id: int
    #: Loaded within this step (vLLM schedules the request's remaining tokens now): the worker waits
    #: for it before the forward, bounded, and reports failures as invalid blocks.
    sync: bool = False


@dataclass
class KvoffdMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    loads: list[LoadSpec] = field(default_factory=list)
    # This step's store: one job for every newly full block of every scheduled request.
    store_job_id: int = 0  # 0: nothing to store
    store_keys: list[bytes] = field(default_factory=list)
    store_block_ids: list[int] = field(default_factory=list)
    store_req_ids: list[str] = field(default_factory=list)  # requests whose blocks the job reads
    # For KV events (only when the daemon publishes them): each stored block's tokens and parent key.
    store_tokens: bytes = b""
    store_parents: bytes = b""
    # Finished requests the scheduler keeps allocated until every worker says their stores are done.
    await_stores: list[str] = field(default_factory=list)
    # Requests preempted this step: their blocks may be reused by this very step's forward.
    preempted: list[str] = field(default_factory=list)
    # Store jobs reading sliding-window blocks vLLM freed this step (out of the window, or at a finish):
    # fenced like a preemption's, since the freed blocks may be rewritten by this step's forward.
    fence_jobs: list[int] = field(default_factory=list)


@dataclass
class KvoffdWorkerMeta(KVConnectorWorkerMetadata):
    """Workers -> scheduler, summed over workers: which store jobs finished, which loads failed where."""

    stores_done: dict[int, int] = field(default_factory=dict)  # job id -> workers that finished it
    stores_failed: dict[int, int] = field(default_factory=dict)  # job id -> workers where part failed
    load_failed_at: dict[str, int] = field(default_factory=dict)  # req id -> first failed block index
    # Same-step loads: job id -> workers on which the daemon can no longer write the job's blocks (its
    # notice came, in time or late, or its daemon is gone); how many waits ran out; bytes and wall
    # time of those that ended in time (the measured link speed).
    sync_settled: dict[int, int] = field(default_factory=dict)
    sync_timeouts: int = 0
    sync_bytes: int = 0
    sync_us: int = 0

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvoffdWorkerMeta)
        for j, n in other.sync_settled.items():
            self.sync_settled[j] = self.sync_settled.get(j, 0) + n
        self.sync_timeouts += other.sync_timeouts
        self.sync_bytes += other.sync_bytes
        self.sync_us += other.sync_us
        for j, n in other.stores_done.items():
            self.stores_done[j] = self.stores_done.get(j, 0) + n
        for j, n in other.stores_failed.items():
            self.stores_failed[j] = self.stores_failed.get(j, 0) + n
        for r, i in other.load_failed_at.items():
            self.load_failed_at[r] = min(i, self.load_failed_at.get(r, i))
        return self

    def is_empty(self) -> bool:
        return not (self.stores_done or self.stores_failed or self.load_failed_at or self.sync_settled
                    or self.sync_timeouts or self.sync_bytes)
