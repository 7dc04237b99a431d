"""A fresh pool file takes stores a chunk after its allocation starts, not a segment after (issue 29,
point 4: on the H200 host a fresh 64 GiB pool refused STOREs with ``pool_full`` while its first 1 GiB
segments were being allocated, 8 at a time).

Real files on /dev/shm, allocated the way the daemon allocates them (``PoolFile.allocate`` on its
threads); what the pool may hand out is what ``on_progress`` reports (``Pool.set_allocated_bytes``).
"""

from __future__ import annotations

import os
import threading

import pytest
from pools import close_pool, need_shm_room

from kvoffd.cache.restart.keeper import open_pool

GiB, MiB = 1 << 30, 1 << 20
CHUNK = 64 * MiB
TWO_SEGMENTS = GiB + 128 * MiB


@pytest.mark.parametrize("threads", [1, 2])
def test_a_fresh_pool_file_is_handed_out_a_chunk_at_a_time_while_it_is_allocated(pool_dir, threads):
    need_shm_room(TWO_SEGMENTS)
    path = f"{pool_dir}/kvoffd.pool"
    pool, pf = open_pool(TWO_SEGMENTS, path, "ipc:///nonexistent/x.sock", cold=False)
    assert pf is not None and pf.allocated == 0
    told: list[int] = []
    pf.allocate(told.append, threading.Event(), threads=threads)
    assert told[0] == CHUNK, told  # the first chunk, as soon as it is written
    assert told == sorted(set(told)) and all(n % CHUNK == 0 for n in told) and told[-1] == TWO_SEGMENTS, told
    assert len(told) >= GiB // CHUNK  # the first segment, chunk after chunk
    pf.write_header()  # as the daemon does at start: the next opener adopts this pool
    close_pool(pool, pf)
    os.truncate(pf.segment_path(1), 0)  # a segment the previous daemon had not allocated yet
    os.truncate(pf.segment_path(1), 128 * MiB)
    pool, pf = open_pool(TWO_SEGMENTS, path, "ipc:///nonexistent/x.sock", cold=False)
    assert pf.previous is not None and pf.allocated == GiB
    told = []
    pf.allocate(told.append, threading.Event(), threads=threads)  # posix_fallocate around adopted blocks
    assert told == [GiB + CHUNK, TWO_SEGMENTS], told
    close_pool(pool, pf)
