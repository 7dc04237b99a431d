"""``Keyspace``: the one cache object the server talks to (Redis's ``db.c``, vLLM's ``OffloadingManager``).

It owns and wires what the cache is made of: the pool and its index (kvoffd/cache/index.py), the pool
file's keeper (warm restart, kvoffd/cache/restart/keeper.py), the tiers below the pool
(kvoffd/cache/tiers/manager.py) and the KV-event mirror (kvoffd/events/publisher.py: built on the floor
above, handed in with ``add_events``). Its verbs keep the index's vocabulary:

* ``lookup`` -> :class:`Answer`: the hits a LOOKUP answers, and ``Answer.after_reply`` for the work
  that follows the reply (promotions from below the pool, the lease's refs). The server keeps only
  the ordering "answer first, then hold";
* ``prepare_store`` / ``add_pending`` / ``complete_store``;
* ``promotions``, ``prepare_load`` / ``complete_load`` (and ``release`` for a lease's refs);
* ``clear``, ``explain`` and the figures (``stats``, ``live_state``, ``tier_stats``).

The order of adoption, tier probing, room checks and promotion is cache policy and lives here: a new
tier changes ``make_tiers`` and this file, never a server module. ``kvoffd/server/`` imports nothing
else of ``kvoffd/cache/``; the plain types it names (``Entry``, ``Table``, ``StorePlan``) come from here.
"""

from __future__ import annotations

import asyncio
import logging
import os
import time
from collections.abc import Collection, Sequence
from typing import Any, Protocol

import numpy as np

from kvoffd.cache.checksum import NONE, block_sum, matches
from kvoffd.cache.entries import Entry, Hits, LoadPlan, StorePlan, Table
from kvoffd.cache.identity import EventIdentity, parse_identity
from kvoffd.cache.index import Index
from kvoffd.cache.policy import RemotePublish
from kvoffd.cache.restart.keeper import Keeper, abandon_pool, keeper, open_pool, purge_command
from kvoffd.cache.tiers.base import TableRef, TierEvents
from kvoffd.cache.tiers.manager import PROMOTE_WAIT_S, Below, Tiers, make_tiers
from kvoffd.cache.tiers.remote.publisher import Publisher
from kvoffd.cache.tiers.remote.tier import RemoteTier
from kvoffd.pool.allocator import Pool
from kvoffd.pool.file import PoolFile
from kvoffd.pool.topology import Topology
from kvoffd_client.protocol import KEY_SIZE, KvEventsLayout, MissReason

__all__ = ["ASK_WAIT_S", "PROMOTE_WAIT_S", "Answer", "Entry", "EventMirror", "Keyspace", "KeyspaceSettings", "StorePlan", "Table",
           "purge_command"]

log = logging.getLogger(__name__)

#: how long a LOOKUP whose misses were asked of a tier other nodes write (--remote) waits for its answer
ASK_WAIT_S = 0.25


class KeyspaceSettings(Protocol):
    """What ``Keyspace.open`` reads of the daemon's configuration (kvoffd/config.py's ``Config`` is one)."""

    pool_size: int
    pool_path: str
    address: str
    cold: bool
    eviction_policy: str
    disk_path: str
    disk_size: int
    disk_policy: str
    verify: bool
    remote: str
    remote_password_file: str
    remote_key_file: str
    remote_write_budget: int
    remote_publish: str
    remote_tls_ca: str
    remote_tls_cert: str
    remote_tls_key: str
    remote_tls_server_name: str


class EventMirror(TierEvents, Protocol):
    """The KV-event publisher as the keyspace drives it (kvoffd/events/publisher.py): an index observer
    that also hears what the index cannot tell it (adopted blocks, identities, a CLEAR of all)."""

    def adopted(self, entries: Sequence[Entry], identities: dict[str, EventIdentity]) -> None: ...

    def set_identity(self, namespace: str, identity: EventIdentity | None) -> None: ...

    def identity(self, namespace: str) -> EventIdentity | None: ...

    def check_described(self, namespace: str, rank: int, n: int, tokens: bytes, parents: bytes) -> bool: ...

    def note_described(self, entries: Sequence[Entry], idx: Sequence[int], tokens: bytes, parents: bytes,
                       block_size: int) -> None: ...

    def all_cleared(self) -> None: ...


