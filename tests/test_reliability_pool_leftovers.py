"""Drill: a try-out gives its RAM back (issue 33, point 3).

What must hold: a pool's files are RAM (/dev/shm), kept when its daemon stops for the next start of
that address (the warm restart). So: a start that fails leaves no file behind (unless the files hold
a previous daemon's blocks, which the next start adopts); a pool no daemon can come back for (its
socket directory removed, as a test's or a bench's temporary directory is) is removed by the next
start of any daemon of the same user, with a line saying so, while a pool a live daemon holds, one
whose socket directory is a service manager's (/run, removed by `systemctl stop`) and another user's
pool are never touched; `kvoffd purge` gives a stopped daemon's memory back and refuses a live one's;
`make run` says all this on its first line. Real daemons, real pool files in /dev/shm, the other user
as an unused uid, a small tmpfs mounted here for the full-filesystem case.
"""

from __future__ import annotations

import glob
import hashlib
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
from daemon import DaemonProc, run_daemon
from kvtest import ROOT, chain_keys, start_daemon, wait_until
from reliability_util import ShmEngine

NB, SLOT = 64, 256 << 10  # 16 MiB of blocks in a 64 MiB pool
needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                                reason="needs root (a directory in /run, setpriv, a tmpfs mount)")


def _places(address: str, uid: int | None = None) -> list[str]:
    """The entries of /dev/shm named for the daemon of ``address`` (its pool directories)."""
    tag = hashlib.sha256(address.encode()).hexdigest()[:12]
    return sorted(glob.glob(f"/dev/shm/kvoffd-{os.getuid() if uid is None else uid}-{tag}*"))


def _disk_dir(tmp_path: Path, name: str) -> Path:
    """A private socket directory on a disk filesystem: the pool then goes to /dev/shm."""
    from kvoffd.pool.format import fs_type

    d = tmp_path / name
    d.mkdir(mode=0o700)
    if fs_type(str(d)) != "other":
        pytest.skip("needs a disk-backed temporary directory (the socket's; the pool then goes to /dev/shm)")
    return d


def _purge(*args: str, env: dict | None = None, user: tuple[str, ...] = ()) -> subprocess.CompletedProcess:
    return subprocess.run([*user, sys.executable, "-m", "kvoffd", "purge", *args], capture_output=True, text=True,
                          timeout=60, cwd=ROOT, env=env)


@pytest.fixture
def pool_daemon():
    """Starts a daemon with its pool at the default place (as ``uid`` when given). At the end every one
    still running is killed (a failed assertion must not leave a daemon), then what is left of their
    pools is removed."""
    started, addresses = [], []

    def start(address: str, *extra: str, uid: int | None = None):
        addresses.append((address, uid))
        args = ("--pool-path", "", "--copy-threads", "1", *extra)
        d = start_daemon(address, "64MiB", *args) if uid is None else _start_as(uid, address, *args)
        started.append(d)
        return d

    yield start
    for d in started:
        d.stop(signal.SIGKILL)
    for address, uid in addresses:
        for p in _places(address, uid):
            shutil.rmtree(p, ignore_errors=True)


@pytest.fixture
def lone_user(tmp_path):
    """(uid, a directory of its own under /tmp) for a uid no account and no other process has: only this
    test's daemons start as it, so only they reap its pools (any daemon of root, the suite's included,
    would reap root's; the assertions on who removed what would race with them)."""
    import pwd
    import random

    if os.geteuid() != 0:
        pytest.skip("needs root to start daemons as another uid")
    for uid in random.sample(range(61000, 64000), 50):
        try:
            pwd.getpwuid(uid)
        except KeyError:
            if not glob.glob(f"/dev/shm/kvoffd-{uid}-*"):
                break
    home = Path(tempfile.mkdtemp(prefix="kvtest-lone-"))  # reachable by that uid (tmp_path is not)
    os.chmod(home, 0o755)
    yield uid, home
    shutil.rmtree(home, ignore_errors=True)


