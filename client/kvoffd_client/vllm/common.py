"""What the two connector roles share: settings, the per-step metadata, worker results, stats.

Everything crossing a process boundary here (scheduler -> workers every step, workers -> scheduler
every step) is a small picklable dataclass of plain lists: block ids, 32-byte keys, job ids.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorMetadata,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

# A child of vLLM's logger, so our lines use vLLM's handler, format and level.
log = logging.getLogger("vllm.kvoffd")


class _ThroughVllm(logging.Handler):
    """Hands a record to vLLM's logger, to whatever handlers it has when the record is made (vLLM
    may configure its logging again after this module is imported)."""

    def emit(self, record: logging.LogRecord) -> None:
        logging.getLogger("vllm").handle(record)


def route_client_logs() -> None:
    """The client library (kvoffd_client.client: link down, back, "kvoffd restarted") logs to its
    own ``kvoffd_client`` logger, since it cannot import vLLM. Without a handler those lines came
    out bare, without vLLM's timestamp, level and process. Inside vLLM they go through vLLM's
    logger, at its level. Called by the connector's constructor: vLLM configures its logging in
    each process before it builds the connector (not at import). Nothing changes where vLLM
    leaves logging alone (VLLM_CONFIGURE_LOGGING=0: no handlers): the lines propagate to the root
    logger as before."""
    vllm_log = logging.getLogger("vllm")
    client = logging.getLogger("kvoffd_client")
    if not vllm_log.handlers or any(isinstance(h, _ThroughVllm) for h in client.handlers):
        return
    client.addHandler(_ThroughVllm())
    client.setLevel(vllm_log.getEffectiveLevel())
    client.propagate = False



@dataclass(frozen=True)
class Settings:
    """``kv_connector_extra_config`` keys (docs/vllm.md lists them). Only the address is required."""

    address: str
    lease_ms: int = 30_000  # how long a lookup's hits stay pinned waiting for their LOAD
    lookup_timeout_ms: int = 500  # an unanswered lookup becomes a miss after this
    job_timeout_s: float = 10.0  # the daemon never starts a LOAD/STORE (or its rest) later than this
    fence_timeout_s: float = 10.0  # a preemption fence still waiting logs an error this often
    connect_timeout_s: float = 0.5  # handshake wait at engine start (absent daemon: serve without)
    store_decode: bool = True  # also offload blocks filled by generated tokens, not only the prompt
    prefetch_lookups: bool = True  # send the lookup when the request arrives, not when it is scheduled
    max_prefetch: int = 64  # most arrival-time lookups (and so leases) outstanding at once
    known_ttl_s: float = 30.0  # a block the daemon confirmed holding is not re-sent for this long
    negative_ttl_s: float = 60.0  # keys whose load failed are misses this long (or until stored again)
    reset_clears_namespace: bool = False  # reset_prefix_cache(reset_connector=True) also empties the namespace
    kv_cache_layout: str | None = None  # ask vLLM for this KV layout (CUDA; ignored where unsupported)
    weights_version: str | None = None  # names the weights in the namespace: blocks of other weights never hit
    # Same-step loads (kvoffd_client.vllm.syncload): hits of at most this many bytes per rank and step
    # are loaded within the step that computes the rest of the prompt. -1: link speed x sync_step_ms.
    sync_load_bytes: int = -1  # 0: every load asynchronous (one extra engine step per hit)
    sync_step_ms: float = 2.0  # the step time a same-step load may add (for the derived budget)
    link_gbps: float = 0.0  # GB/s for the derived budget; 0: measured from same-step loads
    sync_load_timeout_ms: int = 200  # a same-step load not done by then is recomputed (vLLM's load-error path)

    @classmethod
    def from_extra(cls, extra: dict[str, Any] | None) -> Settings:
        extra = dict(extra or {})
        address = extra.get("kvoffd_address")
        if not address or not isinstance(address, str):
            raise ValueError(
                "KvoffdConnector needs kv_connector_extra_config.kvoffd_address, e.g. "
                '{"kvoffd_address": "ipc:///run/kvoffd/kvoffd.sock"}'
            )
        kw: dict[str, Any] = {}
        for f in cls.__dataclass_fields__.values():
            if f.name == "address":
                continue
            key = f"kvoffd_{f.name}"
            if key in extra:
                default = getattr(cls, f.name)
                v = extra[key]
                if isinstance(default, bool):
                    v = v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes", "on")
                elif isinstance(default, int):
                    v = int(v)
                elif isinstance(default, float):
                    v = float(v)
                kw[f.name] = v
        unknown = sorted(k for k in extra if k.startswith("kvoffd_") and k[7:] not in cls.__dataclass_fields__)
        if unknown:
            log.warning("kvoffd: ignoring unknown kv_connector_extra_config keys %s", unknown)
        return cls(address=address, **kw)


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


#: Counters the connector keeps; every one is a sum over the interval and over workers.
STAT_KEYS = (
    # scheduler side
    "lookups",  # LOOKUP messages sent
    "lookup_timeouts",  # lookups that became misses because no answer came in time
    "lookup_hit_blocks",  # blocks offered to vLLM as external hits
    "sync_offers",  # hits offered to be loaded within the step (the rest: asynchronously)
    "lookup_miss_blocks",  # blocks asked about that were not offered
    "leases_released",  # leases dropped without a load
    "delayed_frees",  # finished requests held until their stores were acknowledged
    # worker side
    "store_jobs",
    "store_blocks",
    "store_failed_blocks",
    "store_dropped_jobs",  # could not be sent (daemon unreachable)
    "load_jobs",
    "load_blocks",
    "load_failed_jobs",
    "sync_load_jobs",  # loads waited for within their step (also counted in load_jobs)
    "sync_load_wait_us",  # time those waits took, summed
    "sync_load_timeouts",  # waits that ran out: the blocks were recomputed
    "fence_waits",  # preemptions that had to wait for in-flight stores
    "fence_wait_us",
    "fence_timeouts",  # fences that waited longer than fence_timeout_s (they still waited)
)


@dataclass
class KvoffdStats(KVConnectorStats):
    """Per-interval counters, logged by vLLM as "KV Transfer metrics: ..." (plain-dict payload).

    ``lifetime`` keeps the running totals in the process that counts (tests, bench); it never travels.
    """

    lifetime: dict[str, int] = field(default_factory=dict, repr=False, compare=False)

    def __post_init__(self) -> None:
        for k in STAT_KEYS:
            self.data.setdefault(k, 0)

    def add(self, key: str, n: int = 1) -> None:
        self.data[key] = self.data.get(key, 0) + n
        self.lifetime[key] = self.lifetime.get(key, 0) + n

    def reset(self) -> None:
        self.data = dict.fromkeys(STAT_KEYS, 0)

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            if isinstance(v, (int, float)):
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return {k: v for k, v in self.data.items() if isinstance(v, (int, float)) and v}

    def is_empty(self) -> bool:
        return not any(v for v in self.data.values() if isinstance(v, (int, float)))

    def take(self) -> KvoffdStats | None:
        """This interval's counters (None when nothing happened); the object starts a new interval."""
        if self.is_empty():
            return None
        out = KvoffdStats(data=dict(self.data))
        self.reset()
        return out


class KvoffdPromMetrics(KVConnectorPromMetrics):
    """The same counters on vLLM's /metrics, as ``vllm:kvoffd_<counter>_total`` per engine."""

    def __init__(self, vllm_config: Any, metric_types: dict, labelnames: list[str],
                 per_engine_labelvalues: dict[int, list[object]]):
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: dict[str, dict[int, Any]] = {}
        for key in STAT_KEYS:
            counter = self._counter_cls(name=f"vllm:kvoffd_{key}", documentation=f"KvoffdConnector: {key}",
                                        labelnames=labelnames)
            self._counters[key] = {idx: counter.labels(*vals) for idx, vals in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: dict[str, Any], engine_idx: int = 0) -> None:
        for key, value in transfer_stats_data.items():
            per_engine = self._counters.get(key)
            if per_engine and isinstance(value, (int, float)) and value > 0 and engine_idx in per_engine:
                per_engine[engine_idx].inc(value)
