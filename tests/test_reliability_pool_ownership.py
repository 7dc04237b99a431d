"""Drill: whose pool is it (issue 28, items 6 and 11).

What must hold: a daemon's pool lock covers its data, not only its metadata: a second daemon on the
same path never truncates, zeroes or writes the segments a live daemon maps, even when the live
daemon's metadata file was removed under it (item 6); and the default pool location cannot be taken
by another user: a squatter who pre-creates every name they can predict does not push the daemon
into private memory, and warm restart still works (item 11). Real daemons, a real engine (this
process), files on /dev/shm, the squatter as uid 65534 (setpriv).
"""

from __future__ import annotations

import os
import shutil
import uuid

import pytest
from kvtest import chain_keys
from reliability_util import ShmEngine

NB, SLOT = 128, 256 << 10  # 32 MiB of blocks in a 64 MiB pool


@pytest.fixture
def pool_dir():
    d = f"/dev/shm/kvtest-own-{uuid.uuid4().hex[:10]}"
    os.makedirs(d, mode=0o700)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def _store(c, eng_id: str, eng: ShmEngine, job: int, keys: list[bytes]) -> None:
    ids = list(range(len(keys)))
    eng.fill(ids, keys)
    c.submit_store(eng_id, job, keys, ids)
    (n,) = c.wait_notices({job}, 30)
    assert n.ok, n


def _served_exact(c, eng_id: str, eng: ShmEngine, job: int, keys: list[bytes]) -> tuple[int, int]:
    """Load ``keys`` into poisoned blocks: (blocks served, of them byte-exact)."""
    ids = list(range(len(keys)))
    eng.poison(ids)
    c.submit_load(eng_id, job, keys, ids)
    (n,) = c.wait_notices({job}, 30)
    served = [i for i in ids if i not in set(n.failed)]
    return len(served), int(eng.matches(served, [keys[i] for i in served]).sum())


def test_a_second_daemon_never_takes_a_live_daemons_segments(make_daemon, pool_dir):
    """Daemon A serves from its pool; only its metadata file is removed; daemon B starts on the same
    path and stores blocks of its own. Before the fix B truncated and zeroed A's live segments (A went
    on answering ok with zeros), then wrote its blocks into them (A served B's bytes)."""
    path = f"{pool_dir}/kvoffd.pool"
    a = make_daemon("64MiB", "--pool-path", path, name="a")
    ea, eb = ShmEngine(NB, SLOT, tag="ownA"), ShmEngine(NB, SLOT, tag="ownB")
    try:
        ca = a.client(job_deadline_s=30.0)
        assert ca.stats()["persistence"]["path"] == path
        ca.register("own-a", "own", 0, 1, ea.memory, ea.layout)
        ka = chain_keys(NB, b"daemon-a")
        _store(ca, "own-a", ea, 1, ka)
        assert _served_exact(ca, "own-a", ea, 2, ka) == (NB, NB)

        os.unlink(path)  # an operator's cleanup script, or a mistaken rm: A keeps running
        b = make_daemon("64MiB", "--pool-path", path, name="b")  # returns once B's pool is allocated whole
        cb = b.client(job_deadline_s=30.0)
        assert cb.stats()["persistence"]["path"] == path
        assert cb.stats()["persistence"]["adopted_blocks"] == 0
        served, exact = _served_exact(ca, "own-a", ea, 3, ka)
        assert exact == served == NB, f"A served {served} blocks after B started, {exact} of them exact"

        cb.register("own-b", "own", 0, 1, eb.memory, eb.layout)
        kb = chain_keys(NB, b"daemon-b")
        _store(cb, "own-b", eb, 1, kb)
        served, exact = _served_exact(ca, "own-a", ea, 4, ka)
        assert exact == served == NB, f"A served {served} blocks after B stored, {exact} of them exact"
        assert _served_exact(cb, "own-b", eb, 2, kb) == (NB, NB)

        # A's pool is RAM until its files are gone: once A exits, only B's files are left
        assert a.stop() == 0
        left = sorted(os.listdir(pool_dir))
        ino = os.stat(path).st_ino
        assert all(f == "kvoffd.pool" or f.startswith(f"kvoffd.pool.ino{ino}.") for f in left), left
        assert b.stop() == 0
        b2 = make_daemon("64MiB", "--pool-path", path, name="b")  # B's pool is still B's: warm
        assert b2.client().stats()["persistence"]["adopted_blocks"] == NB
    finally:
        ea.close()
        eb.close()
