"""kvoffd/cache/policy.py: admission and eviction behave as documented, and the default beats LRU where
it should (through bench/policy_sim.py's driver, which replays the daemon's call order)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))

import policy_sim as S  # noqa: E402
import synth_trace  # noqa: E402
import trace_replay as T  # noqa: E402

from kvoffd.cache.policy import (  # noqa: E402
    DEFAULT_POLICY,
    LRU,
    AdaptiveDoorkeeper,
    GuardedDoorkeeper,
    make_policy,
)


def _trace(chains: list[list[int]], name: str = "t") -> T.Trace:
    return T.Trace(name, [T.Request(i, len(c) * T.BLOCK_TOKENS, tuple(c)) for i, c in enumerate(chains)])


def _synthetic(tmp_path: Path, kind: str, n: int) -> T.Trace:
    path = tmp_path / f"{kind}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in synth_trace.generate(kind, n, seed=3)))
    return T.load_trace(path)


@pytest.mark.parametrize("cls", [AdaptiveDoorkeeper, GuardedDoorkeeper])
def test_a_scan_does_not_flush_the_protected_segment(cls):
    """A prefix asked for three times, then 1,000 one-off blocks through a 100-block cache, then the
    prefix again: the default still holds all of it; LRU has flushed it."""
    hot = list(range(10))
    scans = [[0, *range(1000 + 20 * i, 1020 + 20 * i)] for i in range(50)]  # behind the shared head
    trace = _trace([hot, hot, hot, *scans, hot])
    assert S.simulate(trace, cls(100), 100).hits[-1] == 10
    assert S.simulate(trace, LRU(100), 100).hits[-1] == 1  # only the head the scans share


def test_a_first_request_is_refused_once_full_and_admitted_on_the_second():
    p = AdaptiveDoorkeeper(4)
    for k in "abcd":  # free slots: admitted (refusing then would only lose hits)
        assert p.admit(k, True)
        p.on_insert(k, None)
    assert not p.admit("x", True)
    assert p.refused == 1 and "x" not in p
    assert p.admit("x", True)  # asked for again: the doorkeeper opens, into protected
    victim = p.victim()
    assert victim in "abcd"
    p.on_insert("x", "a")
    assert "x" in p and len(p) == 4


def test_an_orphan_is_refused_even_when_asked_for_again():
    p = AdaptiveDoorkeeper(4)
    assert not p.admit("y", False)
    assert not p.admit("y", False)
    assert p.refused == 2 and len(p) == 0


@pytest.mark.parametrize("cls", [LRU, AdaptiveDoorkeeper, GuardedDoorkeeper])
def test_a_victim_is_forgotten_and_a_pinned_one_comes_back_on_access(cls):
    p = cls(3)
    for k in "abc":
        assert p.admit(k, True)
        p.on_insert(k, None)
    v = p.victim()
    assert v == "a" and v not in p and len(p) == 2
    p.on_access(v)  # the index could not evict it (pinned): handed back when the pin drops
    assert v in p and len(p) == 3
    assert p.victim() == "b"  # it came back as most recently used
    p.on_remove("c")
    assert len(p) == 1


@pytest.mark.parametrize("cls", [AdaptiveDoorkeeper, GuardedDoorkeeper])
def test_a_prefix_is_evicted_from_its_tail(cls):
    """A LOAD refreshes a chain in key order; the policy still evicts its deepest block first (LRU
    evicts the head, leaving the rest resident but unreachable)."""
    for p, first in ((cls(3), "c"), (LRU(3), "a")):
        for k, parent in (("a", None), ("b", "a"), ("c", "b")):
            assert p.admit(k, True)
            p.on_insert(k, parent)
        p.on_lookup_miss([])
        for k in "abc":  # the LOAD of the whole prefix ends
            p.on_access(k)
        p.on_lookup_miss(["d"])  # the next request
        assert p.victim() == first


def test_ghost_memory_is_bounded_by_capacity():
    p = AdaptiveDoorkeeper(100)
    for i in range(20_000):
        for k in (i, i // 2):  # every key asked for twice: refusals, admissions, evictions
            if p.admit(k, True):
                if len(p) >= p.capacity:
                    p.victim()
                p.on_insert(k, None)
    assert len(p) <= 100
    assert len(p._seen) <= 400 and len(p._evicted) <= 100 and not p._promote


def test_the_driver_is_the_daemons_lru(tmp_path):
    trace = _synthetic(tmp_path, "zipf-chat", 400)
    for cap in (60, 400):
        assert S.simulate(trace, LRU(cap), cap).hits == T.simulate_lru(trace, cap).hits


def test_the_default_beats_lru_on_a_scan_heavy_trace(tmp_path):
    trace = _synthetic(tmp_path, "scan-heavy", 600)
    cap = 800
    lru = S.simulate(trace, LRU(cap), cap).block_ratio(trace)
    default = S.simulate(trace, make_policy(DEFAULT_POLICY, cap), cap).block_ratio(trace)
    assert default >= 1.3 * lru, (default, lru)


def test_the_guard_follows_lru_where_refusing_first_requests_loses(tmp_path):
    """Zipf-shared system prompts and chats that come back soon: nearly every block is reused while
    LRU still holds it, so refusing first requests costs hits (the unguarded adaptive doorkeeper is
    below LRU); the guarded default sees its LRU shadow lead, switches to LRU and keeps LRU's hits."""
    trace = _synthetic(tmp_path, "zipf-chat", 4000)
    cap = 2000
    lru = S.simulate(trace, LRU(cap), cap).block_ratio(trace)
    unguarded = S.simulate(trace, AdaptiveDoorkeeper(cap), cap).block_ratio(trace)
    guarded = GuardedDoorkeeper(cap)
    got = S.simulate(trace, guarded, cap).block_ratio(trace)
    assert unguarded < 0.99 * lru, (unguarded, lru)
    assert got >= 0.995 * lru, (got, lru)
    assert guarded.lru_mode


