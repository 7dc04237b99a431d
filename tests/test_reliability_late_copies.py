"""Drill: late copies (issue 18, defect 1). A frozen or backlogged daemon must never write late.

Promise: no byte is read from or written to an engine block after the client was told the job failed,
and a job not started by its deadline never starts. The gate is the daemon itself: SIGSTOP (as the
cgroup freezer, ``docker pause`` or a swap storm would) once every job was accepted (a PING answered
after them), and SIGCONT once the deadlines are past. The engine then overwrites its blocks with a
sentinel, as an engine reusing them would: whatever the daemon writes after it thaws shows up.

Each job copies a whole number of syscall batches of one ``process_vm_readv`` call (64 runs here),
and a thread's SIGSTOP takes effect when that call returns, so once every daemon thread is stopped
no copy is half done. After SIGCONT, a copy thread can start at most one job it had checked just
before the stop (a check then the call, microseconds apart): hence ``<= COPY_THREADS`` below. (Such
a job is still answered before its blocks are free again: the client waits for the notice.)
"""

from __future__ import annotations

import os
import signal
import time

import numpy as np
import pytest
from kvtest import chain_keys, wait_until
from reliability_util import ShmEngine, block_content, metric_value, record

from kvoffd_client import protocol as P
from kvoffd_client.client import EXPIRY_GRACE_S, KvoffdClient

SLOT = 2 << 20  # 2 MiB blocks, 2 layers: 2 runs of 1 MiB per block
B = 16  # blocks per job: 32 MiB, 32 runs (one syscall batch)
JOBS = 12
COPY_THREADS = 1
SENTINEL = 0x5A


