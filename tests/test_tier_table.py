"""The disk tier's compact block table (kvoffd/cache/tiers/diskindex.py) against a dict model: batched
lookups, inserts and removals agree with it, the file reopens to the same contents, a table of another
size imports what fits, and a table filled to its capacity places (nearly) every block."""

from __future__ import annotations

import os
import shutil
import sysconfig

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvoffd.cache.tiers import diskindex as table_module
from kvoffd.cache.tiers.diskindex import LOAD_FACTOR, RECORD, DiskIndex, keys_u64


def _keys(rng: np.random.Generator, n: int) -> np.ndarray:
    return rng.integers(0, 2**63, size=(n, 4), dtype=np.int64).astype(np.uint64)


def _check(t: DiskIndex, model: dict[tuple[int, bytes], int]) -> None:
    for tid in {tid for tid, _ in model} | {1, 2}:
        ks = [k for (i, k) in model if i == tid]
        if ks:
            pos = t.lookup(tid, keys_u64(b"".join(ks)))
            assert (pos >= 0).all()
            assert [int(s) for s in t.recs["slot"][pos]] == [model[(tid, k)] for k in ks]
    assert t.used == len(model)
    per_table: dict[int, int] = {}
    for tid, _ in model:
        per_table[tid] = per_table.get(tid, 0) + 1
    assert t.by_table == per_table  # what STATS' namespaces read: kept as records come and go, never scanned


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["ins", "del"]), st.integers(1, 2), st.integers(1, 40)),
                max_size=30), st.integers(0, 2**31))
def test_matches_a_dict_model(ops, seed):
    rng = np.random.default_rng(seed)
    t = DiskIndex(200)
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
    t = DiskIndex(10_000, path)
    k = _keys(rng, 5000)
    t.insert(3, k, np.arange(5000, dtype=np.uint32), np.arange(5000, dtype=np.uint32) * 7)
    t.remove(t.lookup(3, k[:1000]))
    k9 = _keys(rng, 100)
    t.insert(9, k9, np.arange(5000, 5100, dtype=np.uint32), np.zeros(100, dtype=np.uint32))
    t.flush()
    del t
    t = DiskIndex(10_000, path)  # reopened: the same records, the removed ones still gone
    pos = t.lookup(3, k)
    assert (pos[:1000] == -1).all() and (pos[1000:] >= 0).all() and t.used == 4100
    assert t.by_table == {3: 4000, 9: 100}  # counted again from the records at open
    assert (t.recs["crc"][pos[1000:]] == np.arange(1000, 5000) * 7).all()
    del t
    small = DiskIndex(3000, path)  # --disk-size shrank: what fits is imported, the rest dropped
    assert 2950 <= small.used <= 3000
    assert (small.lookup(3, k[1000:]) >= 0).sum() + (small.lookup(9, k9) >= 0).sum() == small.used
    assert sum(small.by_table.values()) == small.used


def test_a_full_table_places_nearly_every_block():
    t = DiskIndex(100_000)
    k = _keys(np.random.default_rng(3), 100_000)
    pos = t.insert(1, k, np.arange(100_000, dtype=np.uint32), np.zeros(100_000, dtype=np.uint32))
    assert (pos >= 0).mean() > 0.999 and len(set(pos[pos >= 0].tolist())) == t.used
    assert (t.lookup(1, k) == pos).all()


def test_memory_per_block_is_below_100_bytes():
    """Records and fingerprints, plus the disk tier's 7 bytes of slot arrays and 2.5 of ghost filters."""
    t = DiskIndex(1_000_000)
    per = t.memory_bytes / 1_000_000
    assert per == pytest.approx((RECORD.itemsize + 4) / LOAD_FACTOR, rel=0.01) and per + 7 + 2.5 <= 100


def test_a_table_built_in_memory_and_saved_is_found_again(tmp_path):
    """DiskIndex.save: the file a bench (or an import) writes in one pass opens as the same table."""
    t = DiskIndex(1000)
    k = np.random.default_rng(3).integers(0, 2**63, size=(700, 4), dtype=np.int64).astype(np.uint64)
    pos = t.insert(1, k, np.arange(700, dtype=np.uint32), np.arange(700, dtype=np.uint32) * 7)
    path = str(tmp_path / "index-4096.kvx")
    t.save(path)
    u = DiskIndex(1000, path)
    assert u.used == t.used == int((pos >= 0).sum())
    got = u.lookup(1, k)
    assert (got == pos).all()
    assert (u.recs["slot"][got[got >= 0]] == np.arange(700)[got >= 0]).all()


@pytest.fixture(params=["c", "numpy"])
def kernel(request, monkeypatch):
    """The table's compiled kernel (kvoffd/cache/tiers/_probe.c), or the numpy path it replaces: both
    must give the same answers (the numpy one serves where the kernel is not built)."""
    if request.param == "numpy":
        monkeypatch.setattr(table_module, "_probe", None)
    elif table_module._probe is None:
        pytest.skip("the compiled kernel is not built here (setup.py: no C compiler?)")
    return request.param


def test_the_compiled_kernel_is_built_where_there_is_a_compiler():
    """``make`` builds it (pip install -e .); a machine with a C compiler that lacks it has a broken
    install, and would answer LOOKUPs of disk hits several times slower (docs/benchmarks.md)."""
    if shutil.which("cc") is None or not sysconfig.get_config_var("INCLUDEPY"):
        pytest.skip("no C compiler here: the numpy path serves")
    assert table_module.KERNEL == "c"


