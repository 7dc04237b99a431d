"""Every Prometheus metric of the daemon, in one place, on a registry owned by the daemon.

Counters exist at zero from start (every label value is touched at construction) so dashboards and
alerts never see a series appear out of nowhere. Gauges that mirror live state (pool bytes, engines,
in-flight age) are read at scrape time by a collector, so they can never drift from the truth.
docs/metrics.md documents each one.
"""

from __future__ import annotations

import bisect
import threading
from collections.abc import Callable, Iterable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, Info, disable_created_metrics
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector

from kvoffd_client.protocol import PROTOCOL_VERSION, DropReason, ErrorCode, MissReason

DIRECTIONS = ("store", "load")
MISS_REASONS = tuple(r.value for r in MissReason)
DROP_REASONS = tuple(r.value for r in DropReason)
POOL_STATES = ("capacity", "used", "pinned", "free_chunks", "total")

_SECONDS_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0,
                    2.5, 5.0, 10.0)
_BLOCK_BUCKETS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)


class _LiveState(Collector):
    def __init__(self, read: Callable[[], dict[str, Any]]):
        self._read = read

    def collect(self) -> Iterable[GaugeMetricFamily]:
        s = self._read()
        pool = GaugeMetricFamily("kvoffd_pool_bytes", "Pool bytes by state: capacity (usable now), used, "
                                 "pinned, free_chunks (largest allocation possible without eviction), total",
                                 labels=["state"])
        for state in POOL_STATES:
            pool.add_metric([state], s["pool"][state])
        yield pool
        yield GaugeMetricFamily("kvoffd_engines", "Engine workers registered now", value=s["engines"])
        yield GaugeMetricFamily("kvoffd_leases", "Lookup leases holding blocks now", value=s["leases"])
        yield GaugeMetricFamily("kvoffd_resident_blocks", "Blocks resident and visible in the pool",
                                value=s["resident_blocks"])
        # the index's own count, read here: every eviction, whatever needed the room (a STORE, a
        # promotion from a lower tier, the reserve kept ahead for spills, a chunk for another block size)
        yield CounterMetricFamily("kvoffd_evicted_blocks", "Blocks evicted from the pool to make room (the "
                                  "dram tier's evictions)", value=s.get("evicted_blocks", 0))
        backlog = s.get("checksum_backlog") or {}
        yield GaugeMetricFamily("kvoffd_checksum_backlog_blocks", "Blocks committed to the pool file whose "
                                "checksum is not in their record yet (kept across a crash all the same)",
                                value=backlog.get("blocks", 0))
        yield GaugeMetricFamily("kvoffd_checksum_backlog_bytes", "Bytes of those blocks",
                                value=backlog.get("bytes", 0))
        yield GaugeMetricFamily("kvoffd_checksum_backlog_oldest_seconds", "How long the oldest of those blocks "
                                "has waited for its checksum", value=backlog.get("oldest_s", 0.0))
        inflight = GaugeMetricFamily("kvoffd_in_flight_jobs", "Store/load jobs running now", labels=["direction"])
        for d in DIRECTIONS:
            inflight.add_metric([d], s["in_flight"][d])
        yield inflight
        yield GaugeMetricFamily("kvoffd_oldest_in_flight_seconds",
                                "Age of the oldest running job (a stuck transfer shows here)",
                                value=s["oldest_in_flight_s"])
        shard_bytes = GaugeMetricFamily("kvoffd_pool_shard_bytes", "Pool bytes per NUMA shard: capacity (usable "
                                        "now) and used", labels=["shard", "node", "state"])
        spills = CounterMetricFamily("kvoffd_pool_shard_spilled_slots", "Slots a STORE placed on another shard "
                                     "than its engine's, that one being full (by the engine's shard)",
                                     labels=["shard", "node"])
        for sh in s.get("shards", ()):
            labels = [str(sh["shard"]), str(sh["node"])]
            shard_bytes.add_metric([*labels, "capacity"], sh["capacity_bytes"])
            shard_bytes.add_metric([*labels, "used"], sh["used_bytes"])
            spills.add_metric(labels, sh["spilled_slots"])
        yield shard_bytes
        yield spills


