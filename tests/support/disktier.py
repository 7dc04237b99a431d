"""The disk tier's rig (tests/test_tier_disk.py, test_tier_disk_hostile.py, test_ops_ctl.py): one engine on
one daemon with a small pool over a disk tier, so a few hundred blocks overflow it to disk."""

from __future__ import annotations

from kvtest import chain_keys, wait_until
from reliability_util import ShmEngine

SLOT = 64 << 10
POOL = "8MiB"  # 128 slots
LRU = ("--eviction-policy", "lru")  # every block admitted: what is evicted is known


def disk_flags(tmp_path, *extra: str, size: str = "64MiB") -> tuple[str, ...]:
    """A disk tier of ``size`` in ``tmp_path/disk``, LRU (every block admitted: what is evicted is known)."""
    return ("--disk-path", str(tmp_path / "disk"), "--disk-size", size, *LRU, *extra)


class Rig:
    """One engine on one daemon: store chains, look them up, load them into fresh blocks."""

    def __init__(self, d, blocks: int = 512, ns: str = "disk"):
        self.d, self.ns = d, ns
        self.eng = ShmEngine(blocks, SLOT, tag="disk")
        self.c = d.client()
        self.c.register("disk-0", ns, 0, 1, self.eng.memory, self.eng.layout)
        self.job = 0

    def store(self, keys: list[bytes], base: int = 0) -> None:
        ids = range(base, base + len(keys))
        self.eng.fill(ids, keys)
        self.job += 1
        self.c.submit_store("disk-0", self.job, keys, ids)
        n = self.c.wait_notices({self.job}, 30)
        assert n and n[0].ok, n

    def lookup_load(self, keys: list[bytes], base: int) -> tuple[int, object]:
        """Hits, then the LOAD of the hit prefix into blocks ``base..`` (poisoned first)."""
        hits = self.c.lookup(self.ns, keys).hits
        ids = range(base, base + hits)
        self.eng.poison(ids)
        if not hits:
            return 0, None
        self.job += 1
        self.c.submit_load("disk-0", self.job, keys[:hits], ids)
        n = self.c.wait_notices({self.job}, 30)
        assert n, "no notice for the load"
        return hits, n[0]

    def exact(self, keys: list[bytes], base: int, notice) -> int:
        """Blocks loaded byte-exact; every block the notice calls good must be exact."""
        ids = list(range(base, base + len(keys)))
        good = self.eng.matches(ids, keys)
        failed = set(notice.failed) if notice is not None else set()
        for i, ok in enumerate(good):
            assert ok or i in failed, f"block {i} reported loaded but holds the wrong bytes"
        return int(good.sum())

    def tier(self, name: str = "disk") -> dict:
        return next(t for t in self.c.stats()["tiers"] if t["name"] == name)

    def close(self) -> None:
        self.c.close()
        self.eng.close()


def fill_and_spill(rig: Rig, n_old: int = 100, rounds: int = 3) -> list[bytes]:
    """``n_old`` blocks stored first, then enough others to evict them all from the pool; returns the
    old chain once the disk holds all of it."""
    old = chain_keys(n_old, b"old")
    rig.store(old)
    for r in range(rounds):
        rig.store(chain_keys(100, b"new%d" % r), base=100)
    assert wait_until(lambda: rig.tier()["spills"] >= n_old, 30), rig.tier()
    return old