def _users_dir(home: Path, name: str, uid: int) -> Path:
    d = home / name
    d.mkdir(mode=0o700)
    os.chown(d, uid, uid)
    return d


def _as(uid: int) -> tuple[str, ...]:
    return ("setpriv", "--reuid", str(uid), "--regid", str(uid), "--clear-groups")


def _start_as(uid: int, address: str, *args: str) -> DaemonProc:
    """A daemon as ``uid``, once it is ready (its READY=1: this user's client refuses another user's socket
    directory, rightly)."""
    return DaemonProc(address, ["--pool-size", "64MiB", "--metrics-address", "off", *args], wrapper=_as(uid)).start(30)


def _store(d, eng: ShmEngine, keys: list[bytes]) -> None:
    c = d.client(job_deadline_s=30.0)
    c.register("lo-0", "lo", 0, 1, eng.memory, eng.layout)
    ids = list(range(len(keys)))
    eng.fill(ids, keys)
    c.submit_store("lo-0", 1, keys, ids)
    (n,) = c.wait_notices({1}, 30)
    assert n.ok, n
    assert wait_until(lambda: c.stats()["persistence"]["sealed_blocks"] >= len(keys), 10)


def _run_failing(address: str, *extra: str) -> subprocess.CompletedProcess:
    return run_daemon(["--address", address, "--pool-size", "64MiB", "--pool-path", "", *extra])


@pytest.fixture
def busy_port():
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    yield holder.getsockname()[1]
    holder.close()


@pytest.mark.parametrize("failure", ["metrics_port", "backend"])
def test_a_failed_start_leaves_nothing_behind(tmp_path, busy_port, failure):
    """The start is refused after the pool was chosen and made (a metrics port another process holds,
    after the bind; a --backend this host cannot give, before it): before the fix the 64 MiB pool
    file and its directory stayed in /dev/shm, and the socket file with a busy metrics port."""
    if failure == "backend" and glob.glob("/dev/nvidia[0-9]*"):
        pytest.skip("a GPU host: --backend cuda would start")
    sock_dir = _disk_dir(tmp_path, "s")
    address = f"ipc://{sock_dir}/d.sock"
    extra = (("--metrics-address", f"127.0.0.1:{busy_port}") if failure == "metrics_port"
             else ("--backend", "cuda", "--metrics-address", "off"))
    r = _run_failing(address, *extra)
    try:
        assert r.returncode == 1, r.stderr[-3000:]
        assert "pool file /dev/shm/" in r.stderr, r.stderr[-3000:]  # the pool had been made
        assert _places(address) == [], f"left in /dev/shm: {_places(address)}\n{r.stderr[-3000:]}"
        assert sorted(os.listdir(sock_dir)) == [], os.listdir(sock_dir)
    finally:
        for p in _places(address):
            shutil.rmtree(p, ignore_errors=True)


def test_a_failed_start_keeps_an_adopted_pool_for_the_next_start(tmp_path, busy_port, pool_daemon):
    """A start that fails after it adopted a previous daemon's pool (an upgrade whose metrics port is
    still taken) must not cost the warm restart: the next start adopts every block."""
    address = f"ipc://{_disk_dir(tmp_path, 's')}/d.sock"
    eng = ShmEngine(NB, SLOT, tag="leftover-warm")
    keys = chain_keys(NB, b"leftover-warm")
    try:
        d = pool_daemon(address)
        _store(d, eng, keys)
        assert d.stop() == 0
        (place,) = _places(address)
        r = _run_failing(address, "--metrics-address", f"127.0.0.1:{busy_port}")
        assert r.returncode == 1 and "cannot serve metrics" in r.stderr, r.stderr[-3000:]
        assert _places(address) == [place]
        d = pool_daemon(address)
        assert d.client().stats()["persistence"]["adopted_blocks"] == NB, d.log()
        assert d.stop() == 0
    finally:
        eng.close()


