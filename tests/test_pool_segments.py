"""The pool file's data segments (issue 14: a fresh pool file pins as fast as private memory because
its data is several files, allocated in parallel; kvoffd/pool/format.py says why).

Real files on /dev/shm, mapped the way the daemon maps them; the daemon-level adoption of a pool is
tests/test_warm_restart.py's, and a missing segment is tested here against a real daemon.
"""

from __future__ import annotations

import os
import signal
import threading

from kvtest import chain_keys
from pools import WarmRig, close_pool, need_shm_room

from kvoffd.cache.restart.keeper import open_pool
from kvoffd.pool.format import MAX_SEGMENTS, SEGMENT_BYTES, PoolLayout, legacy_segment_path, segment_path

GiB, MiB = 1 << 30, 1 << 20
TWO_SEGMENTS = GiB + 128 * MiB


def test_segments_tile_the_pool_in_whole_chunks():
    chunk = 64 * MiB
    for size in (64 * MiB, TWO_SEGMENTS, 64 * GiB, 1536 * GiB, 2048 * GiB + chunk):
        lay = PoolLayout.of(size, chunk)
        segs = [lay.segment(i) for i in range(lay.num_segments)]
        assert segs[0][0] == 0 and sum(n for _, n in segs) == size
        assert all(a + n == b for (a, n), (b, _) in zip(segs, segs[1:], strict=False))
        assert all(n % chunk == 0 and n <= lay.segment_bytes for _, n in segs)
        assert lay.num_segments <= MAX_SEGMENTS
    assert PoolLayout.of(64 * GiB, chunk).num_segments == 64 and PoolLayout.of(64 * GiB, chunk).segment_bytes == SEGMENT_BYTES
    assert PoolLayout.of(TWO_SEGMENTS, chunk).num_segments == 2
    assert PoolLayout.of(2048 * GiB, chunk).segment_bytes == 2 * GiB  # at most MAX_SEGMENTS files
    assert PoolLayout.of(4 * MiB, 4 * MiB).num_segments == 1  # a pool below one chunk: one segment


def test_segments_are_mapped_side_by_side_and_allocated_in_parallel(pool_dir):
    need_shm_room(TWO_SEGMENTS)
    path = f"{pool_dir}/kvoffd.pool"
    pool, pf = open_pool(TWO_SEGMENTS, path, "ipc:///nonexistent/x.sock", cold=False)
    assert pf is not None and pf.layout.num_segments == 2
    assert [os.path.getsize(pf.segment_path(i)) for i in range(2)] == [GiB, 128 * MiB]
    assert pf.allocated == 0 and pool.provisioned.nbytes == 0
    told: list[int] = []
    pf.allocate(told.append, threading.Event(), threads=2)
    assert told == sorted(told) and told[-1] == TWO_SEGMENTS and pf.allocated == TWO_SEGMENTS, told
    assert all(os.stat(pf.segment_path(i)).st_blocks * 512 >= n for i, n in ((0, GiB), (1, 128 * MiB)))
    # the pool's bytes are the segments' bytes, each at its place
    pool.buffer[5 * MiB:5 * MiB + 4] = memoryview(b"seg0")
    pool.buffer[GiB + 7 * MiB:GiB + 7 * MiB + 4] = memoryview(b"seg1")
    with open(pf.segment_path(0), "rb") as f0, open(pf.segment_path(1), "rb") as f1:
        assert os.pread(f0.fileno(), 4, 5 * MiB) == b"seg0"
        assert os.pread(f1.fileno(), 4, 7 * MiB) == b"seg1"
    close_pool(pool, pf)


def test_a_smaller_pool_removes_the_segments_it_does_not_use(pool_dir):
    path = f"{pool_dir}/kvoffd.pool"
    pool, pf = open_pool(TWO_SEGMENTS, path, "ipc:///nonexistent/x.sock", cold=False)
    close_pool(pool, pf)
    assert os.path.exists(pf.segment_path(1))
    pool, pf = open_pool(64 * MiB, path, "ipc:///nonexistent/x.sock", cold=False)
    assert pf is not None and pf.previous is None  # another size: cold
    assert os.path.getsize(pf.segment_path(0)) == 64 * MiB and not os.path.exists(pf.segment_path(1))
    close_pool(pool, pf)
    assert sorted(os.listdir(pool_dir)) == ["kvoffd.pool", os.path.basename(pf.segment_path(0))]


