"""The connector's counters (``STAT_KEYS``): per interval for vLLM's "KV Transfer metrics" log line
(``KvoffdStats``), and on vLLM's /metrics (``KvoffdPromMetrics``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorPromMetrics, KVConnectorStats

#: Counters the connector keeps; every one is a sum over the interval and over workers.
STAT_KEYS = (
    # scheduler side
    "lookups",  # LOOKUP messages sent
    "lookup_timeouts",  # lookups that became misses because no answer came in time
    "lookup_waits",  # lookup replies an idle engine waited for instead of running an empty step
    "lookup_wait_us",  # time those waits took, summed
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
    "layerwise_load_jobs",  # same-step loads the forward waited for layer by layer (in sync_load_jobs too)
    "layerwise_unwaited",  # layer-wise loads whose forward ran no per-layer hook: recomputed, then whole loads
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
