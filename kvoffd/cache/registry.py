"""The index's namespaces, their tables, and one eviction policy per slot size (``Registry``).

Held by the index (``Index.registry``); the index's ``check_table``, ``table`` and ``forget_if_idle``
are its verbs, and ``Index.namespaces`` is its dict (read by lookups, the views and the tiers).
"""

from __future__ import annotations

from kvoffd.cache.entries import Namespace, Table
from kvoffd.cache.policy import EvictionPolicy, make_policy
from kvoffd.pool.allocator import Pool


class Registry:
    """``policy``: the name of the policy each slot size gets (kvoffd/cache/policy.py)."""

    def __init__(self, pool: Pool, policy: str):
        make_policy(policy, 0)  # ValueError for an unknown name, before any engine comes
        self.pool = pool
        self.policy = policy
        self.namespaces: dict[str, Namespace] = {}
        self.policies: dict[int, EvictionPolicy] = {}  # slot_bytes -> the policy tracking its ready entries

    def check_table(self, namespace: str, rank: int, world_size: int, layout: tuple[int, ...],
                    replicas: int = 1) -> None:
        """Raise ValueError if an engine of this shape contradicts the namespace (changes nothing).

        With replicas every rank of a run reads the bytes its first rank stored, so each must
        describe exactly that rank's layout: one that differs is refused, never handed those bytes."""
        if world_size % replicas:
            raise ValueError(f"replicas {replicas} does not divide world size {world_size}")
        ns = self.namespaces.get(namespace)
        if ns is not None:
            ns.check(rank, world_size, layout, replicas)

    def table(self, namespace: str, rank: int, world_size: int, slot_bytes: int,
              layout: tuple[int, ...], replicas: int = 1) -> Table:
        """The table an engine reads (and, as its run's first rank, writes); created on first use, with
        its slot size's policy; ValueError as ``check_table``."""
        self.check_table(namespace, rank, world_size, layout, replicas)
        ns = self.namespaces.get(namespace)
        if ns is None:
            ns = self.namespaces[namespace] = Namespace(namespace, world_size, replicas)
        rank = ns.storing_rank(rank)
        t = ns.tables.get(rank)
        if t is None:
            t = ns.tables[rank] = Table(namespace, rank, slot_bytes)
            ns.layouts[rank] = layout
            pol = self.policies.get(slot_bytes)
            if pol is None:
                pol = self.policies[slot_bytes] = make_policy(self.policy, self.pool.slots_share(slot_bytes))
            if pol not in ns.policies:
                ns.policies.append(pol)
        return t

    def forget_if_idle(self, namespace: str) -> bool:
        """Forget a namespace that holds no entry (the caller knows no engine uses it): its world size
        and layouts no longer bind the next engine, and register/unregister cycles leave nothing."""
        ns = self.namespaces.get(namespace)
        if ns is None or any(t.entries for t in ns.tables.values()):
            return False
        del self.namespaces[namespace]
        return True
