"""bench/tier_sim.py: the two-level simulation obeys the bounds every cache obeys, and its ``clock2`` is
the daemon's disk tier step for step (so its table speaks for kvoffd/cache/tiers/disk.py)."""

from __future__ import annotations

import asyncio
import hashlib
import mmap
import random
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import policy_sim as S  # noqa: E402
import synth_trace  # noqa: E402
import tier_sim as TS  # noqa: E402
import trace_replay as T  # noqa: E402

from kvoffd.cache.tiers.base import SpillResult, TableRef  # noqa: E402
from kvoffd.cache.tiers.disk import DiskTier  # noqa: E402


@pytest.fixture(scope="module")
def trace(tmp_path_factory) -> T.Trace:
    p = tmp_path_factory.mktemp("tier") / "zipf.jsonl"
    synth_trace.main(["zipf-chat", str(p), "--requests", "600", "--seed", "3"])
    return T.load_trace(p)


@pytest.mark.parametrize("disk", ["lru", "clock2", "clock2-bloom", "s3-fifo", "arc", "clock2-prefix"])
@pytest.mark.parametrize("exclusive", [False, True])
def test_room_for_everything_is_the_unbounded_cache(trace, disk, exclusive):
    """(The pool holds the longest request: a longer one could not be promoted whole, in the daemon too.)"""
    big = trace.asked_blocks
    pool = max(len(r.hash_ids) for r in trace.requests)
    res = TS.simulate2(trace, S.factories()["lru"](pool), pool, TS.disk_policies()[disk](big), big, exclusive)
    assert res.hits == T.simulate_unbounded(trace).hits


def test_a_request_longer_than_the_pool_hits_only_what_the_pool_can_take(trace):
    pool = 20
    res = TS.simulate2(trace, S.factories()["lru"](pool), pool, TS.disk_policies()["lru"](10**6), 10**6)
    unb = T.simulate_unbounded(trace).hits
    assert all(h <= u for h, u in zip(res.hits, unb, strict=True)) and sum(res.hits) < sum(unb)


@pytest.mark.parametrize("disk", ["lru", "clock2", "clock2-bloom", "doorkeeper", "w-tinylfu"])
def test_pool_plus_disk_never_beats_the_optimum_of_the_same_blocks(trace, disk):
    res = TS.simulate2(trace, S.factories()["lru"](40), 40, TS.disk_policies()[disk](200), 200)
    assert sum(res.hits) <= sum(T.simulate_optimum(trace, 240).hits)
    assert res.first_reuse_hits <= len(TS.first_reuses(trace))


async def _drive(path: str, ops: list[tuple[str, list[int]]], nslots: int) -> set[int]:
    """``ops`` through a real DiskTier the way ``Tiers`` calls it: a spill first touches what the tier
    holds (``contains(touch=True)``), then writes the rest; a read is a use."""
    ref = TableRef("sim", 0, 1, (4096,))
    tier = DiskTier(path, nslots * 4096, threads=1, policy="clock2")
    tier.start(asyncio.get_running_loop())

    def key(i: int) -> bytes:
        return hashlib.sha256(b"%d" % i).digest()

    try:
        for op, ids in ops:
            keys = b"".join(key(i) for i in ids)
            buf = mmap.mmap(-1, len(ids) * 4096)
            views = [memoryview(buf)[j * 4096:(j + 1) * 4096] for j in range(len(ids))]
            if op == "read":
                assert (await tier.read(ref, keys, views)).all()
                continue
            held = tier.contains(ref, keys, touch=True)
            new = [i for i, h in zip(ids, held.tolist(), strict=True) if not h]
            if new:
                res = await tier.write(ref, b"".join(key(i) for i in new), views[:len(new)])
                assert all(r is SpillResult.WRITTEN for r in res)
        every = sorted({i for _, ids in ops for i in ids})
        held = tier.contains(ref, b"".join(key(i) for i in every))
        return {i for i, h in zip(every, held.tolist(), strict=True) if h}
    finally:
        tier.close()


def test_the_simulated_clock2_is_the_disk_tiers_clock(tmp_path):
    rng = random.Random(11)
    nslots = 32
    clock = TS.disk_policies()["clock2"](nslots)
    model = S.TierModel(clock, nslots)
    ops: list[tuple[str, list[int]]] = []
    for _ in range(300):
        if model.resident and rng.random() < 0.3:
            ids = rng.sample(sorted(model.resident), min(len(model.resident), rng.randint(1, 4)))
            ops.append(("read", ids))
            model.load(ids)
        else:
            ids = rng.sample(range(120), rng.randint(1, 6))
            ops.append(("spill", ids))
            model.store(ids, [None] * len(ids))
    got = asyncio.run(_drive(str(tmp_path / "disk"), ops, nslots))
    assert got == model.resident
    assert len(got) == nslots and np.isfinite(len(got))
