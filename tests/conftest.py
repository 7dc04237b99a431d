"""Real daemons and real engine processes for the tests.

``daemon`` is one daemon shared by the whole session (tests keep to their own namespaces, so sharing
is honest); ``make_daemon`` starts a private one for tests that need a fresh pool or kill it.
"""

from __future__ import annotations

import os
import shutil
import signal
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent / "support"))
# bench/support (a package): the engine stand-in and the keys the benches share with the tests
sys.path.append(str(Path(__file__).resolve().parents[1] / "bench"))
# Every daemon a test starts keeps its pool in private memory unless the test passes --pool-path
# (tests/test_warm_restart.py): the default, a persistent pool file, would be left in /dev/shm.
os.environ.setdefault("KVOFFD_POOL_PATH", "none")

from kvtest import DaemonProc, Engine, start_daemon  # noqa: E402


@pytest.fixture(scope="session", autouse=True)
def no_pool_left_behind(tmp_path_factory) -> Iterator[None]:
    """The suite leaves no pool in /dev/shm: at its end, every pool whose recorded address is under
    this session's temporary directory (a test's daemon that was killed, or a test that failed before
    its cleanup) is removed with ``kvoffd purge``'s own code, and named (a pool a live daemon holds is
    left, and named too)."""
    yield
    from kvoffd.pool.reap import PoolHeld, remove_pool, shm_pools

    base = f"ipc://{tmp_path_factory.getbasetemp()}/"
    for p in shm_pools():
        if p.address.startswith(base):
            try:
                remove_pool(p)
                print(f"\nconftest: removed a pool a test left in {p.directory} ({p.address})", file=sys.stderr)
            except (PoolHeld, OSError) as e:
                print(f"\nconftest: a pool a test left in {p.directory} stays: {e}", file=sys.stderr)


@pytest.fixture(scope="session", autouse=True)
def no_log_left_behind() -> Iterator[None]:
    """The daemons' log files (tests/support/kvtest.py) go to one directory, removed at the end: the
    suite left about 2,000 of them in /tmp per run."""
    d = tempfile.mkdtemp(prefix="kvoffd-test-logs-")
    os.environ["KVOFFD_TEST_LOG_DIR"] = d
    yield
    os.environ.pop("KVOFFD_TEST_LOG_DIR", None)
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def daemon() -> Iterator[DaemonProc]:
    tmp = tempfile.mkdtemp(prefix="kvoffd-shared-")
    d = start_daemon(f"ipc://{tmp}/kvoffd.sock", "512MiB")
    yield d
    d.stop()
    shutil.rmtree(tmp, ignore_errors=True)


@pytest.fixture
def make_daemon(tmp_path) -> Iterator:
    started: list[DaemonProc] = []

    def make(pool_size: str = "64MiB", *extra: str, name: str = "d") -> DaemonProc:
        d = start_daemon(f"ipc://{tmp_path}/{name}.sock", pool_size, *extra)
        started.append(d)
        return d

    yield make
    for d in started:
        d.stop(signal.SIGKILL)


@pytest.fixture
def pool_dir() -> Iterator[str]:
    """A private directory in /dev/shm for a test's pool files, removed after it."""
    from pools import shm_dir

    with shm_dir("pool") as d:
        yield d


@pytest.fixture
def pool_path(pool_dir: str) -> str:
    """A pool file's path (the file is the daemon's to make) in a private directory in /dev/shm."""
    return f"{pool_dir}/kvoffd.pool"


@pytest.fixture
def warm_rig(make_daemon, pool_path) -> Iterator:
    """``make(name=..., **kw)``: a ``WarmRig`` (tests/support/pools.py) on this test's pool file, closed
    after the test."""
    from pools import WarmRig

    made: list[WarmRig] = []

    def make(**kw) -> WarmRig:
        r = WarmRig(make_daemon, pool_path, **kw)
        made.append(r)
        return r

    yield make
    for r in made:
        r.close()


@pytest.fixture
def engines() -> Iterator:
    made: list[Engine] = []

    def make(address: str, engine_id: str, **kw: object) -> Engine:
        e = Engine(address, engine_id, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()


@pytest.fixture
def shm() -> Iterator:
    """Engine memory made the way the connector makes it (a sealed memfd), closed after the test."""
    from reliability_util import ShmEngine

    made: list[ShmEngine] = []

    def make(*a, **kw) -> ShmEngine:
        e = ShmEngine(*a, **kw)
        made.append(e)
        return e

    yield make
    for e in made:
        e.close()
