"""What the index is made of (``Entry``, ``Table``, ``Namespace``) and what its verbs return
(``StorePlan``, ``Hits``, ``LoadPlan``): plain data; the rules that change them live in index.py."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvoffd.cache.policy import EvictionPolicy
from kvoffd_client.protocol import MissReason

if TYPE_CHECKING:
    from kvoffd.cache.runs import Run


class Entry:
    __slots__ = ("key", "table", "slot", "ready", "refs", "dead", "in_lru", "stored_at", "checksum", "run",
                 "run_at")

    def __init__(self, key: bytes, table: Table, slot: int, refs: int = 0):
        self.key = key
        self.table = table
        self.slot = slot
        self.ready = False
        self.refs = refs
        self.dead = False  # unlinked (evicted, cleared, failed) while a job may still hold it
        self.in_lru = False
        self.stored_at = 0.0  # set when the copy completes
        self.checksum = -1  # set in --verify mode
        self.run: Run | None = None  # set when it becomes visible
        self.run_at = 0  # its index in the run


@dataclass(eq=False)  # hashed by identity (commit groups entries by table)
class Table:
    """One (namespace, rank): its entries (``visible`` holds the ready ones) and its slot size."""

    namespace: str
    rank: int
    slot_bytes: int
    entries: dict[bytes, Entry] = field(default_factory=dict)
    visible: dict[bytes, Entry] = field(default_factory=dict)



@dataclass
class Namespace:
    name: str
    world_size: int
    replicas: int = 1  # consecutive ranks sharing one copy (REGISTER.replicas); 1: every rank its own
    tables: dict[int, Table] = field(default_factory=dict)  # storing rank -> table
    layouts: dict[int, tuple[int, ...]] = field(default_factory=dict)  # storing rank -> segment lengths
    policies: list[EvictionPolicy] = field(default_factory=list)  # its tables' slot sizes' policies, once each

    def storing_rank(self, rank: int) -> int:
        """The rank whose table ``rank`` reads (itself unless it shares a replicated copy)."""
        return rank - rank % self.replicas

    def check(self, rank: int, world_size: int, layout: tuple[int, ...], replicas: int) -> None:
        """Raise ValueError if an engine of this shape contradicts the namespace (``Index.check_table``)."""
        name = self.name
        if self.world_size != world_size:
            raise ValueError(f"namespace {name!r} has world size {self.world_size}, not {world_size}")
        if self.replicas != replicas:
            raise ValueError(f"namespace {name!r} keeps one copy per {self.replicas} ranks, not per {replicas}")
        have = self.layouts.get(self.storing_rank(rank))
        if have is not None and have != layout:
            raise ValueError(f"namespace {name!r} rank {rank} holds blocks of another layout "
                             f"({sum(have)} bytes in {len(have)} runs; this engine: {sum(layout)} bytes in "
                             f"{len(layout)} runs)")


@dataclass(eq=False)
class StorePlan:
    """What a STORE will do (``Index.prepare_store``), as indices into its keys.

    The plan travels through the whole store: ``add_pending`` fills ``entries`` once the copy has
    started, and ``complete_store`` commits or aborts them.
    """

    table: Table
    keys: list[bytes]
    copy_idx: list[int]  # to copy, into ``slots``
    slots: list[int]
    present: int  # already stored (or being stored)
    dropped: list[int]  # admitted, but no room (from the end)
    refused: list[int]  # refused by the admission policy: no slot, no copy
    evicted: int = 0  # entries evicted to find the slots (reclaimed chunks included)
    entries: list[Entry] = field(default_factory=list)  # pending, one per ``copy_idx`` (add_pending)
    victims: list[Victims] = field(default_factory=list)  # what it evicted, handed over (``hand_over``)


@dataclass(eq=False)
class Victims:
    """Entries an eviction took, handed to the caller (``StorePlan.victims``, ``Index.take_victims``):
    unlinked, invisible, their bytes still in their slots, the observers not told yet. ``held``: the
    slots stay out of the pool until ``Index.free_victims``; else they are back in the pool for the
    STORE that evicted them, and their bytes last until that store's copy starts (a spill copies them
    out first). ``Index.free_victims`` tells the observers (``freeing``) either way."""

    slot_bytes: int
    entries: list[Entry]
    held: bool


@dataclass
class Hits:
    """What a LOOKUP found (``Index.lookup``): the leading keys ready on every rank."""

    n: int
    by_rank: dict[int, list[Entry]]  # their entries, rank by rank (only when asked for)
    miss_reason: MissReason | None  # why key ``n`` missed (None when every key hit)
    world_size: int  # ranks of the namespace (0: unknown namespace)


@dataclass
class LoadPlan:
    """What a LOAD will read (``Index.prepare_load``): the entries found, each holding a ref."""

    entries: list[Entry]
    found_idx: list[int]  # indices into the LOAD's keys, one per entry
    missing_idx: list[int]  # keys not resident (reported failed)