def _all_stopped(pid: int) -> bool:
    """Every thread of ``pid`` is in group stop (state T): none is inside a copy any more."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
        states = []
        for t in tids:
            with open(f"/proc/{pid}/task/{t}/stat", "rb") as f:
                data = f.read()
            states.append(data[data.rindex(b")") + 2:data.rindex(b")") + 3])
    except OSError:
        return False
    return all(s == b"T" for s in states)


def _freeze(pid: int) -> None:
    os.kill(pid, signal.SIGSTOP)
    assert wait_until(lambda: _all_stopped(pid), 10, 0.002), "the daemon did not stop"


def _collect(c: KvoffdClient, until: float) -> list[P.Notice]:
    """Notices that arrive before ``until`` (a bounded watch, not a race: nothing may arrive)."""
    got: list[P.Notice] = []
    while time.monotonic() < until:
        got += c.take_notices()
        time.sleep(0.02)
    return got


def _expired_total(d) -> float:
    try:
        return metric_value(d.metrics(), "kvoffd_expired_jobs_total")
    except KeyError:
        return 0.0


def _frozen_past_deadline(d, c: KvoffdClient, eng: ShmEngine, submit, deadline_s: float, hold_s: float):
    """Submit, barrier, freeze, overwrite the engine's blocks, hold the daemon past the deadlines,
    thaw. Returns (notices while frozen, the rest, seconds frozen, wall seconds to the last notice)."""
    jobs = submit()
    t_submit = time.monotonic()
    c.ping(timeout_s=10)  # the daemon answers in order: every job above was accepted and queued
    _freeze(d.proc.pid)
    t_frozen = time.monotonic()
    before = c.take_notices()  # jobs finished before the freeze (their blocks are the engine's again)
    eng.mem[...] = SENTINEL  # the engine reuses its blocks; whatever the daemon writes now shows up
    during = _collect(c, max(t_submit + deadline_s + hold_s, t_frozen + 0.2))
    frozen_s = time.monotonic() - t_frozen
    os.kill(d.proc.pid, signal.SIGCONT)
    t_cont = time.monotonic()
    done = {n.job_id for n in before + during}
    after = c.wait_notices(jobs - done, 30)
    wall = time.monotonic() - t_cont
    assert {n.job_id for n in before + during + after} == jobs, "a job never got its notice"
    return before, during, after, frozen_s, wall


def _ranges(j: int) -> list[int]:
    return list(range(j * B, (j + 1) * B))


@pytest.mark.parametrize("hold_s", [EXPIRY_GRACE_S + 1.0, pytest.param(30.0, marks=pytest.mark.slow)])
def test_frozen_daemon_writes_nothing_after_the_deadline(make_daemon, hold_s):
    """LOADs accepted in time, daemon frozen past their deadline and the old client's give-up: the
    client reports nothing while the daemon exists and is frozen; after the thaw, the jobs not yet
    started are answered ``expired`` and wrote not a byte; no byte changes after the last notice. The
    slow variant freezes for 30 s, past the daemon's --engine-timeout (10 s): thawed, it may drop the
    silent connection first, and the notices must still come."""
    d = make_daemon("128MiB", "--copy-threads", str(COPY_THREADS), name="late")
    eng = ShmEngine(JOBS * B, SLOT, layers=2, tag="late")
    c = KvoffdClient(d.address, timeout_s=5.0, job_deadline_s=1.0, link_grace_s=0.5)
    try:
        assert c.connect(10)
        c.register("late-0", "late", 0, 1, eng.memory, eng.layout)
        keys = chain_keys(B, b"late")
        eng.fill(range(B), keys)
        c.submit_store("late-0", 1, keys, range(B))
        assert c.wait_notices({1}, 10)[0].ok
        expired0 = _expired_total(d)

        def submit() -> set[int]:
            for j in range(JOBS):
                c.submit_load("late-0", 100 + j, keys, _ranges(j))
            return {100 + j for j in range(JOBS)}

        before, during, after, frozen_s, wall = _frozen_past_deadline(
            d, c, eng, submit, 1.0, hold_s)
        assert not [n for n in during if not n.ok], \
            f"the client failed {len(during)} jobs while the daemon that took them was frozen"
        at_notice = eng.digest()
        expired = [n for n in after if not n.ok]
        assert all(n.code == P.ErrorCode.EXPIRED.value for n in expired), {n.code for n in expired}
        # a job that wrote after the thaw started after its deadline (see the module docstring)
        late_started = [j for j in range(JOBS) if not (eng.read(_ranges(j)) == SENTINEL).all()]
        assert len(late_started) <= COPY_THREADS, f"{len(late_started)} jobs started after their deadline"
        assert expired, "no job was still queued at the freeze: the drill did not test anything"
        for n in expired:  # not one byte of a job the daemon answered expired
            ids = _ranges(n.job_id - 100)
            assert (eng.read(ids) == SENTINEL).all(), f"job {n.job_id} wrote after its deadline"
        assert wait_until(lambda: c.stats()["in_flight_jobs"] == 0, 10)
        assert eng.digest() == at_notice, "the engine's memory changed after the client's last notice"
        assert _expired_total(d) - expired0 == len(expired)
        record(f"late_copies_frozen_loads_{hold_s:g}s", jobs=JOBS, mib_each=B * SLOT >> 20, deadline_s=1.0,
               frozen_s=round(frozen_s, 2), done_before_freeze=len(before), failed_while_frozen=0,
               expired_after_thaw=len(expired), started_after_thaw=len(late_started),
               bytes_written_after_failure_notice=0, last_notice_after_thaw_s=round(wall, 3))
    finally:
        c.close()
        eng.close()


def test_frozen_daemon_never_publishes_reused_blocks(make_daemon):
    """STOREs accepted in time, daemon frozen, the engine overwrites the blocks: after the thaw no
    store publishes the overwritten bytes; another client's LOAD of the keys hits the original bytes
    or misses, never the sentinel (the cache-poisoning half of the defect)."""
    d = make_daemon("512MiB", "--copy-threads", str(COPY_THREADS), name="lates")
    eng = ShmEngine(JOBS * B, SLOT, layers=2, tag="lates")
    c = KvoffdClient(d.address, timeout_s=5.0, job_deadline_s=1.0, link_grace_s=0.5)
    reader = KvoffdClient(d.address, timeout_s=5.0, job_deadline_s=30.0)
    other = ShmEngine(B, SLOT, layers=2, tag="lates-r")
    try:
        assert c.connect(10) and reader.connect(10)
        c.register("lates-0", "lates", 0, 1, eng.memory, eng.layout)
        keys = [chain_keys(B, b"lates%d" % j) for j in range(JOBS)]
        for j in range(JOBS):
            eng.fill(_ranges(j), keys[j])

        def submit() -> set[int]:
            for j in range(JOBS):
                c.submit_store("lates-0", 200 + j, keys[j], _ranges(j))
            return {200 + j for j in range(JOBS)}

        before, during, after, frozen_s, _ = _frozen_past_deadline(d, c, eng, submit, 1.0, EXPIRY_GRACE_S + 1.0)
        assert not [n for n in during if not n.ok], "the client failed stores while their daemon was frozen"
        expired = [n for n in after if not n.ok]
        assert all(n.code == P.ErrorCode.EXPIRED.value for n in expired), {n.code for n in expired}
        assert expired, "no store was still queued at the freeze: the drill did not test anything"

        reader.register("lates-r", "lates", 0, 1, other.memory, other.layout)
        sentinel_hits = hits = 0
        for j in range(JOBS):
            other.mem[...] = 0
            reader.submit_load("lates-r", 1000 + j, keys[j], range(B))
            n = reader.wait_notices({1000 + j}, 10)[0]
            got = other.read(range(B))
            ok = np.ones(B, dtype=bool)
            ok[n.failed] = False
            sentinel_hits += int((got[ok] == SENTINEL).all(axis=1).sum())
            assert (got[ok] == block_content(keys[j], SLOT)[ok]).all(), f"store {200 + j} published wrong bytes"
            hits += int(ok.sum())
        assert sentinel_hits == 0
        record("late_copies_frozen_stores", jobs=JOBS, frozen_s=round(frozen_s, 2), done_before_freeze=len(before),
               expired_after_thaw=len(expired), blocks_hit_later=hits, poisoned_blocks_served=sentinel_hits)
    finally:
        c.close()
        reader.close()
        eng.close()
        other.close()


def test_backlog_past_its_deadline_is_not_copied(make_daemon):
    """A backlog of many small LOADs (each its own block), held past a short deadline: every job gets
    a notice, and the ones not started by their deadline are answered ``expired`` and copied nothing."""
    n_jobs, slot = 200, 2 << 20
    d = make_daemon("64MiB", "--copy-threads", str(COPY_THREADS), name="backlog")
    eng = ShmEngine(n_jobs, slot, layers=2, tag="backlog")
    c = KvoffdClient(d.address, timeout_s=5.0, job_deadline_s=0.5, link_grace_s=0.5)
    try:
        assert c.connect(10)
        c.register("bl-0", "bl", 0, 1, eng.memory, eng.layout)
        keys = chain_keys(1, b"backlog")
        eng.fill([0], keys)
        c.submit_store("bl-0", 1, keys, [0])
        assert c.wait_notices({1}, 10)[0].ok

        def submit() -> set[int]:
            for j in range(n_jobs):
                c.submit_load("bl-0", 10 + j, keys, [j])
            return {10 + j for j in range(n_jobs)}

        # held just past the deadline, short of the old client's give-up: the daemon alone decides
        before, during, after, _, wall = _frozen_past_deadline(d, c, eng, submit, 0.5, 0.1)
        assert not during
        expired = [n for n in after if not n.ok]
        assert all(n.code == P.ErrorCode.EXPIRED.value for n in expired), {n.code for n in expired}
        started_late = int((eng.read(range(n_jobs)) != SENTINEL).any(axis=1).sum())
        assert started_late <= COPY_THREADS, f"{started_late} jobs started after their deadline"
        assert expired
        for n in expired:
            assert (eng.read([n.job_id - 10]) == SENTINEL).all(), f"job {n.job_id} was copied after its deadline"
        record("late_copies_backlog", jobs=n_jobs, deadline_s=0.5, done_before_freeze=len(before),
               expired=len(expired), started_late=started_late, all_noticed_after_thaw_s=round(wall, 3))
    finally:
        c.close()
        eng.close()


@pytest.mark.parametrize("frozen", [True, False])
def test_daemon_killed_with_jobs_in_flight_fails_them_promptly(make_daemon, frozen):
    """A daemon that is gone cannot write: its jobs are failed at once (pidfd), frozen or not."""
    d = make_daemon("128MiB", "--copy-threads", "1", name="killed")
    eng = ShmEngine(JOBS * B, SLOT, layers=2, tag="killed")
    c = KvoffdClient(d.address, timeout_s=5.0, job_deadline_s=30.0, link_grace_s=60.0)
    try:
        assert c.connect(10)
        assert c._daemons.current is not None and c._daemons.current.watched
        c.register("k-0", "k", 0, 1, eng.memory, eng.layout)
        keys = chain_keys(B, b"killed")
        eng.fill(range(B), keys)
        c.submit_store("k-0", 1, keys, range(B))
        assert c.wait_notices({1}, 10)[0].ok
        jobs = set()
        for rnd in range(4):
            for j in range(JOBS):
                c.submit_load("k-0", 100 + rnd * JOBS + j, keys, _ranges(j))
                jobs.add(100 + rnd * JOBS + j)
        c.ping(timeout_s=10)
        if frozen:
            _freeze(d.proc.pid)
        in_flight = c.jobs_in_flight
        t_kill = time.monotonic()
        d.proc.kill()
        d.proc.wait(10)
        got = c.wait_notices(jobs, 10)
        noticed_s = time.monotonic() - t_kill
        assert {n.job_id for n in got} == jobs
        assert all(n.ok or n.code == "daemon_lost" for n in got), {n.code for n in got}
        # link_grace_s is 60 s: only the pidfd can have told the client this fast
        assert noticed_s < 2.0, f"jobs failed {noticed_s:.2f} s after the daemon died"
        record(f"late_copies_daemon_killed_{'frozen' if frozen else 'running'}", in_flight=in_flight,
               all_noticed_s=round(noticed_s, 3))
    finally:
        c.close()
        eng.close()
