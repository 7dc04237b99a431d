"""The disk tier's compact block table (kvoffd/cache/tiers/table.py) against a dict model: batched
lookups, inserts and removals agree with it, the file reopens to the same contents, a table of another
size imports what fits, and a table filled to its capacity places (nearly) every block."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffd.cache.tiers.table import LOAD_FACTOR, RECORD, BlockTable, keys_u64


def _keys(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 2**63, size=(n, 4), dtype=np.int64).astype(np.uint64)


def _check(t: BlockTable, model: dict[tuple[int, bytes], int]) -> None:
    for tid in {tid for tid, _ in model} | {1, 2}:
        ks = [k for (i, k) in model if i == tid]
        if ks:
            pos = t.lookup(tid, keys_u64(b"".join(ks)))
            assert (pos >= 0).all()
            assert [int(s) for s in t.recs["slot"][pos]] == [model[(tid, k)] for k in ks]
    assert t.used == len(model)


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["ins", "del"]), st.integers(1, 2), st.integers(1, 40)),
                max_size=30), st.integers(0, 2**31))
def test_matches_a_dict_model(ops, seed):
    rng = np.random.default_rng(seed)
    t = BlockTable(200)
    model: dict[tuple[int, bytes], int] = {}
    slot = 0
    for op, tid, n in ops:
        if op == "ins":
            n = min(n, 200 - len(model))
            k = _keys(rng, n)
            pos = t.insert(tid, k, np.arange(slot, slot + n, dtype=np.uint32), np.zeros(n, dtype=np.uint32))
            for i in range(n):
                if pos[i] >= 0:  # -1: both buckets full (allowed, rare)
                    model[(tid, k[i].tobytes())] = slot + i
            slot += n
        elif op == "del":
            mine = [k for (i, k) in model if i == tid][:n]
            if mine:
                t.remove(t.lookup(tid, keys_u64(b"".join(mine))))
                for k in mine:
                    del model[(tid, k)]
        _check(t, model)
        absent = _keys(rng, 5)
        assert (t.lookup(tid, absent) == -1).all()


def test_persists_and_resizes(tmp_path):
    rng = np.random.default_rng(7)
    path = str(tmp_path / "t.kvx")
    t = BlockTable(10_000, path)
    k = _keys(rng, 5000)
    t.insert(3, k, np.arange(5000, dtype=np.uint32), np.arange(5000, dtype=np.uint32) * 7)
    t.remove(t.lookup(3, k[:1000]))
    t.flush()
    del t
    t = BlockTable(10_000, path)  # reopened: the same records, the removed ones still gone
    pos = t.lookup(3, k)
    assert (pos[:1000] == -1).all() and (pos[1000:] >= 0).all() and t.used == 4000
    assert (t.recs["crc"][pos[1000:]] == np.arange(1000, 5000) * 7).all()
    del t
    small = BlockTable(3000, path)  # --disk-size shrank: what fits is imported, the rest dropped
    assert 2950 <= small.used <= 3000 and (small.lookup(3, k[1000:]) >= 0).sum() == small.used


def test_a_full_table_places_nearly_every_block():
    t = BlockTable(100_000)
    k = _keys(np.random.default_rng(3), 100_000)
    pos = t.insert(1, k, np.arange(100_000, dtype=np.uint32), np.zeros(100_000, dtype=np.uint32))
    assert (pos >= 0).mean() > 0.999 and len(set(pos[pos >= 0].tolist())) == t.used
    assert (t.lookup(1, k) == pos).all()


def test_memory_per_block_is_below_100_bytes():
    t = BlockTable(1_000_000)
    per = t.nbytes / 1_000_000
    assert per == pytest.approx(RECORD.itemsize / LOAD_FACTOR, rel=0.01) and per + 7 <= 100


def test_a_table_built_in_memory_and_saved_is_found_again(tmp_path):
    """BlockTable.save: the file a bench (or an import) writes in one pass opens as the same table."""
    t = BlockTable(1000)
    k = np.random.default_rng(3).integers(0, 2**63, size=(700, 4), dtype=np.int64).astype(np.uint64)
    pos = t.insert(1, k, np.arange(700, dtype=np.uint32), np.arange(700, dtype=np.uint32) * 7)
    path = str(tmp_path / "index-4096.kvx")
    t.save(path)
    u = BlockTable(1000, path)
    assert u.used == t.used == int((pos >= 0).sum())
    got = u.lookup(1, k)
    assert (got == pos).all()
    assert (u.recs["slot"][got[got >= 0]] == np.arange(700)[got >= 0]).all()


@pytest.mark.parametrize("max_blocks", [8, 1000])
def test_the_scalar_path_for_a_few_keys_agrees_with_the_vectorised_one(max_blocks):
    """Lookups of at most FEW keys take a pure-Python path (a LOOKUP's usual miss asks the disk about
    one key): for keys present, absent, of another table, and sharing a present key's first word only,
    it must find exactly what the vectorised path finds (8 blocks: two buckets, so a key's two
    choices often coincide)."""
    from kvoffd.cache.tiers.table import FEW

    rng = np.random.default_rng(3)
    t = BlockTable(max_blocks)
    present = _keys(rng, max_blocks * 3 // 4)
    pos = t.insert(1, present, np.arange(len(present), dtype=np.uint32), np.zeros(len(present), dtype=np.uint32))
    assert (pos >= 0).sum() >= len(present) - 1
    twin = present[:3].copy()
    twin[:, 3] ^= np.uint64(1)  # the same first words (same buckets, same first-word match), another key
    probe = np.concatenate([present, _keys(rng, 20), twin])
    for tid in (1, 2):
        want = t.lookup(tid, probe)  # more than FEW keys: vectorised
        assert len(probe) > FEW
        got = [int(t.lookup(tid, probe[i:i + 1])[0]) for i in range(len(probe))]
        assert got == want.tolist()
        assert t.lookup(tid, probe[:FEW]).tolist() == want[:FEW].tolist()
    assert (want[len(present):] == -1).all() and (t.lookup(1, present)[pos >= 0] == pos[pos >= 0]).all()
