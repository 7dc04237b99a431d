"""Drill: whose pool is it (issue 28, items 6 and 11).

What must hold: a daemon's pool lock covers its data, not only its metadata: a second daemon on the
same path never truncates, zeroes or writes the segments a live daemon maps, even when the live
daemon's metadata file was removed under it (item 6); and the default pool location cannot be taken
by another user: a squatter who pre-creates every name they can predict does not push the daemon
into private memory, and warm restart still works (item 11). Real daemons, a real engine (this
process), files on /dev/shm, the squatter as uid 65534 (setpriv).
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import signal
import subprocess
import uuid

import pytest
from kvtest import chain_keys, wait_until
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


def _addr_tag(address: str) -> str:
    return hashlib.sha256(address.encode()).hexdigest()[:12]


def _as_nobody(*cmd: str) -> None:
    subprocess.run(["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", *cmd], check=True,
                   timeout=30)


def _ours(prefix: str) -> list[str]:
    return [p for p in glob.glob(glob.escape(prefix) + "*") if os.lstat(p).st_uid == os.getuid()]


@pytest.mark.skipif(os.getuid() != 0, reason="plays another local user with setpriv (needs root)")
def test_a_squatted_default_pool_location_does_not_cost_the_warm_restart(make_daemon, tmp_path):
    """The socket directory is on disk, so the pool's default place is /dev/shm. uid 65534 makes, before
    the daemon's first start, the name the daemon used to take there (/dev/shm/kvoffd-<uid>-<address
    hash>.pool), the directory names a guess would give, and a symlink: before the fix the daemon kept
    its pool in private memory at every start (one WARNING) and every restart was cold."""
    from kvoffd.pool.format import fs_type

    if fs_type(str(tmp_path)) != "other":
        pytest.skip("needs a disk-backed temporary directory (the socket's; the pool then goes to /dev/shm)")
    address = f"ipc://{tmp_path}/sq.sock"
    tag = _addr_tag(address)
    legacy = f"/dev/shm/kvoffd-{os.getuid()}-{tag}.pool"
    prefix = f"/dev/shm/kvoffd-{os.getuid()}-{tag}"
    squatted = [legacy, f"{legacy}.0000", f"{prefix}-pool", f"{prefix}-00000000", f"{prefix}-link"]
    _as_nobody("sh", "-c", f"umask 0; touch {legacy} {legacy}.0000; mkdir -m 0777 {prefix}-pool {prefix}-00000000; "
               f"ln -s /root {prefix}-link")
    eng = ShmEngine(NB, SLOT, tag="squat")
    try:
        d = make_daemon("64MiB", "--pool-path", "", name="sq")  # "": the default location
        c = d.client(job_deadline_s=30.0)
        where = c.stats()["persistence"]["path"]
        assert where, f"the pool went to private memory:\n{d.log()}"
        assert where.startswith(f"{prefix}-") and os.path.dirname(where) not in squatted, where
        st = os.lstat(os.path.dirname(where))
        assert st.st_uid == os.getuid() and st.st_mode & 0o777 == 0o700
        assert "made by uid 65534" in d.log(), d.log()  # the squat attempt is named in the log
        c.register("sq-0", "sq", 0, 1, eng.memory, eng.layout)
        keys = chain_keys(NB, b"squat")
        _store(c, "sq-0", eng, 1, keys)
        assert wait_until(lambda: c.stats()["persistence"]["sealed_blocks"] >= NB, 10)
        assert d.stop(signal.SIGTERM) == 0
        d = make_daemon("64MiB", "--pool-path", "", name="sq")
        c = d.client(job_deadline_s=30.0)
        assert c.stats()["persistence"]["path"] == where
        assert c.stats()["persistence"]["adopted_blocks"] == NB
        c.register("sq-0", "sq", 0, 1, eng.memory, eng.layout)
        assert _served_exact(c, "sq-0", eng, 2, keys) == (NB, NB)
        assert d.stop(signal.SIGTERM) == 0
    finally:
        eng.close()
        for p in _ours(prefix):  # the daemon's pool directory (the squatter's entries are removed below)
            shutil.rmtree(p, ignore_errors=True)
        for p in squatted:
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            elif os.path.lexists(p):
                os.unlink(p)


def test_a_pool_at_the_old_default_name_moves_into_the_daemons_directory_warm(make_daemon, tmp_path):
    """A pool an older kvoffd kept at the old default (/dev/shm/kvoffd-<uid>-<address hash>.pool, its
    segments <path>.0000...) is moved into the new directory and adopted: the upgrade stays warm and
    leaves no file behind at the old name (it would be RAM until someone deleted it)."""
    from kvoffd.pool.format import fs_type, legacy_segment_path, segment_path

    if fs_type(str(tmp_path)) != "other":
        pytest.skip("needs a disk-backed temporary directory (the socket's; the pool then goes to /dev/shm)")
    address = f"ipc://{tmp_path}/mv.sock"
    prefix = f"/dev/shm/kvoffd-{os.getuid()}-{_addr_tag(address)}"
    legacy = f"{prefix}.pool"
    eng = ShmEngine(NB, SLOT, tag="move")
    try:
        d = make_daemon("64MiB", "--pool-path", legacy, name="mv")
        c = d.client(job_deadline_s=30.0)
        c.register("mv-0", "mv", 0, 1, eng.memory, eng.layout)
        keys = chain_keys(NB, b"move")
        _store(c, "mv-0", eng, 1, keys)
        assert wait_until(lambda: c.stats()["persistence"]["sealed_blocks"] >= NB, 10)
        assert d.stop(signal.SIGTERM) == 0
        os.rename(segment_path(legacy, os.stat(legacy).st_ino, 0), legacy_segment_path(legacy, 0))  # as before
        d = make_daemon("64MiB", "--pool-path", "", name="mv")
        c = d.client(job_deadline_s=30.0)
        where = c.stats()["persistence"]["path"]
        assert where.startswith(f"{prefix}-"), f"{where}\n{d.log()}"
        assert c.stats()["persistence"]["adopted_blocks"] == NB, d.log()
        assert not glob.glob(glob.escape(legacy) + "*")
        c.register("mv-0", "mv", 0, 1, eng.memory, eng.layout)
        assert _served_exact(c, "mv-0", eng, 2, keys) == (NB, NB)
        assert d.stop(signal.SIGTERM) == 0
    finally:
        eng.close()
        for p in _ours(prefix):
            if os.path.isdir(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                os.unlink(p)
