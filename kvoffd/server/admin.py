"""Operators' requests (STATS, CLEAR, EXPLAIN) and the live state /metrics reads at scrape time.

Nothing here is on the serving path. It reads the sessions, the jobs and the index, and changes only
what CLEAR removes.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from kvoffd.cache.index import Index
from kvoffd.cache.restart.keeper import Keeper
from kvoffd.cache.tiers.manager import Tiers
from kvoffd.metrics import Metrics
from kvoffd.pool.allocator import Pool
from kvoffd.server.jobs import Jobs
from kvoffd.server.limits import MAX_EXPLAIN_KEYS
from kvoffd.server.sessions import Conn, Sessions
from kvoffd_client import protocol as P
from kvoffd_client.protocol import DropReason, ErrorCode, ProtocolError

if TYPE_CHECKING:
    from kvoffd.events.publisher import KvEventPublisher

log = logging.getLogger(__name__)


class Admin:
    """``describe_daemon`` gives the STATS reply's ``daemon`` section (the server's own facts: ids,
    addresses, backends, descriptors), so this module needs nothing of the loop. ``kv_events``
    (--kv-events-address; None: off) hears of each CLEAR of every namespace."""

    def __init__(self, *, sessions: Sessions, jobs: Jobs, index: Index, pool: Pool, metrics: Metrics,
                 verify: bool, eviction_policy: str, persist: Keeper,
                 describe_daemon: Callable[[], dict[str, Any]], kv_events: KvEventPublisher | None = None,
                 tiers: Tiers | None = None) -> None:
        self.sessions = sessions
        self.tiers = tiers if tiers is not None else Tiers(index, [])  # below the pool (none: no tier)
        self.jobs = jobs
        self.index = index
        self.pool = pool
        self.metrics = metrics
        self.verify = verify
        self.eviction_policy = eviction_policy
        self.persist = persist  # the pool file's keeper: STATS' ``persistence`` section
        self.describe_daemon = describe_daemon
        self.kv_events = kv_events

    def clear(self, conn: Conn, msg: P.Clear) -> P.Message:
        """Every tier forgets the namespace (or all): the pool's blocks are the reply's
        ``removed_blocks``, each tier's below it ``removed_tier_blocks`` (a block may be in both: the
        disk keeps its copy of a block promoted back into the pool). A namespace only a tier knows
        (blocks on disk from before a restart, no engine since) is cleared there."""
        engines = self.sessions.engines.values()
        in_flight = sum(1 for e in engines if not msg.namespace or e.namespace == msg.namespace
                        for _ in range(e.mapped.in_flight))
        in_use = {e.namespace for e in engines}
        with self.tiers.clearing(msg.namespace) as below:
            removed = self.index.clear(msg.namespace, in_use=in_use)
        if not msg.namespace and self.kv_events is not None:  # one AllBlocksCleared, not a removal per block
            self.kv_events.all_cleared()
        log.info("cleared %s: %d blocks removed from the pool%s, %d jobs in flight", msg.namespace or "all namespaces",
                 removed, "".join(f", {n} from {name}" for name, n in below.items()), in_flight)
        return P.Cleared(seq=msg.seq, removed_blocks=removed, in_flight_jobs=in_flight,
                         removed_tier_blocks=dict(below))

    def explain(self, conn: Conn, msg: P.Explain) -> P.Message:
        if P.count_keys(msg.keys) > MAX_EXPLAIN_KEYS:  # ~100 bytes of reply per key
            raise ProtocolError(ErrorCode.TOO_MANY, f"EXPLAIN of {P.count_keys(msg.keys)} keys; at most "
                                f"{MAX_EXPLAIN_KEYS}", seq=msg.seq)
        return P.Explained(seq=msg.seq, entries=self.index.explain(msg.namespace, P.split_keys(msg.keys)))

    def stats_request(self, conn: Conn, msg: P.Stats) -> P.Message:
        return P.StatsResult(seq=msg.seq, stats=self.stats())

    def live_state(self) -> dict[str, Any]:
        """What the /metrics collector reads at scrape time (kvoffd/metrics.py)."""
        counts, oldest = self.jobs.in_flight()
        p = self.pool
        kept = self.persist.stats()
        return {"pool": {"capacity": p.capacity_bytes, "used": p.used_bytes, "pinned": p.pinned_bytes,
                         "free_chunks": p.free_chunk_bytes, "total": p.nbytes},
                "checksum_backlog": {"blocks": kept.get("seal_backlog_blocks", 0),
                                     "bytes": kept.get("seal_backlog_bytes", 0),
                                     "oldest_s": kept.get("seal_backlog_oldest_s", 0.0)},
                "engines": len(self.sessions.engines), "leases": len(self.sessions.leases),
                "resident_blocks": self.index.resident, "in_flight": counts, "oldest_in_flight_s": oldest,
                "shards": p.shard_stats(), "evicted_blocks": self.index.evictions}

    def tier_stats(self) -> list[dict[str, Any]]:
        """Per tier (the pool first): ``kvoffctl status`` and the metrics collector read this."""
        disk_hits = sum(self.tiers.hits.values())
        dram = {"name": "dram", "capacity_bytes": self.pool.capacity_bytes, "resident_bytes": self.pool.used_bytes,
                "resident_blocks": self.index.resident, "hits": self.metrics.lookup.hit_blocks - disk_hits,
                "evictions": self.index.evictions, "admissions_refused": self.index.refused}
        out = [dram] + [st.as_dict() for st in self.tiers.stats()]
        if self.tiers.disabled:
            out.append({"name": "disk", "disabled": self.tiers.disabled})
        return out

    def namespace_stats(self) -> list[dict[str, Any]]:
        """Each namespace the pool or a tier holds: the pool's ``blocks``/``bytes`` (as before tiers) and
        ``tiers`` (tier name -> blocks, bytes). One only a tier knows (blocks on disk from before a
        restart, no engine registered since) has 0 in the pool, the world size its tables were written
        with, and no ``replicas``."""
        below = self.tiers.namespace_blocks()
        out = self.index.namespace_stats()
        for n in out:
            n["tiers"] = {name: {"blocks": h.blocks, "bytes": h.bytes}
                          for name, h in below.pop(n["namespace"], {}).items()}
        for ns, held in sorted(below.items()):
            h0 = next(iter(held.values()))
            out.append({"namespace": ns, "world_size": h0.world_size,
                        "ranks": sorted(set().union(*(h.ranks for h in held.values()))), "blocks": 0, "bytes": 0,
                        "tiers": {name: {"blocks": h.blocks, "bytes": h.bytes} for name, h in held.items()}})
        return out

    def stats(self) -> dict[str, Any]:
        m = self.metrics
        counts, oldest = self.jobs.in_flight()
        tiers = self.tier_stats()

        def c(counter, *labels) -> int:
            return int((counter.labels(*labels) if labels else counter)._value.get())

        return {
            "daemon": self.describe_daemon(),
            "pool": {**self.pool.stats(), "base_address": self.pool.base_address},
            "verify": self.verify,
            "persistence": self.persist.stats(),
            "eviction_policy": self.eviction_policy,
            "counters": {
                "lookups": m.lookup.lookups, "lookup_hit_blocks": m.lookup.hit_blocks,
                "lookup_miss_blocks": m.lookup.miss_blocks, "stored_blocks": c(m.stored_blocks),
                "store_noop_blocks": c(m.store_noop_blocks), "loaded_blocks": c(m.loaded_blocks),
                "store_bytes": c(m.transfer_bytes, "store"), "load_bytes": c(m.transfer_bytes, "load"),
                "evicted_blocks": self.index.evictions,  # every eviction, whatever needed the room
                "promoted_blocks": sum(t.get("promotions", 0) for t in tiers),
                "cross_numa_load_blocks": c(m.cross_numa_loads),
                "admission_refused_blocks": c(m.admission_refused),
                "dropped_stores": sum(c(m.dropped_stores, r.value) for r in DropReason),
                "errors": sum(c(m.errors, code.value) for code in ErrorCode),
            },
            "resident_blocks": self.index.resident,
            "leases": len(self.sessions.leases),
            "engines": [e.describe() for e in self.sessions.engines.values()],
            "namespaces": self.namespace_stats(),
            "tiers": tiers,
            "in_flight_jobs": counts["store"] + counts["load"],
            "oldest_in_flight_s": round(oldest, 6),
        }