def test_segments_of_another_metadata_file_are_never_opened_and_are_removed(pool_dir):
    """Segments named after another inode (a metadata file removed and made again) or by the names
    before the inode was in them, with no header that owns them, are unlinked, never truncated: a
    daemon that still maps them keeps its bytes; one's own are made fresh."""
    path = f"{pool_dir}/kvoffd.pool"
    stale = [segment_path(path, 12345, 0), legacy_segment_path(path, 0)]
    held = []
    for p in stale:
        with open(p, "wb") as f:
            f.write(b"theirs" * 1000)
        held.append(os.open(p, os.O_RDONLY))  # as a live daemon's mapping holds them
    try:
        pool, pf = open_pool(64 * MiB, path, "ipc:///nonexistent/x.sock", cold=False)
        assert pf is not None and pf.previous is None
        assert sorted(os.listdir(pool_dir)) == ["kvoffd.pool", os.path.basename(pf.segment_path(0))]
        assert all(os.pread(fd, 6, 0) == b"theirs" for fd in held)  # unlinked, not emptied
        close_pool(pool, pf)
    finally:
        for fd in held:
            os.close(fd)


def test_an_adopted_pool_keeps_its_segments_under_their_legacy_names_renamed(pool_dir):
    """A pool whose segments still have the names from before the inode was in them is adopted: its
    segments are renamed, their bytes kept."""
    path = f"{pool_dir}/kvoffd.pool"
    pool, pf = open_pool(64 * MiB, path, "ipc:///nonexistent/x.sock", cold=False)
    pf.allocate(lambda n: None, threading.Event())
    pool.buffer[3 * MiB:3 * MiB + 5] = memoryview(b"kept!")
    pf.write_header()
    close_pool(pool, pf)
    os.rename(pf.segment_path(0), legacy_segment_path(path, 0))
    pool, pf = open_pool(64 * MiB, path, "ipc:///nonexistent/x.sock", cold=False)
    assert pf is not None and pf.previous is not None, "not adopted"
    assert sorted(os.listdir(pool_dir)) == ["kvoffd.pool", os.path.basename(pf.segment_path(0))]
    assert bytes(pool.buffer[3 * MiB:3 * MiB + 5]) == b"kept!"
    close_pool(pool, pf)


def test_allocation_stops_at_a_segment_replaced_meanwhile(pool_dir):
    """A segment file swapped under the daemon is never allocated (nor written): the pool stays at the
    prefix before it, and whoever waits for the rest (the pinning threads) is told it is not coming."""
    need_shm_room(GiB)
    path = f"{pool_dir}/kvoffd.pool"
    pool, pf = open_pool(TWO_SEGMENTS, path, "ipc:///nonexistent/x.sock", cold=False)
    os.unlink(pf.segment_path(1))
    with open(pf.segment_path(1), "wb") as f:
        f.truncate(128 * MiB)
    pf.allocate(pool.provisioned.advance, threading.Event(), threads=2)
    pool.provisioned.end()
    assert "was replaced" in pf.error and pf.allocated == GiB
    assert pool.provisioned.nbytes == GiB and pool.provisioned.ended_short
    assert pool.provisioned.wait_for(GiB, threading.Event())
    assert not pool.provisioned.wait_for(TWO_SEGMENTS, threading.Event())
    assert os.stat(pf.segment_path(1)).st_blocks == 0
    close_pool(pool, pf)


def test_a_missing_segment_means_a_cold_start_in_one_line(make_daemon, pool_dir):
    r = WarmRig(make_daemon, f"{pool_dir}/kvoffd.pool", name="warm", stop_s=15)
    try:
        keys = chain_keys(16, b"seg")
        r.store(keys, range(16))
        r.sealed(16)
        r.d.proc.send_signal(signal.SIGTERM)
        assert r.d.proc.wait(15) is not None
        os.unlink(segment_path(r.pool_path, os.stat(r.pool_path).st_ino, 0))
        r.d = r.start()
        watcher = r.d.client()
        assert watcher.stats()["persistence"]["adopted_blocks"] == 0
        assert watcher.lookup(r.ns, keys).hits == 0
        lines = [ln for ln in r.d.log().splitlines() if "not adopted" in ln]
        assert len(lines) == 1 and "data segment kvoffd.pool.ino" in lines[0] and "cannot be examined" in lines[0], lines
    finally:
        r.close()