class Answer:
    """A LOOKUP's answer: ``n`` leading keys hit (in the pool, or below it with their promotion still
    to do) of a namespace of ``world_size`` ranks. The server replies with ``n``, then calls
    ``after_reply`` once: nothing else runs on the loop in between, so no eviction can take a block
    the answer promised."""

    __slots__ = ("_below", "_hits", "_hold", "_keyspace", "asked", "n", "world_size")

    def __init__(self, keyspace: Keyspace, hits: Hits, below: Below | None, hold: bool) -> None:
        self._keyspace = keyspace
        self._hits = hits
        self._below = below  # blocks below the pool answered before their promotion (``Tiers.fits``)
        self._hold = hold
        self.n = below.n if below is not None else hits.n
        self.world_size = hits.world_size
        #: a tier was asked about the misses (``Keyspace.lookup``): done once it answered. The server then
        #: drops this answer (it took nothing) and looks up again once it is done or ``ASK_WAIT_S`` passed.
        self.asked: asyncio.Future | None = None

    def after_reply(self) -> int:
        """The work that follows the reply: the promotions of the blocks found below the pool, then (a
        lease asked, something hit) one ref on every hit entry. Returns the refs taken."""
        hits = self._hits
        if self._below is not None:
            # The reply is queued for libzmq's I/O thread, which the send just woke, often on this core;
            # the promotion's per-block work (4-9 us a block) would run ahead of it: one yield lets the
            # reply go out first (docs/benchmarks.md).
            os.sched_yield()
            hits = self._hits = self._keyspace.tiers.promote(self._below, answered=True)  # surely room: none short
            self._below = None
        if self._hold and self.n:
            return self._keyspace.index.hold(hits)
        return 0

    @property
    def by_rank(self) -> dict[int, list[Entry]]:
        """The hit entries, rank by rank (a lease holds them; filled only when ``hold`` was asked)."""
        return self._hits.by_rank

    @property
    def miss_reason(self) -> MissReason:
        """Why key ``n`` missed (after ``after_reply``): the index's reason, or ``absent`` past blocks
        answered from below the pool."""
        hits = self._hits
        return (hits.miss_reason if hits.n == self.n else None) or MissReason.ABSENT


