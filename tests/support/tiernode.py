"""One engine on one daemon, for the tier tests that run several daemons (tests/test_tier_remote_daemons.py,
test_tier_stack.py, test_tier_remote_tls.py): store chains, ask for them, load them back checked byte for
byte, read a tier's figures."""

from __future__ import annotations

from typing import Any

from kvtest import chain_keys
from reliability_util import ShmEngine

SLOT = 64 << 10


class TierNode:
    """``blocks`` engine blocks of ``slot`` bytes in a memfd, registered as ``<tag>-0`` in namespace
    ``ns``; ``kv_events``: the layout's KV-event identity (a daemon with --kv-events-address)."""

    def __init__(self, d: Any, ns: str, tag: str, *, blocks: int = 512, slot: int = SLOT,
                 kv_events: dict | None = None, **client: Any):
        self.d, self.ns = d, ns
        self.eng = ShmEngine(blocks, slot, tag=tag)
        self.c = d.client(**client)
        self.engine = f"{tag}-0"
        layout = {**self.eng.layout, "kv_events": kv_events} if kv_events else self.eng.layout
        self.c.register(self.engine, ns, 0, 1, self.eng.memory, layout)
        self.job = 0

    def store(self, keys: list[bytes], base: int = 0) -> None:
        ids = range(base, base + len(keys))
        self.eng.fill(ids, keys)
        self.job += 1
        self.c.submit_store(self.engine, self.job, keys, ids)
        n = self.c.wait_notices({self.job}, 30)
        assert n and n[0].ok, n

    def hits(self, keys: list[bytes]) -> int:
        return self.c.lookup(self.ns, keys).hits

    def load(self, keys: list[bytes], base: int):
        """LOAD ``keys`` into blocks ``base..`` (poisoned first); returns the notice and how many blocks
        are byte-exact. Every block the notice calls good must be exact."""
        ids = range(base, base + len(keys))
        self.eng.poison(ids)
        self.job += 1
        self.c.submit_load(self.engine, self.job, keys, ids)
        n = self.c.wait_notices({self.job}, 30)
        assert n, "no notice for the load"
        good = self.eng.matches(list(ids), keys)
        failed = set(n[0].failed)
        for i, ok in enumerate(good):
            assert ok or i in failed, f"block {i} reported loaded but holds the wrong bytes"
        return n[0], int(good.sum())

    def tier(self, name: str = "remote") -> dict:
        return next(t for t in self.c.stats()["tiers"] if t["name"] == name)

    def evict(self, parent: bytes, rounds: int = 3) -> None:
        """Store enough other blocks (into blocks 100..199) to push everything stored before out of a
        128-slot pool."""
        for r in range(rounds):
            self.store(chain_keys(100, b"filler-%s-%d" % (self.engine.encode(), r), parent=parent), base=100)

    def close(self) -> None:
        self.c.close()
        self.eng.close()
