"""The pool checksum's compiled pass (kvoffd/cache/_rowsum.c) against numpy's (``block_sum_numpy``):
every block checksum the daemon has written or will compare (slot records, ``--verify``, the cluster
tier's value headers) must come out the same whichever of the two a machine runs."""

from __future__ import annotations

import shutil
import sysconfig

import numpy as np
import pytest

from kvoffd.cache import checksum
from kvoffd.cache.checksum import block_sum, block_sum_numpy, block_sums

needs_kernel = pytest.mark.skipif(checksum.KERNEL != "c", reason="the compiled checksum is not built here")


def test_the_kernel_is_built_where_there_is_a_compiler():
    """``make`` builds it (pip install -e .); a machine with a C compiler that lacks it has a broken install."""
    if shutil.which("cc") is None or not sysconfig.get_config_var("INCLUDEPY"):
        pytest.skip("no C compiler here: the numpy path serves")
    assert checksum.KERNEL == "c"


@needs_kernel
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 4095, 4096, 4097, 4096 * 3 + 8, 2 << 20, (2 << 20) + 5])
def test_same_value_as_numpy_for_every_length(n):
    """Whole rows, a partial row, words past the last row, a tail shorter than a word, and wrap-around
    of both 64-bit sums (every byte 0xFF)."""
    rng = np.random.default_rng(n)
    for data in (rng.integers(0, 256, n, dtype=np.uint8), np.full(n, 0xFF, dtype=np.uint8)):
        assert block_sum(data) == block_sum_numpy(data)
        assert block_sum(memoryview(data)) == block_sum_numpy(memoryview(data))
        assert block_sum(bytes(data)) == block_sum_numpy(bytes(data))


@needs_kernel
def test_unaligned_buffers_and_the_pool_runs_agree():
    """A block at an odd address (a slice of a bigger buffer), and ``block_sums`` (the pool's runs of
    neighbouring slots, numpy) gives the kernel's value for each block."""
    rng = np.random.default_rng(3)
    buf = rng.integers(0, 256, 8 * 16384 + 1, dtype=np.uint8)
    assert block_sum(buf[1:1 + 16384]) == block_sum_numpy(buf[1:1 + 16384])
    offsets = [0, 16384, 32768, 5 * 16384]
    assert block_sums(buf, offsets, 16384) == [block_sum(buf[o:o + 16384]) for o in offsets]


@needs_kernel
def test_every_single_changed_word_and_swapped_rows_change_it():
    """What the checksum promises (checksum.py): a changed word, and two rows trading places."""
    rng = np.random.default_rng(9)
    data = rng.integers(0, 256, 64 << 10, dtype=np.uint8)
    base = block_sum(data)
    for at in (0, 8, 4095, 4096, 30001, len(data) - 1):
        d = data.copy()
        d[at] ^= 0x10
        assert block_sum(d) != base
    d = data.copy()
    d[:4096], d[4096:8192] = data[4096:8192], data[:4096]
    assert block_sum(d) != base


@needs_kernel
def test_a_buffer_that_is_not_whole_words_is_refused_by_the_kernel():
    with pytest.raises(ValueError, match="whole 64-bit words"):
        checksum._rowsum.row_sums(b"x" * 12)