@needs_root
def test_a_pool_with_no_room_leaves_no_empty_files(tmp_path):
    """A --pool-path on a tmpfs too small for the pool: the daemon serves from private memory (one
    ERROR). Before the fix the files it had made stayed there, truncated to nothing: one metadata file
    and one per segment at every such start."""
    mnt = tmp_path / "small"
    mnt.mkdir(mode=0o700)
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=16m,mode=0700", "tmpfs", str(mnt)], check=True, timeout=30)
    try:
        d = start_daemon(f"ipc://{tmp_path}/d.sock", "64MiB", "--pool-path", str(mnt / "kvoffd.pool"))
        try:
            assert d.client().stats()["persistence"]["path"] == "", d.log()
            assert "has 16.0 MiB free" in d.log(), d.log()
            assert os.listdir(mnt) == []
        finally:
            assert d.stop() == 0
        assert os.listdir(mnt) == []
    finally:
        subprocess.run(["umount", str(mnt)], check=True, timeout=30)


def test_the_next_start_reaps_a_pool_whose_socket_directory_is_gone(lone_user, pool_daemon):
    """Daemon A's socket lived in a temporary directory (as every test's and bench's does); it stops,
    and its pool is kept while the directory is there (A may come back), removed by the next start of
    another daemon of that user once the directory is gone, with one line naming it. A pool a live
    daemon holds is never removed, even with its socket directory gone. (Before the fix no start
    removed anything: 12 GiB of such pools filled /dev/shm.)"""
    uid, home = lone_user
    a_dir, l_dir, b_dir = (_users_dir(home, n, uid) for n in "alb")
    a, live, b = f"ipc://{a_dir}/d.sock", f"ipc://{l_dir}/d.sock", f"ipc://{b_dir}/d.sock"
    assert pool_daemon(a, uid=uid).stop() == 0
    (a_place,) = _places(a, uid)
    holder = pool_daemon(live, uid=uid)
    (live_place,) = _places(live, uid)
    assert pool_daemon(b, uid=uid).stop() == 0
    assert _places(a, uid) == [a_place], "removed while A's socket directory was there"
    shutil.rmtree(a_dir)
    shutil.rmtree(l_dir)  # under a live daemon: its pool is still held
    d = pool_daemon(b, uid=uid)
    assert _places(a, uid) == [], d.log()
    assert f"removed the pool in {a_place}" in d.log() and f"{a_dir} is gone" in d.log(), d.log()
    assert _places(live, uid) == [live_place] and os.path.exists(f"{live_place}/kvoffd.pool"), d.log()
    assert holder.proc.poll() is None


@needs_root
def test_a_stopped_services_pool_is_kept_when_its_runtime_directory_is_gone(tmp_path, pool_daemon):
    """`systemctl stop` removes the unit's RuntimeDirectory (/run/kvoffd): its daemon comes back at the
    next start, so another daemon's start keeps that pool, and the restart is warm."""
    run_dir = Path(f"/run/kvtest-{uuid.uuid4().hex[:10]}")
    address = f"ipc://{run_dir}/d.sock"
    eng = ShmEngine(NB, SLOT, tag="leftover-run")
    keys = chain_keys(NB, b"leftover-run")
    try:
        d = pool_daemon(address)
        _store(d, eng, keys)
        assert d.stop() == 0
        (place,) = _places(address)
        shutil.rmtree(run_dir)  # what systemctl stop does to RuntimeDirectory=
        o = pool_daemon(f"ipc://{_disk_dir(tmp_path, 'o')}/d.sock")
        assert o.stop() == 0
        assert _places(address) == [place], o.log()
        d = pool_daemon(address)
        assert d.client().stats()["persistence"]["adopted_blocks"] == NB, d.log()
        assert d.stop() == 0
    finally:
        eng.close()
        shutil.rmtree(run_dir, ignore_errors=True)