_TIER_COUNTERS = (  # TierStats field, metric name, help
    ("hits", "kvoffd_tier_hits", "Blocks a LOOKUP found in this tier (the pool: its leading hits; a lower tier: "
     "the blocks past them it promotes)"),
    ("promotions", "kvoffd_tier_promotions", "Blocks read back from this tier into the pool, verified"),
    ("promotion_failures", "kvoffd_tier_promotion_failures", "Promotions that failed (I/O error, short read, "
     "checksum): those blocks were misses"),
    ("spills", "kvoffd_tier_spills", "Blocks written to this tier as they left the pool"),
    ("evictions", "kvoffd_tier_evictions", "Blocks this tier dropped to make room"),
    ("admissions_refused", "kvoffd_tier_admissions_refused", "Blocks the tier's admission rule refused"),
    ("io_errors", "kvoffd_tier_io_errors", "Failed reads and writes (each a miss or a dropped spill)"),
    ("checksum_failures", "kvoffd_tier_checksum_failures", "Blocks whose bytes failed their checksum on read"),
    ("read_bytes", "kvoffd_tier_read_bytes", "Bytes read from this tier"),
    ("write_bytes", "kvoffd_tier_write_bytes", "Bytes written to this tier"),
    ("staged_hits", "kvoffd_tier_staged_hits", "Promotions served from a spill still in flight (copied back "
     "from its pool slot, no read); included in promotions"),
    ("spill_copies", "kvoffd_tier_spill_copies", "Evicted blocks copied out on the event loop before their "
     "spill (a STORE needing more slots than the reserve evicted ahead)"),
    ("promotions_no_room", "kvoffd_tier_promotions_no_room", "Blocks a LOOKUP answered as hits in this tier "
     "before their promotion that were then not promoted: no pool slot was found, or the tier's fingerprint "
     "matched a block it does not hold (the LOAD fails them); the daemon answers first only when the pool "
     "surely has the slots, and a false match is about 16 in 2^31 absent keys, so this stays 0"),
)
_TIER_GAUGES = (
    ("resident_bytes", "kvoffd_tier_resident_bytes", "Bytes of blocks held by this tier"),
    ("resident_blocks", "kvoffd_tier_resident_blocks", "Blocks held by this tier"),
    ("capacity_bytes", "kvoffd_tier_capacity_bytes", "Bytes this tier may hold"),
    ("index_bytes", "kvoffd_tier_index_bytes", "Memory of this tier's index"),
    ("spill_deferred_bytes", "kvoffd_tier_spill_deferred_bytes", "Pool bytes kept out of the pool until the "
     "spills reading them are written"),
    ("spills_in_flight", "kvoffd_tier_spills_in_flight", "Blocks whose spill to this tier is being written (a "
     "disk slower than the evictions: it grows, up to the spill budget)"),
)
SPILL_DROP_REASONS = ("full", "busy", "error", "corrupt")


