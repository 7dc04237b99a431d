"""Issue 33 point 9: a second daemon started on the address a daemon serves says the one true thing.

Before the fix it opened the pool and the disk tier first, both the first daemon's and locked, and
logged a pool-path tip ("... is in use by another kvoffd (give each daemon its own --pool-path); the
pool is kept in private memory") and "disk tier disabled" before the real error ("cannot start:
another daemon is serving on <socket>"). Real daemons: the first serves with a disk tier and its pool
in /dev/shm; the second, the same command line, must exit 1 with that error alone and touch nothing
of the first's.
"""

from __future__ import annotations

import fcntl
import hashlib
import os
import shutil
import socket

from daemon import DaemonProc, run_daemon
from kvtest import start_daemon, wait_until


def _problems(stderr: str) -> list[str]:
    """The lines of a log at WARNING or above."""
    return [ln for ln in stderr.splitlines() if " WARNING " in ln or " ERROR " in ln or "Traceback" in ln]


def _places(address: str) -> list[str]:
    tag = hashlib.sha256(address.encode()).hexdigest()[:12]
    return sorted(p for p in os.listdir("/dev/shm") if p.startswith(f"kvoffd-{os.getuid()}-{tag}"))


def test_a_second_daemon_on_a_served_socket_gives_the_real_error_alone(tmp_path):
    sock_dir = tmp_path / "s"
    sock_dir.mkdir(mode=0o700)
    address = f"ipc://{sock_dir}/d.sock"
    flags = ("--pool-path", "", "--disk-path", str(tmp_path / "disk"), "--disk-size", "64MiB")
    first = start_daemon(address, "64MiB", *flags)
    try:
        before = _places(address)
        pool = first.client().stats()["persistence"]["path"]
        r = run_daemon(["--address", address, "--pool-size", "64MiB", "--metrics-address", "127.0.0.1:0", *flags])
        assert r.returncode == 1, r.stderr[-3000:]
        problems = _problems(r.stderr)
        assert len(problems) == 1, "\n".join(problems)
        assert f"cannot start: another daemon is serving on {sock_dir}/d.sock" in problems[0], problems[0]
        for wrong in ("--pool-path", "private memory", "disk tier"):
            assert wrong not in r.stderr, r.stderr[-3000:]
        assert _places(address) == before  # nothing of the first's (nor a directory of its own) touched
        stats = first.client().stats()
        assert stats["persistence"]["path"] == pool
        tiers = {t["name"]: t for t in stats["tiers"]}
        assert "disabled" not in tiers["disk"], tiers  # the first daemon's disk tier still runs
    finally:
        assert first.stop() == 0
        for p in _places(address):
            shutil.rmtree(f"/dev/shm/{p}", ignore_errors=True)


def test_a_second_daemon_on_a_served_tcp_port_gives_the_real_error_alone(tmp_path, monkeypatch):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    holder.close()
    monkeypatch.setenv("KVOFFD_AUTH_TOKEN_FILE", str(tmp_path / "run" / "auth-token"))
    # a tcp:// daemon's private directory (the default pool's lock) is the runtime directory: the
    # test's own, not /tmp/kvoffd-<uid>, which would outlive it
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    address = f"tcp://127.0.0.1:{port}"
    first = start_daemon(address, "64MiB", "--pool-path", "")
    try:
        before = _places(address)
        r = run_daemon(["--address", address, "--pool-size", "64MiB", "--pool-path", "", "--metrics-address", "off"])
        assert r.returncode == 1, r.stderr[-3000:]
        problems = _problems(r.stderr)
        assert len(problems) == 1 and f"listens on 127.0.0.1:{port}" in problems[0], "\n".join(problems)
        assert "--pool-path" not in r.stderr and "private memory" not in r.stderr, r.stderr[-3000:]
        assert _places(address) == before
    finally:
        assert first.stop() == 0
        for p in _places(address):
            shutil.rmtree(f"/dev/shm/{p}", ignore_errors=True)


def _waits_for_lock(path: str, pid: int) -> bool:
    """Whether process ``pid`` is blocked waiting for a flock of ``path`` (/proc/locks' "->" lines)."""
    try:
        st = os.stat(path)
        with open("/proc/locks") as f:
            lines = [ln.split() for ln in f]
    except OSError:
        return False
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    return any(len(p) > 6 and p[1] == "->" and p[2] == "FLOCK" and p[5] == str(pid) and p[6] == want for p in lines)


def test_a_second_daemon_while_the_first_is_still_starting_gives_the_real_error_alone(tmp_path):
    """The first daemon is held inside its start (after it claimed the address, before its pool: this
    test holds the lock of its pool directory, which a starting daemon waits for), as a large pool's
    adoption holds it for seconds. The second must not reach the pool or bind the socket first."""
    sock_dir = tmp_path / "s"
    sock_dir.mkdir(mode=0o700)
    address = f"ipc://{sock_dir}/d.sock"
    first = start_daemon(address, "64MiB", "--pool-path", "")
    assert first.stop() == 0
    (place,) = _places(address)
    gate = os.open(f"/dev/shm/{place}", os.O_RDONLY | os.O_DIRECTORY)
    fcntl.flock(gate, fcntl.LOCK_EX)
    log = tmp_path / "first.log"
    starting = DaemonProc(address, ["--pool-size", "64MiB", "--pool-path", "", "--metrics-address", "off"],
                          log_path=log).spawn()
    try:
        assert wait_until(lambda: _waits_for_lock(f"/dev/shm/{place}", starting.pid) or starting.proc.poll() is not None,
                          30)
        assert starting.proc.poll() is None, log.read_text()
        r = run_daemon(["--address", address, "--pool-size", "64MiB", "--pool-path", "", "--metrics-address", "off"])
        assert r.returncode == 1, r.stderr[-3000:]
        problems = _problems(r.stderr)
        assert len(problems) == 1 and f"another daemon is starting on {sock_dir}/d.sock" in problems[0], problems
        fcntl.flock(gate, fcntl.LOCK_UN)
        starting.wait_ready(30)
        assert starting.proc.poll() is None and "cannot start" not in log.read_text(), log.read_text()
        assert not os.path.exists(f"{sock_dir}/d.sock.lock")  # the socket answers for it now
    finally:
        os.close(gate)
        starting.stop(timeout=30)
        for p in _places(address):
            shutil.rmtree(f"/dev/shm/{p}", ignore_errors=True)
