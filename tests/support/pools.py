"""Pool files for the tests: a private directory in /dev/shm, the pool closed as the daemon's exit closes
it, and the warm-restart rig (one engine, one daemon killed and started again on one pool file).

The rigs of tests/test_warm_restart.py, test_warm_restart_busy.py and test_pool_segments.py are one
``WarmRig``; the pool-file tests share ``close_pool`` and ``need_shm_room``; ``shm_dir`` backs the
``pool_dir``/``pool_path`` fixtures of tests/conftest.py.
"""

from __future__ import annotations

import os
import shutil
import uuid
from collections.abc import Iterator
from contextlib import contextmanager

import pytest
from kvtest import wait_until
from reliability_util import ShmEngine

from kvoffd_client.client import KvoffdClient


@contextmanager
def shm_dir(tag: str) -> Iterator[str]:
    """A directory of this user's alone in /dev/shm (where a pool file lives in production), removed
    with what is in it."""
    d = f"/dev/shm/kvtest-{tag}-{uuid.uuid4().hex[:10]}"
    os.makedirs(d, mode=0o700)
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def close_pool(pool, pf) -> None:
    """As the daemon's exit does: the mappings (the metadata's holds the lock too) and the descriptor."""
    pf.map.close()
    pf.close()
    pool.close()


def need_shm_room(nbytes: int) -> None:
    """Skip unless /dev/shm has room for twice ``nbytes`` (a pool and the one adopted after it)."""
    st = os.statvfs("/dev/shm")
    if st.f_bavail * st.f_frsize < 2 * nbytes:
        pytest.skip(f"/dev/shm has less than {2 * nbytes >> 20} MiB free")


class WarmRig:
    """One engine (this process, its memory a sealed memfd) and the daemon it uses, stopped or killed and
    started again at one address on one pool file; the client re-registers by itself.

    ``name`` is the daemon's socket name, the memfd's tag and the namespace; the engine is ``<name>-0``.
    ``flags``: daemon flags of every start; ``stop_s``: how long a restart waits for the old daemon."""

    def __init__(self, make_daemon, pool_path: str, *, name: str, nb: int = 128, slot: int = 256 << 10,
                 pool: str = "64MiB", flags: tuple[str, ...] = (), stop_s: float = 30.0):
        self.make_daemon, self.pool_path, self.pool = make_daemon, pool_path, pool
        self.name, self.ns, self.engine_id = name, name, f"{name}-0"
        self.flags, self.stop_s = flags, stop_s
        self.d = self.start()
        self.eng = ShmEngine(nb, slot, layers=2, tag=name)
        self.c = KvoffdClient(self.d.address, timeout_s=5.0, job_deadline_s=30.0, link_grace_s=0.5)
        assert self.c.connect(10)
        self.c.register(self.engine_id, self.ns, 0, 1, self.eng.memory, self.eng.layout)
        self.job = 0

    def start(self, *extra: str, pool: str | None = None):
        return self.make_daemon(pool or self.pool, "--pool-path", self.pool_path, "--copy-threads", "1", *self.flags,
                                *extra, name=self.name)

    def submit(self, keys: list[bytes], ids: range) -> int:
        """Fill ``ids`` with ``keys``' contents and STORE them; the job, not waited for."""
        self.job += 1
        self.eng.fill(ids, keys)
        self.c.submit_store(self.engine_id, self.job, keys, ids)
        return self.job

    def store(self, keys: list[bytes], ids: range, wait: bool = True) -> int:
        job = self.submit(keys, ids)
        if wait:
            (n,) = self.c.wait_notices({job}, 30)
            assert n.ok, n
        return job

    def load(self, keys: list[bytes], ids: range):
        """Load ``keys`` into poisoned blocks ``ids``: (indices served, notice)."""
        self.eng.poison(ids)
        self.job += 1
        self.c.submit_load(self.engine_id, self.job, keys, ids)
        (n,) = self.c.wait_notices({self.job}, 30)
        served = [i for i in range(len(keys)) if i not in set(n.failed)]
        return served, n

    def exact(self, keys: list[bytes], ids: range, served: list[int]) -> None:
        """Every block served is exactly what was stored under its key."""
        ok = self.eng.matches([ids[i] for i in served], [keys[i] for i in served])
        assert ok.all(), f"{int((~ok).sum())} of {len(served)} blocks served after the restart are not byte-exact"

    def load_exact(self, keys: list[bytes], ids: range) -> list[int]:
        """``load``, each block served checked byte-exact; the indices served."""
        served, _ = self.load(keys, ids)
        self.exact(keys, ids, served)
        return served

    def persistence(self) -> dict:
        return self.d.client().stats()["persistence"]

    def sealed(self, n: int) -> None:
        """Every block stored so far has its record (a crash now loses none of them)."""
        assert wait_until(lambda: self.persistence()["sealed_blocks"] >= n, 10), self.persistence()

    def restart(self, sig: int | None, *extra: str, pool: str | None = None):
        """``sig`` to the daemon (None: it is dead already), then a new one; waits for the engine to be
        registered again and returns a client of the new daemon."""
        if sig is not None:
            self.d.proc.send_signal(sig)
        assert self.d.proc.wait(self.stop_s) is not None
        self.d = self.start(*extra, pool=pool)
        watcher = self.d.client()
        assert wait_until(lambda: any(e["engine_id"] == self.engine_id for e in watcher.stats()["engines"]), 15), \
            self.d.log()
        return watcher

    def close(self) -> None:
        self.c.close()
        self.eng.close()


def flip_block(pool_path: str, pool: str, slot: int) -> None:
    """Flip bytes of the block at pool offset ``slot`` in its segment file (a pool of size ``pool``), as a
    stray write while no daemon runs would."""
    import mmap

    from kvoffd.config import parse_size
    from kvoffd.pool.format import PoolLayout, pool_geometry, segment_path

    size = parse_size(pool)
    lay = PoolLayout.of(size, pool_geometry(size)[0])
    seg, at = divmod(slot + 1000, lay.segment_bytes)
    with open(segment_path(pool_path, os.stat(pool_path).st_ino, seg), "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        m[at:at + 4] = bytes(255 - x for x in m[at:at + 4])