@needs_root
def test_another_users_pool_is_never_reaped(tmp_path, lone_user, pool_daemon):
    """Another user's daemon leaves its pool, its socket directory is removed: root's next start (which
    could remove anything) leaves it alone; only that user's own purge removes it."""
    uid, home = lone_user
    other_dir = _users_dir(home, "o", uid)
    address = f"ipc://{other_dir}/d.sock"
    assert pool_daemon(address, uid=uid).stop() == 0
    (place,) = _places(address, uid)
    shutil.rmtree(other_dir)
    root_daemon = pool_daemon(f"ipc://{_disk_dir(tmp_path, 'r')}/d.sock")
    assert _places(address, uid) == [place], root_daemon.log()
    r = _purge("--stale", user=_as(uid), env={**os.environ, "HOME": str(home)})
    assert r.returncode == 0 and f"removed {place}" in r.stdout, r.stdout + r.stderr
    assert _places(address, uid) == []


def test_purge_gives_back_a_stopped_daemons_pool_and_refuses_a_live_ones(tmp_path, pool_daemon):
    address = f"ipc://{_disk_dir(tmp_path, 's')}/d.sock"
    not_a_pool = tmp_path / "notes.txt"
    not_a_pool.write_text("an operator's file\n")
    d = pool_daemon(address)
    (place,) = _places(address)
    r = _purge("--address", address)
    assert r.returncode == 1, r.stdout + r.stderr
    assert f"in use by a running kvoffd (pid {d.proc.pid})" in r.stdout, r.stdout
    assert _places(address) == [place] and os.path.exists(f"{place}/kvoffd.pool")
    assert d.client().stats()["persistence"]["path"] == f"{place}/kvoffd.pool"  # still serving from it
    assert d.stop() == 0
    r = _purge("--address", address, "--pool-path", str(not_a_pool))
    assert r.returncode == 1 and "is not a kvoffd pool file: left alone" in r.stdout, r.stdout + r.stderr
    assert not_a_pool.read_text() == "an operator's file\n"
    assert f"removed {place}" in r.stdout, r.stdout  # the address's pool went all the same
    assert _places(address) == []
    r = _purge("--address", address)
    assert r.returncode == 0 and "nothing to remove" in r.stdout, r.stdout + r.stderr


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "kvoffd").exists(), reason="needs the project's .venv (make test)")
def test_make_run_says_where_the_pool_stays_and_purge_gives_it_back(tmp_path):
    """`make run`'s first line says the pool stays in /dev/shm after Ctrl-C and names the command that
    gives it back; after Ctrl-C the pool is there (the warm restart) and that command removes it."""
    rt = tmp_path / "rt"
    rt.mkdir(mode=0o700)
    env = {k: v for k, v in os.environ.items() if k != "KVOFFD_POOL_PATH"}  # the default place, as a user's
    env.update(XDG_RUNTIME_DIR=str(rt), KVOFFD_METRICS_ADDRESS="127.0.0.1:0", KVOFFD_POOL_SIZE="64MiB")
    address = f"ipc://{rt}/kvoffd/kvoffd.sock"
    make = subprocess.Popen(["make", "--no-print-directory", "run"], cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        first = make.stdout.readline()
        assert "/dev/shm" in first and "after Ctrl-C" in first and ".venv/bin/kvoffd purge" in first, first
        assert wait_until(lambda: (rt / "kvoffd" / "kvoffd.sock").exists() and _places(address), 60)
    finally:
        os.killpg(make.pid, signal.SIGINT)  # Ctrl-C
        out = make.communicate(timeout=30)[0]
    try:
        assert "its pool stays in memory in /dev/shm/" in out and "'kvoffd purge' gives the memory back" in out, out
        (place,) = _places(address)
        assert os.path.exists(f"{place}/kvoffd.pool")
        r = subprocess.run([str(ROOT / ".venv" / "bin" / "kvoffd"), "purge"], capture_output=True, text=True,
                           timeout=60, env=env)
        assert r.returncode == 0 and f"removed {place}" in r.stdout, r.stdout + r.stderr
        assert _places(address) == []
    finally:
        for p in _places(address):
            shutil.rmtree(p, ignore_errors=True)
