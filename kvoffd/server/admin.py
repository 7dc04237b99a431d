"""Operators' requests (STATS, CLEAR, EXPLAIN) and the live state /metrics reads at scrape time.

Nothing here is on the serving path. It reads the sessions, the jobs and the keyspace
(kvoffd/cache/keyspace.py), and changes only what CLEAR removes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

from kvoffd.cache.keyspace import Keyspace
from kvoffd.metrics import Metrics
from kvoffd.server.jobs import Jobs
from kvoffd.server.limits import MAX_EXPLAIN_KEYS
from kvoffd.server.sessions import Conn, Sessions
from kvoffd_client import protocol as P
from kvoffd_client.protocol import DropReason, ErrorCode, ProtocolError

log = logging.getLogger(__name__)


class Admin:
    """``describe_daemon`` gives the STATS reply's ``daemon`` section (the server's own facts: ids,
    addresses, backends, descriptors), so this module needs nothing of the loop."""

    def __init__(self, *, sessions: Sessions, jobs: Jobs, keyspace: Keyspace, metrics: Metrics,
                 describe_daemon: Callable[[], dict[str, Any]]) -> None:
        self.sessions = sessions
        self.jobs = jobs
        self.keyspace = keyspace
        self.metrics = metrics
        self.describe_daemon = describe_daemon

    def clear(self, conn: Conn, msg: P.Clear) -> P.Message:
        """Every tier forgets the namespace (or all): the pool's blocks are the reply's
        ``removed_blocks``, each tier's below it ``removed_tier_blocks`` (a block may be in both: the
        disk keeps its copy of a block promoted back into the pool). A namespace only a tier knows
        (blocks on disk from before a restart, no engine since) is cleared there."""
        engines = self.sessions.engines.values()
        in_flight = sum(1 for e in engines if not msg.namespace or e.namespace == msg.namespace
                        for _ in range(e.mapped.in_flight))
        removed, below = self.keyspace.clear(msg.namespace, in_use={e.namespace for e in engines})
        log.info("cleared %s: %d blocks removed from the pool%s, %d jobs in flight", msg.namespace or "all namespaces",
                 removed, "".join(f", {n} from {name}" for name, n in below.items()), in_flight)
        return P.Cleared(seq=msg.seq, removed_blocks=removed, in_flight_jobs=in_flight,
                         removed_tier_blocks=below)

    def explain(self, conn: Conn, msg: P.Explain) -> P.Message:
        if P.count_keys(msg.keys) > MAX_EXPLAIN_KEYS:  # ~100 bytes of reply per key
            raise ProtocolError(ErrorCode.TOO_MANY, f"EXPLAIN of {P.count_keys(msg.keys)} keys; at most "
                                f"{MAX_EXPLAIN_KEYS}", seq=msg.seq)
        return P.Explained(seq=msg.seq, entries=self.keyspace.explain(msg.namespace, P.split_keys(msg.keys)))

    def stats_request(self, conn: Conn, msg: P.Stats) -> P.Message:
        return P.StatsResult(seq=msg.seq, stats=self.stats())

    def live_state(self) -> dict[str, Any]:
        """What the /metrics collector reads at scrape time (kvoffd/metrics.py)."""
        counts, oldest = self.jobs.in_flight()
        return {**self.keyspace.live_state(), "engines": len(self.sessions.engines),
                "leases": len(self.sessions.leases), "in_flight": counts, "oldest_in_flight_s": oldest}

    def tier_stats(self) -> list[dict[str, Any]]:
        """Per tier (the pool first): ``kvoffctl status`` and the metrics collector read this."""
        return self.keyspace.tier_stats(self.metrics.lookup.hit_blocks)

    def stats(self) -> dict[str, Any]:
        m = self.metrics
        counts, oldest = self.jobs.in_flight()
        tiers = self.tier_stats()

        def c(counter, *labels) -> int:
            return (counter.labels(*labels) if labels else counter).value

        ks = self.keyspace
        return {
            "daemon": self.describe_daemon(),
            **ks.stats(),  # pool, verify, persistence, eviction_policy
            "counters": {
                "lookups": m.lookup.lookups, "lookup_hit_blocks": m.lookup.hit_blocks,
                "lookup_miss_blocks": m.lookup.miss_blocks, "stored_blocks": c(m.stored_blocks),
                "store_noop_blocks": c(m.store_noop_blocks), "loaded_blocks": c(m.loaded_blocks),
                "store_bytes": c(m.transfer_bytes, "store"), "load_bytes": c(m.transfer_bytes, "load"),
                "evicted_blocks": ks.evictions,  # every eviction, whatever needed the room
                "promoted_blocks": sum(t.get("promotions", 0) for t in tiers),
                "cross_numa_load_blocks": c(m.cross_numa_loads),
                "admission_refused_blocks": c(m.admission_refused),
                "dropped_stores": sum(c(m.dropped_stores, r.value) for r in DropReason),
                "errors": sum(c(m.errors, code.value) for code in ErrorCode),
            },
            "resident_blocks": ks.resident,
            "leases": len(self.sessions.leases),
            "engines": [e.describe() for e in self.sessions.engines.values()],
            "namespaces": ks.namespace_stats(),
            "tiers": tiers,
            "in_flight_jobs": counts["store"] + counts["load"],
            "oldest_in_flight_s": round(oldest, 6),
        }