def test_make_policy_names_the_choices():
    assert isinstance(make_policy("lru", 10), LRU)
    assert make_policy(DEFAULT_POLICY, 10).name == DEFAULT_POLICY
    with pytest.raises(ValueError, match="guarded-doorkeeper"):
        make_policy("mru", 10)


@pytest.mark.parametrize("cls", [AdaptiveDoorkeeper, GuardedDoorkeeper])
def test_the_deferred_refresh_stays_small_in_a_large_pool(cls):
    """The refresh of the blocks requests used runs on the daemon's event loop, in one go: however
    large the pool, only a few thousand keys may wait for it, not the pool's capacity (a 65,536-block
    pool let 65,536 pile up: a 16 ms stall of every LOOKUP and notice behind it). And the order it
    makes is unchanged: each request's blocks deepest first, the requests in order."""
    p = cls(65_536)
    per = 1024
    for k in range(64 * per):  # a full pool, nothing evicted yet
        assert p.admit(k, True)
        p.on_insert(k, None)
    p.on_lookup_miss(())
    p.victim()  # flushes what the inserts queued
    worst = 0
    for r in range(64):  # 64 requests that each read 1,024 resident blocks, as leased LOOKUPs + LOADs do
        p.on_lookup_miss(())
        for k in range(r * per, (r + 1) * per):
            p.on_access(k)
        worst = max(worst, len(p._touched))
    assert worst <= 4096 + per  # a refresh of ~1 ms, not the pool's capacity
    p.victim()  # refreshes what is pending, then evicts the oldest
    order = list(p._protected)
    # oldest to newest: request 62's blocks, then 63's, each deepest first (its head most recent)
    assert order[-2 * per:-per] == list(range(63 * per - 1, 62 * per - 1, -1))
    assert order[-per:] == list(range(64 * per - 1, 63 * per - 1, -1))


def test_touched_keys_stay_bounded_without_lookups():
    """Loads and stores with no LOOKUP between them (no request ever ends) still refresh: memory and a
    refresh's length stay bounded by a few times the pool's capacity."""
    p = AdaptiveDoorkeeper(1000)
    for k in range(1000):
        assert p.admit(k, True)
        p.on_insert(k, None)
    worst = 0
    for i in range(100_000):
        p.on_access(i % 1000)
        worst = max(worst, len(p._touched))
    assert worst <= 4 * 4096 + 1
