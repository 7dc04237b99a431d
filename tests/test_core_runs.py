"""Copy runs: contiguous blocks merge into one run, but never across a pool chunk.

The pool is page-locked (registered with the CUDA driver) in regions of whole chunks, and the driver
refuses one copy whose host range spans two registrations: a 400 MiB run made of neighbouring chunks'
slots failed with CUDA_ERROR_INVALID_VALUE on the H200 (tests/gpu/test_daemon_gpu.py
::test_engine_killed_mid_transfer). The CPU path follows the same rule.
"""

from __future__ import annotations

import numpy as np

from kvoffd.pool.allocator import Pool
from kvoffd.transfer.base import MappedMemory, coalesce, pool_chunks, run_descriptors
from kvoffd_client.protocol import Segment

SLOT = 4 << 20
CHUNK = 64 << 20


def _mapped(num_blocks: int) -> MappedMemory:
    return MappedMemory(engine_id="e", kind="test", size=num_blocks * SLOT, num_blocks=num_blocks,
                        segments=[Segment(0, SLOT, SLOT)], slot_bytes=SLOT)


def test_contiguous_blocks_merge_within_a_chunk_only():
    pool = Pool(4 * CHUNK, chunk_bytes=CHUNK)
    try:
        slots = np.array(pool.alloc(SLOT, 40), dtype=np.int64)  # 16 per chunk: chunks 0, 1 and half of 2
        assert list(slots) == [i * SLOT for i in range(40)]
        ids = np.arange(40)
        eng, dst, lens = run_descriptors(_mapped(64), ids, slots, pool.base_address)
        src, dst, lens = coalesce(eng, dst, lens, pool_chunks(dst, pool))
        assert list(lens) == [16 * SLOT, 16 * SLOT, 8 * SLOT]  # one run per chunk, none across
        for d, n in zip(dst.tolist(), lens.tolist(), strict=True):
            first, last = (d - pool.base_address) // CHUNK, (d + n - 1 - pool.base_address) // CHUNK
            assert first == last
        # without the chunk ids the same runs would become one 160 MiB copy across three chunks
        eng, dst2, lens2 = run_descriptors(_mapped(64), ids, slots, pool.base_address)
        assert list(coalesce(eng, dst2, lens2)[2]) == [40 * SLOT]
    finally:
        pool.close()
