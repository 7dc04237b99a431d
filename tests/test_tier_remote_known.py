"""``Known`` (kvoffd/cache/tiers/remote/known.py), the cluster tier's bounded numpy table of the pairs this node
knows the cluster holds, against a plain Python reference on random keys: ``has`` and ``leading`` (the run
stops at the first unknown key) answer exactly what was added and not discarded while nothing is evicted,
on the scalar path (a few keys) and the numpy one alike; many keys sharing two buckets never answer for
one another; the table never holds more than its capacity and what goes is the oldest (re-adding
refreshes); ``drop_namespace`` and ``clear`` forget what they say and nothing else.
"""

from __future__ import annotations

import numpy as np
import pytest

from kvoffd.cache.tiers.remote.known import BUCKET, FEW, Known, fingerprint, fingerprints

NS_A, NS_B = b"a" * 16, b"b" * 16
SECRET = b"k" * 16


def rand_keys(rng: np.random.Generator, n: int) -> list[bytes]:
    raw = rng.integers(0, 256, n * 32, dtype=np.uint8).tobytes()
    return [raw[i * 32:(i + 1) * 32] for i in range(n)]


def test_the_scalar_fingerprint_is_the_vectorised_one():
    rng = np.random.default_rng(1)
    keys = b"".join(rand_keys(rng, 500)) + bytes(32) + b"\xff" * 32
    known = Known(64, secret=SECRET)
    m, mi = known._mults, known._mults_int
    for word in (0, 1, (1 << 64) - 1, 0x1234_5678_9ABC_DEF0):
        fp = fingerprints(m, word, keys)
        assert fp.tolist() == [fingerprint(mi, word, keys, i * 32) for i in range(len(keys) // 32)]
        assert (fp != 0).all()
    one_word = b"".join(bytes(8) * 3 + i.to_bytes(8, "little") for i in range(1000))  # keys that differ in one word
    assert len(set(fingerprints(m, 7, one_word).tolist())) == 1000


@pytest.mark.parametrize("seed", [2, 3, 4])
def test_random_operations_match_a_python_set(seed):
    rng = np.random.default_rng(seed)
    universe = rand_keys(rng, 3000)
    known = Known(1 << 15, secret=SECRET)  # far above what is added: nothing is evicted
    ref: set[tuple[bytes, bytes]] = set()
    for _ in range(300):
        ns = NS_A if rng.random() < 0.7 else NS_B
        n = int(rng.choice([1, 2, FEW, FEW + 1, 17, 200]))
        pick = [universe[i] for i in rng.integers(0, len(universe), n)]  # repeats within a batch, too
        keys = b"".join(pick)
        op = rng.random()
        if op < 0.45:
            where = rng.random(n) < 0.8 if rng.random() < 0.5 else None
            known.add(ns, keys, where)
            ref |= {(ns, k) for i, k in enumerate(pick) if where is None or where[i]}
        elif op < 0.6:
            where = rng.random(n) < 0.5 if rng.random() < 0.5 else None
            known.discard(ns, keys, where)
            ref -= {(ns, k) for i, k in enumerate(pick) if where is None or where[i]}
        want = [(ns, k) in ref for k in pick]
        assert known.has(ns, keys).tolist() == want
        assert known.leading(ns, keys) == next((i for i, w in enumerate(want) if not w), n)
        assert len(known) == len(ref)


def test_leading_stops_at_the_first_unknown_key_on_both_paths():
    rng = np.random.default_rng(5)
    ks = rand_keys(rng, 64)
    known = Known(4096, secret=SECRET)
    known.add(NS_A, b"".join(ks[:10] + ks[11:]))
    for n in (1, 3, FEW, FEW + 1, 11, 64):
        keys = b"".join(ks[:n])
        assert known.leading(NS_A, keys) == min(n, 10)
        assert known.leading(NS_B, keys) == 0  # another namespace: nothing known
    assert known.leading(NS_A, b"") == 0 and known.has(NS_A, b"").shape == (0,)
    assert known.leading(NS_A, b"".join(ks[11:])) == 53


@pytest.mark.parametrize("shape", ["little-endian counter", "big-endian counter", "one high word"])
def test_keys_that_count_in_a_few_bytes_spread_over_the_buckets(shape):
    """Below a quarter of the capacity nothing is evicted, whatever the keys look like (test keys, a
    client's own numbering): the fingerprint's low bits, which pick the buckets, depend on every bit."""
    make = {"little-endian counter": lambda i: b"\x01" * 4 + i.to_bytes(28, "little"),
            "big-endian counter": lambda i: i.to_bytes(32, "big"),
            "one high word": lambda i: bytes(24) + (i << 40).to_bytes(8, "little")}[shape]
    keys = b"".join(make(i) for i in range(4096))
    known = Known(1 << 14, secret=SECRET)
    known.add(NS_A, keys)
    assert len(known) == 4096 and known.has(NS_A, keys).all() and known.leading(NS_A, keys) == 4096


def test_keys_crowded_into_two_buckets_never_answer_for_one_another():
    rng = np.random.default_rng(6)
    known = Known(2 * BUCKET, secret=SECRET)  # two buckets: every key shares them with every other
    assert known.cap == 2 * BUCKET
    added, other = rand_keys(rng, 100), rand_keys(rng, 100)
    live: set[bytes] = set()
    for i in range(0, 100, 5):
        batch = added[i:i + 5]
        known.add(NS_A, b"".join(batch))
        live |= set(batch)
        got = known.has(NS_A, b"".join(added))
        held = {k for k, h in zip(added, got.tolist(), strict=True) if h}
        assert held <= live  # never a key that was not added
        assert set(batch) <= held  # the batch just added is there (it evicts older ones)
        assert len(known) == len(held) <= known.cap
        assert not known.has(NS_A, b"".join(other)).any()
        assert not known.has(NS_B, b"".join(batch)).any()
        live = held


def test_capacity_holds_and_the_oldest_go_first():
    rng = np.random.default_rng(7)
    cap = 1024
    known = Known(cap, secret=SECRET)
    batches = [rand_keys(rng, cap // 2) for _ in range(8)]
    for b in batches:
        known.add(NS_A, b"".join(b))
        assert len(known) <= known.cap == cap
    share = [float(known.has(NS_A, b"".join(b)).mean()) for b in batches]
    assert share[-1] == 1.0  # the newest half of the table is all there
    assert share[0] == 0.0 and share[1] == 0.0  # 3 tables' worth later, the oldest are gone
    assert share[-2] > share[2]  # newer batches survive better than older ones
    assert len(known) == sum(round(s * cap // 2) for s in share)


def test_adding_again_refreshes_a_pair():
    rng = np.random.default_rng(8)
    cap = 1024
    known = Known(cap, secret=SECRET)
    old = rand_keys(rng, cap)
    known.add(NS_A, b"".join(old))
    known.add(NS_A, b"".join(old[:cap // 4]))  # said again: now the newest
    known.add(NS_A, b"".join(rand_keys(rng, cap // 2)))
    refreshed = known.has(NS_A, b"".join(old[:cap // 4])).mean()
    stale = known.has(NS_A, b"".join(old[cap // 4:])).mean()
    assert refreshed > 0.95 and stale < 0.5, (refreshed, stale)


def test_drop_namespace_and_clear_forget_only_what_they_say():
    rng = np.random.default_rng(9)
    a, b = b"".join(rand_keys(rng, 300)), b"".join(rand_keys(rng, 200))
    known = Known(1 << 12, secret=SECRET)
    known.add(NS_A, a)
    known.add(NS_B, b)
    known.add(NS_B, a[:32 * 10])
    assert len(known) == 510
    assert known.drop_namespace({NS_A, b"never seen 16 b."}) == 300
    assert not known.has(NS_A, a).any() and known.has(NS_B, b).all() and known.leading(NS_B, a) == 10
    assert len(known) == 210
    assert known.drop_namespace({b"never seen 16 b."}) == 0
    known.clear()
    assert len(known) == 0 and not known.has(NS_B, b).any() and known.leading(NS_B, b[:64]) == 0
    known.add(NS_B, b)  # usable after a clear
    assert known.has(NS_B, b).all() and len(known) == 200