@pytest.mark.parametrize("max_blocks", [8, 1000])
def test_lookup_find_and_probe_agree_with_a_model(kernel, max_blocks):
    """``lookup`` (batched), ``find`` (a few keys, their binary) and ``probe`` (how many leading keys may
    be held) against what was inserted: for keys present, absent, of another table, and sharing a
    present key's first three words (its buckets and fingerprint: the record decides), with each
    kernel (8 blocks: two buckets, so a key's two choices often coincide)."""
    rng = np.random.default_rng(3)
    t = DiskIndex(max_blocks)
    present = _keys(rng, max_blocks * 3 // 4)
    pos = t.insert(1, present, np.arange(len(present), dtype=np.uint32), np.zeros(len(present), dtype=np.uint32))
    held = pos >= 0
    assert held.sum() >= len(present) - 1
    twin = present[:3].copy()
    twin[:, 3] ^= np.uint64(1)  # same buckets, same fingerprint, another key
    absent = _keys(rng, 20)
    asked = np.concatenate([present, absent, twin])
    for tid in (1, 2):
        want = np.full(len(asked), -1, dtype=np.int64)
        if tid == 1:
            want[:len(present)] = pos
        got = t.lookup(tid, asked)
        assert got.tolist() == want.tolist()
        assert t.find(tid, asked.tobytes()) == want.tolist()
        assert [int(t.lookup(tid, asked[i:i + 1])[0]) for i in range(len(asked))] == want.tolist()
        blob = asked.tobytes()
        for lo in (0, len(present) - 2, len(present)):  # from a held run, across its end, from an absent key
            lead = t.probe(tid, blob[lo * 32:])
            exact = next((i for i, p in enumerate(want[lo:].tolist()) if p < 0), len(asked) - lo)
            assert lead >= exact  # never short of the held ones
            assert lead <= exact + 3  # only the twins may pass for held (their fingerprint is a held key's)
    assert t.probe(1, present[held].tobytes()) == int(held.sum())


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 2**31), st.integers(1, 300))
def test_the_kernels_agree_after_random_inserts_and_removals(seed, n):
    """The compiled kernel and the numpy path give the same positions for the same table, after inserts
    and removals in two tables (the kernel reads the fingerprints numpy maintains)."""
    if table_module._probe is None:
        pytest.skip("the compiled kernel is not built here")
    rng = np.random.default_rng(seed)
    t = DiskIndex(400)
    k = _keys(rng, n)
    t.insert(1, k[: n // 2], np.arange(n // 2, dtype=np.uint32), np.zeros(n // 2, dtype=np.uint32))
    t.insert(2, k[n // 2:], np.arange(n - n // 2, dtype=np.uint32), np.zeros(n - n // 2, dtype=np.uint32))
    gone = t.lookup(1, k[: n // 4])
    t.remove(gone[gone >= 0])
    asked = np.concatenate([k, _keys(rng, 16)])
    for tid in (1, 2):
        c = t.lookup(tid, asked)
        kern, table_module._probe = table_module._probe, None
        try:
            ref = t.lookup(tid, asked)
            ref_lead = t.probe(tid, asked.tobytes())
        finally:
            table_module._probe = kern
        assert c.tolist() == ref.tolist()
        assert t.probe(tid, asked.tobytes()) == ref_lead


@pytest.mark.parametrize("writer", ["c", "python"])
def test_the_file_follows_the_table_and_is_reserved_whole(tmp_path, writer, monkeypatch):
    """The index file is written behind the table by its writer thread (kvoffd/cache/tiers/indexfile.py),
    by the compiled ``write_pages`` or by the Python loop it replaces: once ``wait`` says a change is
    written, the file holds exactly the memory (header and every record), its space is allocated whole
    at creation (no hole a write could find the file system full in), it reopens to the same records,
    and a file truncated under the table is written whole again at the next change."""
    from kvoffd.cache.tiers import indexfile

    if writer == "python":
        monkeypatch.setattr(indexfile, "_probe", None)
    elif indexfile._probe is None:
        pytest.skip("the compiled kernel is not built here")
    path = tmp_path / "index-4096.kvx"
    rng = np.random.default_rng(11)
    t = DiskIndex(20_000, str(path))
    assert os.stat(path).st_blocks * 512 >= os.path.getsize(path) == indexfile.file_bytes(t.cap)
    assert (t._file._scratch is None) == (writer == "python")
    live = []
    for _ in range(12):
        k = _keys(rng, 700)
        pos = t.insert(2, k, rng.integers(0, 20_000, 700).astype(np.uint32), np.arange(700, dtype=np.uint32))
        live.append((k, pos))
        if len(live) > 3:
            _, old = live.pop(0)
            t.remove(old[old >= 0])
    assert t.wait(t.mark(), 10)
    on_disk = path.read_bytes()
    assert on_disk == bytes(t._file.image), "the file is not the table's memory"
    os.truncate(path, 0)
    k = _keys(rng, 10)
    t.insert(2, k, np.arange(10, dtype=np.uint32), np.zeros(10, dtype=np.uint32))
    assert t.wait(t.mark(), 10) and t._file.rewrites == 1
    assert path.read_bytes() == bytes(t._file.image)
    t.close()
    u = DiskIndex(20_000, str(path))
    assert u.used == t.used and u.note == ""
    for keys, pos in live:
        assert (u.lookup(2, keys) == pos).all()
    u.close()