class _TierState(Collector):
    """Per-tier figures (the pool is tier "dram"), read from the daemon at scrape time."""

    def __init__(self, read: Callable[[], list[dict[str, Any]]]):
        self._read = read

    def describe(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        return self._families([])  # the names only: registration must not read the daemon

    def collect(self) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        return self._families([t for t in self._read() if not t.get("disabled")])

    @staticmethod
    def _families(tiers: list[dict[str, Any]]) -> Iterable[CounterMetricFamily | GaugeMetricFamily]:
        for key, name, help_ in _TIER_COUNTERS:
            fam = CounterMetricFamily(name, help_, labels=["tier"])
            for t in tiers:
                fam.add_metric([t["name"]], t.get(key, 0))
            yield fam
        for key, name, help_ in _TIER_GAUGES:
            fam = GaugeMetricFamily(name, help_, labels=["tier"])
            for t in tiers:
                fam.add_metric([t["name"]], t.get(key, 0))
            yield fam
        fam = CounterMetricFamily("kvoffd_tier_spills_dropped", "Blocks not spilled to this tier, by reason (full: "
                                  "no room or ENOSPC; busy: too many spills in flight; error: I/O error; corrupt: "
                                  "an adopted block that failed its checksum)",
                                  labels=["tier", "reason"])
        for t in tiers:  # the pool too (zero: it spills to the tier below it): every tier has every series
            for r in SPILL_DROP_REASONS:
                fam.add_metric([t["name"], r], t.get("spills_dropped", {}).get(r, 0))
        yield fam


class LatencyTally:
    """A latency histogram as plain bucket counts, observed once per batch (a probe, a fetch, a publish of
    many blocks) on the thread that ran it, exported at scrape time by ``_RemoteState``."""

    __slots__ = ("bounds", "counts", "sum", "_lock")

    def __init__(self, bounds: tuple[float, ...] = _SECONDS_BUCKETS):
        self.bounds = bounds
        self.counts = [0] * (len(bounds) + 1)  # the last: over the largest bound
        self.sum = 0.0
        self._lock = threading.Lock()

    def observe(self, seconds: float) -> None:
        i = bisect.bisect_left(self.bounds, seconds)
        with self._lock:
            self.counts[i] += 1
            self.sum += seconds

    def snapshot(self) -> tuple[list[tuple[str, int]], float]:
        """Cumulative (le, count) pairs, +Inf last, and the sum."""
        with self._lock:
            counts, total = list(self.counts), self.sum
        out, acc = [], 0
        for b, c in zip([*map(str, self.bounds), "+Inf"], counts, strict=True):
            acc += c
            out.append((b, acc))
        return out, total


REMOTE_OPS = ("probe", "fetch", "publish")
REMOTE_ERRORS = ("timeout", "auth", "oom", "verify", "connect", "server")
REMOTE_PUBLISH_DROPS = ("queue_full", "held_share")
REMOTE_PUBLISH_SKIPS = ("known", "present")
BREAKER_STATES = ("closed", "open", "half_open")


class _RemoteState(Collector):
    """The cluster tier's own figures (``--remote``), read at scrape time from the ``remote`` entry of its
    tier dict; without --remote every family is there with no series."""

    def __init__(self, read: Callable[[], list[dict[str, Any]]]):
        self._read = read

    def describe(self) -> Iterable[Any]:
        return self._families({})

    def collect(self) -> Iterable[Any]:
        r = next((t["remote"] for t in self._read() if t.get("remote")), {})
        return self._families(r)

    @staticmethod
    def _families(r: dict[str, Any]) -> Iterable[Any]:
        def counter(name: str, help_: str, key: str) -> CounterMetricFamily:
            fam = CounterMetricFamily(name, help_, labels=[])
            if r:
                fam.add_metric([], r.get(key, 0))
            return fam

        def by(name: str, help_: str, label: str, key: str, values: Iterable[str]) -> CounterMetricFamily:
            fam = CounterMetricFamily(name, help_, labels=[label])
            for v in values if r else ():
                fam.add_metric([v], r.get(key, {}).get(v, 0))
            return fam
        yield counter("kvoffd_remote_probes", "EXISTS batches sent to the cluster for keys no local tier holds",
                      "probes")
        yield counter("kvoffd_remote_probed_blocks", "Keys those probes asked about", "probed_blocks")
        yield counter("kvoffd_remote_probes_dropped", "LOOKUP misses not asked about: too many probes in flight",
                      "probes_dropped")
        yield by("kvoffd_remote_errors", "Failed cluster calls and refused values, by kind", "kind", "errors",
                 REMOTE_ERRORS)
        yield by("kvoffd_remote_publish_dropped", "Admitted blocks not written behind, by reason (queue_full: the "
                 "oldest of a full queue; held_share: the pool share held for publishing was full, published "
                 "when evicted instead)", "reason", "publish_dropped", REMOTE_PUBLISH_DROPS)
        yield by("kvoffd_remote_publish_skipped", "Blocks not written because the cluster held them (known: this "
                 "node knew it; present: the cluster said so)", "reason", "publish_skipped", REMOTE_PUBLISH_SKIPS)
        queue = GaugeMetricFamily("kvoffd_remote_publish_queue_blocks", "Blocks waiting in the write-behind queue "
                                  "now, and its capacity", labels=["state"])
        if r:
            queue.add_metric(["queued"], r.get("queued", 0))
            queue.add_metric(["capacity"], r.get("queue_capacity", 0))
        yield queue
        breaker = GaugeMetricFamily("kvoffd_remote_breaker_state", "Each shard's circuit breaker: 1 for its "
                                    "state now, 0 for the others", labels=["shard", "state"])
        for shard, state in sorted(r.get("breakers", {}).items()):
            for s in BREAKER_STATES:
                breaker.add_metric([shard, s], 1 if s == state else 0)
        yield breaker
        hist = HistogramMetricFamily("kvoffd_remote_seconds", "Latency of one cluster call over a batch of "
                                     "blocks, by operation (probe: EXISTS, fetch: GET into pool slots, verified; "
                                     "publish: SET)", labels=["op"])
        for op, snap in r.get("latency", {}).items():
            buckets, total = snap
            hist.add_metric([op], buckets, total)
        yield hist


class LookupCounts:
    """LOOKUP's counters as plain integers, exported at scrape time by ``_LookupCounters``: every
    engine step looks up, and a prometheus_client ``inc()`` takes a lock (about 1 µs each)."""

    __slots__ = ("lookups", "hit_blocks", "miss_blocks")

    def __init__(self) -> None:
        self.lookups = self.hit_blocks = self.miss_blocks = 0


class _LookupCounters(Collector):
    def __init__(self, counts: LookupCounts):
        self._c = counts

    def collect(self) -> Iterable[CounterMetricFamily]:
        c = self._c
        yield CounterMetricFamily("kvoffd_lookups", "LOOKUP requests answered", value=c.lookups)
        blocks = CounterMetricFamily("kvoffd_lookup_blocks", "Blocks asked for by LOOKUP, by result (hit: found "
                                     "resident when asked, not necessarily loaded; see kvoffd_loaded_blocks_total)",
                                     labels=["result"])
        blocks.add_metric(["hit"], c.hit_blocks)
        blocks.add_metric(["miss"], c.miss_blocks)
        yield blocks


class Tally:
    """A counter as a plain integer: what STATS reports (``value``) is what a scrape exports
    (``_Tallies``), without reading prometheus_client's private state. ``inc`` is thread-safe (the
    KV-event counters are counted by the event loop and by the publisher thread)."""

    __slots__ = ("value", "_lock")

    def __init__(self) -> None:
        self.value = 0
        self._lock = threading.Lock()

    def inc(self, n: int = 1) -> None:
        with self._lock:
            self.value += n


class LabeledTally:
    """One ``Tally`` per value of one label; the values named at construction exist from the start (at
    0), so a query never sees their series appear."""

    def __init__(self, values: Iterable[str]):
        self._by: dict[str, Tally] = {v: Tally() for v in values}

    def labels(self, value: str) -> Tally:
        t = self._by.get(value)
        return t if t is not None else self._by.setdefault(value, Tally())

    def items(self) -> list[tuple[str, Tally]]:
        return list(self._by.items())


class _Tallies(Collector):
    """The tallies' counter series, read at scrape time: rows of (name, help, label, tally)."""

    def __init__(self) -> None:
        self._rows: list[tuple[str, str, str | None, Tally | LabeledTally]] = []

    def count(self, name: str, help_: str) -> Tally:
        t = Tally()
        self._rows.append((name, help_, None, t))
        return t

    def count_by(self, name: str, help_: str, label: str, values: Iterable[str]) -> LabeledTally:
        t = LabeledTally(values)
        self._rows.append((name, help_, label, t))
        return t

    def collect(self) -> Iterable[CounterMetricFamily]:
        for name, help_, label, t in self._rows:
            if isinstance(t, Tally):
                yield CounterMetricFamily(name, help_, value=t.value)
                continue
            fam = CounterMetricFamily(name, help_, labels=[label])
            for value, one in t.items():
                fam.add_metric([value], one.value)
            yield fam


class Metrics:
    def __init__(self, version: str, read_state: Callable[[], dict[str, Any]] | None = None):
        # no *_created series: they double the series count and kvoffd_start_time_seconds says it once
        disable_created_metrics()
        r = self.registry = CollectorRegistry(auto_describe=True)
        self.lookup = LookupCounts()
        r.register(_LookupCounters(self.lookup))
        tallies = _Tallies()  # the counters STATS reads too
        self._block_series(r, tallies)
        self._job_series(r, tallies)
        self._daemon_series(r, tallies, version)
        r.register(tallies)  # once every row is there: registration reads their names
        self._label_every_series()
        if read_state is not None:
            self.watch_live_state(read_state)

    def _block_series(self, r: CollectorRegistry, tallies: _Tallies) -> None:
        """What happened to blocks: missed, stored, loaded, refused, dropped (evicted: ``_LiveState``)."""
        self.misses = Counter("kvoffd_misses", "Missed blocks by the reason of the first miss in the lookup",
                              ["reason"], registry=r)
        self.stored_blocks = tallies.count("kvoffd_stored_blocks", "Blocks copied into the pool")
        self.store_noop_blocks = tallies.count("kvoffd_store_noop_blocks",
                                               "Blocks a STORE named that were already resident (no copy)")
        self.loaded_blocks = tallies.count("kvoffd_loaded_blocks", "Blocks copied back into an engine: the hits "
                                           "served")
        self.cross_numa_loads = tallies.count("kvoffd_cross_numa_loads", "Blocks a LOAD read from a pool shard on "
                                              "another NUMA node than the engine's (a sharded pool only)")
        self.admission_refused = tallies.count("kvoffd_admission_refused_blocks", "New blocks of a STORE the "
                                               "admission policy refused (--eviction-policy): not stored, not copied")
        self.dropped_stores = tallies.count_by("kvoffd_dropped_stores", "Blocks a STORE could not keep, by reason",
                                               "reason", DROP_REASONS)

    def _job_series(self, r: CollectorRegistry, tallies: _Tallies) -> None:
        """How copies went: bytes, latency, sizes, speed, failures, expiries."""
        self.transfer_bytes = tallies.count_by("kvoffd_transfer_bytes", "Bytes moved, by direction", "direction",
                                               DIRECTIONS)
        self.transfer_seconds = Histogram("kvoffd_transfer_seconds", "Job latency from accepted to complete",
                                          ["direction"], buckets=_SECONDS_BUCKETS, registry=r)
        self.transfer_blocks = Histogram("kvoffd_transfer_blocks", "Blocks per job", ["direction"],
                                         buckets=_BLOCK_BUCKETS, registry=r)
        self.transfer_gbps = Gauge("kvoffd_transfer_gbps", "Achieved GB/s of the last job of >= 1 MiB",
                                   ["direction"], registry=r)
        self.link_ceiling_gbps = Gauge("kvoffd_link_ceiling_gbps",
                                       "Host<->device copy ceiling measured at start (0: not measured)",
                                       ["direction"], registry=r)
        self.failed_jobs = Counter("kvoffd_failed_jobs", "Jobs whose copy failed", ["direction"], registry=r)
        self.checksum_failures = Counter("kvoffd_checksum_failures", "Blocks whose checksum did not match on "
                                         "load (--verify); each is reported failed so the engine recomputes",
                                         registry=r)
        self.expired_jobs = Counter("kvoffd_expired_jobs", "Jobs not started by their deadline: refused on arrival "
                                    "or stopped where their copy was to start (backlog or stalled daemon)",
                                    registry=r)

    def _daemon_series(self, r: CollectorRegistry, tallies: _Tallies, version: str) -> None:
        """The daemon itself: errors, engines, KV events, start time, build."""
        self.errors = tallies.count_by("kvoffd_errors", "ERROR replies, by code", "code", [c.value for c in ErrorCode])
        self.engine_events = Counter("kvoffd_engine_events", "Engine registrations and departures",
                                     ["event"], registry=r)
        self.kv_events_published = tallies.count("kvoffd_kv_events_published", "KV events (BlockStored, "
                                                 "BlockRemoved, AllBlocksCleared) sent on --kv-events-address")
        self.kv_events_dropped = tallies.count("kvoffd_kv_events_dropped", "KV events dropped before sending: the "
                                               "publisher thread was behind and its queue full")
        self.kv_events_connections = Gauge("kvoffd_kv_events_connections", "Connections to the KV-event "
                                           "endpoints now, by socket (publish, replay), held by the outlet "
                                           "process", ["socket"], registry=r)
        self.kv_events_refused = Counter("kvoffd_kv_events_refused_connections", "Connections to the KV-event "
                                         "endpoints closed at once: the outlet's descriptor budget was tight",
                                         registry=r)
        self.kv_events_denied = Counter("kvoffd_kv_events_denied_handshakes", "CURVE handshakes the KV-event "
                                        "endpoints refused: a client key not in the allowed directory", registry=r)
        self.kv_events_replays_dropped = Counter("kvoffd_kv_events_replays_dropped", "Replay requests not "
                                                 "answered in full: too many waiting, or a peer that read nothing "
                                                 "for 10 s", registry=r)
        self.kv_events_outlet_restarts = Counter("kvoffd_kv_events_outlet_restarts", "KV-event outlet processes "
                                                 "started again after the previous one died", registry=r)
        self.start_time = Gauge("kvoffd_start_time_seconds", "When this daemon started (unix time): a change "
                                "means a restart, and the cache it held is gone", registry=r)
        self.start_time.set_to_current_time()
        self.build = Info("kvoffd_build", "Build information", registry=r)
        self.build.info({"version": version, "protocol": str(PROTOCOL_VERSION)})

    def _label_every_series(self) -> None:
        """Every label value exists from the start (at 0), so a query never sees a series appear."""
        for reason in MISS_REASONS:
            self.misses.labels(reason)
        for d in DIRECTIONS:
            self.transfer_seconds.labels(d)
            self.transfer_blocks.labels(d)
            self.transfer_gbps.labels(d)
            self.link_ceiling_gbps.labels(d)
            self.failed_jobs.labels(d)
        for ev in ("registered", "unregistered", "disconnected", "timed_out"):
            self.engine_events.labels(ev)
        for sock in ("publish", "replay"):
            self.kv_events_connections.labels(sock)

    def watch_live_state(self, read_state: Callable[[], dict[str, Any]]) -> None:
        """Export the gauges ``read_state`` gives at each scrape (the server calls it once it has the
        objects that state lives in, which themselves count into this registry)."""
        self.registry.register(_LiveState(read_state))

    def watch_tiers(self, read_tiers: Callable[[], list[dict[str, Any]]]) -> None:
        """Export the per-tier figures ``read_tiers`` gives at each scrape (the pool is tier "dram"), and the
        cluster tier's own (its dict's ``remote`` entry)."""
        self.registry.register(_TierState(read_tiers))
        self.registry.register(_RemoteState(read_tiers))