class Keyspace:
    """The pool, its index, its keeper, the tiers below it and the KV-event mirror, as one object.
    ``verify`` (--verify): every STORE's slots are summed and every LOAD's checked. ``topology``: the
    host's NUMA nodes the pool's shards sit on (engines are placed by it)."""

    def __init__(self, pool: Pool, index: Index, keeper: Keeper, tiers: Tiers, *, verify: bool = False,
                 topology: Topology | None = None, pool_file: PoolFile | None = None) -> None:
        self.pool = pool
        self.index = index
        self.keeper = keeper
        self.tiers = tiers
        self.verify = verify
        self.topology = topology
        self._pool_file = pool_file  # given back by ``abandon`` if the start fails
        self.events: EventMirror | None = None  # --kv-events-address (None: off)
        self.phases: dict[str, float] = {}  # where opening it took its time (the serving line says it)
        self.remote: RemoteTier | None = None  # --remote: a tier other nodes write too (asked on a miss)
        self.publisher: Publisher | None = None  # --remote: what the pool admits, written behind

    @classmethod
    def open(cls, settings: KeyspaceSettings, topology: Topology | None = None, t0: float | None = None) -> Keyspace:
        """The pool (in its file, or private memory), its index, the previous daemon's blocks adopted,
        the tiers below it. A failure gives back the pool this start made (``abandon_pool``). ``t0``:
        the monotonic time the ``pool`` phase counts from (None: now)."""
        t0 = time.monotonic() if t0 is None else t0
        pool, pool_file = open_pool(settings.pool_size, settings.pool_path, settings.address, settings.cold,
                                    topology)
        try:
            t_pool = time.monotonic()
            index = Index(pool, settings.eviction_policy)
            kept = keeper(pool_file, pool, index)  # adopts the previous daemon's blocks
            t_adopt = time.monotonic()
            remote = None
            if settings.remote:  # the cluster tier (kvoffd/cache/tiers/remote/), below the disk tier if any
                from kvoffd.cache.tiers.remote.factory import make_remote_tier
                remote = make_remote_tier(settings.remote, settings.remote_password_file, settings.remote_key_file,
                                          settings.remote_write_budget, tls_ca=settings.remote_tls_ca,
                                          tls_cert=settings.remote_tls_cert, tls_key=settings.remote_tls_key,
                                          tls_server_name=settings.remote_tls_server_name,
                                          publish_on=str(settings.remote_publish))
            tiers = make_tiers(index, settings.disk_path, settings.disk_size, settings.verify,
                               settings.disk_policy, keeper=kept, remote=remote)  # below the pool, local first
        except BaseException:
            abandon_pool(pool_file)
            raise
        ks = cls(pool, index, kept, tiers, verify=settings.verify, topology=topology, pool_file=pool_file)
        if remote is not None:
            ks.remote = remote
            if settings.remote_publish == RemotePublish.ADMITTED:  # else only the pool's evictions (the spill path)
                ks.publisher = Publisher(index, remote)  # admitted blocks written behind to the cluster
                index.observers.append(ks.publisher)
        ks.phases = {"pool": t_pool - t0, "adoption": t_adopt - t_pool, "tiers": time.monotonic() - t_adopt}
        return ks

    def add_events(self, events: EventMirror) -> None:
        """The KV-event mirror: it observes the index (after the keeper and the tiers) from now on."""
        self.events = events
        self.index.observers.append(events)

    # --- life -------------------------------------------------------------------------------------------
    def start(self, loop: asyncio.AbstractEventLoop) -> float:
        """On the loop, before serving: the keeper's and the tiers' work starts, and the mirror hears
        what is already held (a warm restart's blocks, the tiers' from before). Returns the seconds the
        keeper's start took."""
        t0 = time.monotonic()
        self.keeper.start(loop)
        t_keeper = time.monotonic() - t0
        self.tiers.start(loop)
        if self.publisher is not None:
            self.publisher.start(loop)
        adopted, identities = self.keeper.take_adopted()  # a warm restart's blocks, for the KV-event stream
        events = self.events
        if events is not None:
            events.adopted(adopted, identities)
            self.keeper.on_adopted = lambda entries: events.adopted(entries, {})  # the slices still to come
            self.tiers.publish(events)  # the disk tier's changes, and what it found at start
        return t_keeper

    async def stop_tiers(self) -> None:
        """Spills and promotions in flight land first, then the tiers close."""
        await self.tiers.aclose()

    async def close(self) -> None:
        """Seal what the pool holds: the next daemon adopts it (after the copies stopped)."""
        await self.keeper.close()

    def abandon(self) -> None:
        """The start failed before serving: the pool's files go unless they hold a previous daemon's blocks."""
        abandon_pool(self._pool_file)
        self._pool_file = None

    def kept_at(self) -> str:
        """Where the pool stays for the next start ("" for private memory)."""
        return self.keeper.stats()["path"]

    # --- namespaces -------------------------------------------------------------------------------------
    def check_table(self, namespace: str, rank: int, world_size: int, layout: tuple[int, ...],
                    replicas: int) -> None:
        self.index.check_table(namespace, rank, world_size, layout, replicas)

    def table(self, namespace: str, rank: int, world_size: int, slot_bytes: int, layout: tuple[int, ...],
              replicas: int) -> Table:
        return self.index.table(namespace, rank, world_size, slot_bytes, layout, replicas)

    def note_identity(self, namespace: str, layout: KvEventsLayout | None) -> None:
        """An engine registered in ``namespace`` with this ``layout.kv_events``: whether its keys are its
        block hashes, kept by the keeper (the next daemon announces its adopted blocks under it) and told
        to the mirror, before its first STORE."""
        identity = parse_identity(layout)
        self.keeper.note_identity(namespace, identity)
        if self.events is not None:
            self.events.set_identity(namespace, identity)

    def forget_if_idle(self, namespace: str) -> bool:
        return self.index.forget_if_idle(namespace)

    # --- LOOKUP -----------------------------------------------------------------------------------------
    def lookup(self, namespace: str, keys: bytes, hold: bool = False, ask: bool = True) -> Answer:
        """The leading keys every rank can serve: in the pool, or (a warm restart still indexing) once
        asked for, or below it. Blocks found below are answered before their promotion's per-block work
        when the pool surely has slots for them all (``Tiers.fits``); otherwise they are promoted first
        (the evictions may fall short) and the answer counts those that got a slot. ``hold``: a lease
        will hold the hits (their entries are listed). ``ask``: keys missed everywhere here may be asked
        of the cluster tier (``Answer.asked``); the second lookup, after its answer, does not ask again."""
        index = self.index
        hits = index.lookup(namespace, keys, with_entries=hold)
        total = len(keys) // KEY_SIZE
        if (hits.n < total and hits.miss_reason is MissReason.ABSENT  # a restart still indexing: not a miss
                and self.keeper.adopt_asked(namespace, keys[hits.n * KEY_SIZE:])):
            hits = index.lookup(namespace, keys, with_entries=hold)
        below = None
        tiers = self.tiers
        if tiers.enabled and hits.n < total:  # blocks below the pool are hits too
            below = tiers.find_below(namespace, keys, hits)
            if below is not None and not tiers.fits(below):  # room not sure: promote, then answer
                hits, below = tiers.promote(below), None
        answer = Answer(self, hits, below, hold)
        if ask and self.remote is not None:
            answer.asked = self._ask_remote(namespace, keys, answer)
        return answer

    def _ask_remote(self, namespace: str, keys: bytes, answer: Answer) -> asyncio.Future | None:
        """``answer`` (this LOOKUP's) missed keys that other nodes may have published (--remote): the cluster
        is asked about them; returns a future done once it answered (at most ``ASK_WAIT_S`` is worth
        waiting: then the LOOKUP is asked again and its answer counts the cluster's blocks), or None
        (nothing to ask, or too many probes in flight: answer now)."""
        remote = self.remote
        n = answer.n
        if remote is None or n * KEY_SIZE >= len(keys):
            return None
        ns = self.index.namespaces.get(namespace)
        if ns is None or len(ns.tables) < ns.world_size:
            return None
        tables = [ns.tables[r] for r in range(ns.world_size)]
        refs = [TableRef(namespace, t.rank, ns.world_size, ns.layouts[t.rank]) for t in tables]
        return remote.note_misses(refs, keys[n * KEY_SIZE:])

    # --- STORE ------------------------------------------------------------------------------------------
    def describes(self, namespace: str, rank: int, n: int, tokens: bytes, parents: bytes) -> bool:
        """Whether a STORE's ``tokens``/``parents`` are kept for its blocks' KV events; ProtocolError
        ``bad_field`` when they do not fit its ``n`` keys. Without KV events they are ignored."""
        if self.events is None or not (tokens or parents):
            return False
        return self.events.check_described(namespace, rank, n, tokens, parents)

    def prepare_store(self, table: Table, keys: list[bytes], shard: int = -1) -> StorePlan:
        """Slots for a STORE's new keys. What the index evicts for them is spilled or freed here, before
        the copy starts: under a tier the index hands its victims over and the tier spills the blocks
        worth keeping (copied out of the slots this store reuses, or written from slots kept out of the
        pool) and evicts ahead for the next store (``Tiers.after_store``); with none, the index frees them."""
        tiers = self.tiers
        if not tiers.enabled:
            return self.index.prepare_store(table, keys, shard=shard)
        plan = self.index.prepare_store(table, keys, shard=shard, hand_over=True)
        tiers.after_store(plan)
        return plan

    def add_pending(self, plan: StorePlan) -> list[Entry]:
        """The plan's entries, pending until ``complete_store`` (called once its copy has started)."""
        return self.index.add_pending(plan)

    def note_described(self, namespace: str, plan: StorePlan, tokens: bytes, parents: bytes) -> None:
        """Keep a described STORE's tokens and parents for its blocks' events (``describes`` said so)."""
        events = self.events
        assert events is not None
        ident = events.identity(namespace)
        assert ident is not None  # ``describes`` said so, in this same callback
        events.note_described(plan.entries, plan.copy_idx, tokens, parents, ident.block_size)

    def complete_store(self, plan: StorePlan, ok: bool) -> int:
        """Commit (``ok``) or abort the plan's pending entries; returns how many were committed."""
        return self.index.complete_store(plan, ok)

    def checksums(self, entries: list[Entry]) -> list[int]:
        """The checksum of each slot (--verify; kvoffd/cache/checksum.py, the one the pool file's records
        hold). Runs in an executor: numpy releases the GIL."""
        buf = self.pool.buffer
        return [block_sum(buf[e.slot:e.slot + e.table.slot_bytes]) for e in entries]

    # --- LOAD -------------------------------------------------------------------------------------------
    def promotions(self, table: Table, keys: list[bytes]) -> list[asyncio.Future]:
        """The promotions a LOAD of ``keys`` waits for first (none: the common case, one dict test)."""
        return self.tiers.promotions(table, keys)

    def prepare_load(self, table: Table, keys: list[bytes]) -> LoadPlan:
        """The entries a LOAD reads, each holding a ref until ``complete_load``."""
        return self.index.prepare_load(table, keys)

    def checks_first(self, entries: Sequence[Entry]) -> bool:
        """Whether a LOAD of ``entries`` checks their sums before its copy: every one with --verify, else
        adopted blocks not checked yet since a warm restart."""
        return self.verify or self.keeper.must_check(entries)

    def corrupt(self, entries: list[Entry]) -> list[int]:
        """Positions of the entries whose bytes fail their checksum (in an executor): all of them with
        --verify (but a block adopted without one, which has nothing to be checked against), else the
        adopted ones not checked yet."""
        if not self.verify:
            return self.keeper.corrupt(entries)
        buf = self.pool.buffer
        return [j for j, e in enumerate(entries)
                if e.checksum != NONE and not matches(buf[e.slot:e.slot + e.table.slot_bytes], e.checksum)]

    def checked(self, entries: list[Entry], bad: list[int]) -> None:
        """A LOAD's sums were checked: the corrupt entries (positions ``bad``) leave the pool."""
        self.keeper.checked(entries)
        for j in bad:
            self.index.discard(entries[j])

    def far_blocks(self, slots: np.ndarray, node: int) -> int:
        """How many of these slots lie on another NUMA node than ``node`` (a sharded pool)."""
        pool = self.pool
        return int(np.count_nonzero(pool.chunk_node[slots // pool.chunk_bytes] != node))

    def complete_load(self, entries: list[Entry], ok: bool) -> None:
        """A LOAD's copy ended: the blocks read get new last-use stamps (``ok``: for the next daemon's
        LRU order), and the refs ``prepare_load`` took drop."""
        try:
            if ok:
                self.keeper.touched(entries)
        finally:
            self.index.release(entries)

    def release(self, entries: list[Entry]) -> None:
        """Drop one ref of each entry (a lease dropped, a LOAD that never became a job)."""
        self.index.release(entries)

    # --- CLEAR, EXPLAIN ---------------------------------------------------------------------------------
    def clear(self, namespace: str, in_use: Collection[str]) -> tuple[int, dict[str, int]]:
        """Every tier forgets ``namespace`` ("" = all): returns the pool's removed blocks and each tier's
        below it, by tier name (a block may be in both: the disk keeps its copy of a block promoted back
        into the pool). A namespace only a tier knows (blocks on disk from before a restart, no engine
        since) is cleared there. A CLEAR of all is one ``AllBlocksCleared`` for the mirror, not a
        removal per block."""
        removed = self.index.clear(namespace, in_use=in_use)
        below = self.tiers.clear(namespace)  # one pass over each tier, the namespaces only it knows included
        if not namespace and self.events is not None:
            self.events.all_cleared()
        return removed, below

    def explain(self, namespace: str, keys: list[bytes]) -> list[dict]:
        return self.index.explain(namespace, keys)

    # --- figures ----------------------------------------------------------------------------------------
    @property
    def resident(self) -> int:
        return self.index.resident

    @property
    def evictions(self) -> int:
        """Every eviction, whatever needed the room."""
        return self.index.evictions

    def live_state(self) -> dict[str, Any]:
        """The cache's part of what the /metrics collector reads at scrape time (kvoffd/metrics.py)."""
        p = self.pool
        kept = self.keeper.stats()
        return {"pool": {"capacity": p.capacity_bytes, "used": p.used_bytes, "pinned": p.pinned_bytes,
                         "free_chunks": p.free_chunk_bytes, "total": p.nbytes},
                "checksum_backlog": {"blocks": kept.get("seal_backlog_blocks", 0),
                                     "bytes": kept.get("seal_backlog_bytes", 0),
                                     "oldest_s": kept.get("seal_backlog_oldest_s", 0.0)},
                "resident_blocks": self.index.resident, "shards": p.shard_stats(),
                "evicted_blocks": self.index.evictions}

    def tier_stats(self, hit_blocks: int) -> list[dict[str, Any]]:
        """Per tier (the pool first), ``hit_blocks`` being every LOOKUP hit: ``kvoffctl status`` and the
        metrics collector read this."""
        tiers, index, pool = self.tiers, self.index, self.pool
        dram = {"name": "dram", "capacity_bytes": pool.capacity_bytes, "resident_bytes": pool.used_bytes,
                "resident_blocks": index.resident, "hits": hit_blocks - sum(tiers.hits.values()),
                "evictions": index.evictions, "admissions_refused": index.refused}
        out = [dram] + [st.as_dict() for st in tiers.stats()]
        if tiers.disabled:
            out.append({"name": "disk", "disabled": tiers.disabled})
        return out

    def namespace_stats(self) -> list[dict[str, Any]]:
        """Each namespace the pool or a tier holds: the pool's ``blocks``/``bytes`` and ``tiers`` (tier
        name -> blocks, bytes). One only a tier knows (blocks on disk from before a restart, no engine
        registered since) has 0 in the pool, the world size its tables were written with, and no
        ``replicas``."""
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
        """The STATS reply's cache sections: the pool, the keeper's ``persistence``, the policy."""
        return {"pool": {**self.pool.stats(), "base_address": self.pool.base_address}, "verify": self.verify,
                "persistence": self.keeper.stats(), "eviction_policy": self.index.policy}
