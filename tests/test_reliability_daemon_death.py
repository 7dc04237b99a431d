"""Drill: daemon death, at the client level. SIGKILL the daemon with >= 100 loads in flight.

What must hold (issue 6, drill 1; anchors §6.14 — LMCache #5047/#4517 retrieves hanging 600 s, #4670
a 2-minute reconnect stall): every job in flight gets a notice (failed, so the engine recomputes)
within the link grace, none hangs; a daemon started again on the same socket is found, the engine is
registered again and offloading resumes within 1 s, without restarting the engine.

The vLLM-level drill (a real engine, outputs identical to a run without kvoffd) is
tests/vllm/test_connector_degrade.py::test_daemon_sigkilled_while_loading (connector helper).
"""

from __future__ import annotations

import signal
import time

import pytest
from kvtest import chain_keys, wait_until
from reliability_util import ShmEngine, record

from kvoffd_client import protocol as P
from kvoffd_client.client import KvoffdClient

NB, SLOT = 64, 1 << 20  # 64 blocks of 1 MiB: one load of all of them moves 64 MiB


@pytest.mark.parametrize("outage_s", [0.0, 4.0])
def test_daemon_sigkilled_with_loads_in_flight_then_restarted(make_daemon, outage_s):
    """``outage_s``: how long the daemon stays dead before it is started again (the client's reconnect
    back-off grows meanwhile)."""
    d = make_daemon("256MiB", "--copy-threads", "1", name="dd")
    eng = ShmEngine(NB, SLOT, layers=2, tag="dd")
    c = KvoffdClient(d.address, timeout_s=5.0, job_deadline_s=30.0, link_grace_s=0.5)
    try:
        assert c.connect(10)
        c.register("dd-0", "dd", 0, 1, eng.memory, eng.layout)
        keys = chain_keys(NB, b"dd")
        eng.fill(range(NB), keys)
        c.submit_store("dd-0", 1, keys, range(NB))
        assert c.wait_notices({1}, 30)[0].ok
        jobs = set(range(100, 228))  # 128 loads of 64 MiB: 8 GiB to copy on one thread, seconds of work
        for j in jobs:
            c.submit_load("dd-0", j, keys, range(NB))
        in_flight = c.jobs_in_flight
        t_kill = time.monotonic()
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(10)
        got = c.wait_notices(jobs, 30)
        all_noticed_s = time.monotonic() - t_kill
        ok = [n for n in got if n.ok]
        failed = [n for n in got if not n.ok]
        assert in_flight >= 100
        assert len(got) == len(jobs), f"{len(jobs) - len(got)} jobs hung past the daemon's death"
        assert all(n.code in ("daemon_lost", "daemon_restarted") for n in failed), {n.code for n in failed}
        assert all_noticed_s < 0.5 + 1.5, f"jobs failed only after {all_noticed_s:.2f} s"
        assert eng.matches(range(NB), keys).all()  # completed loads left exact bytes

        # restart on the same socket: found, re-registered, serving, without touching the engine
        time.sleep(max(0.0, outage_s - (time.monotonic() - t_kill)))
        down_s = time.monotonic() - t_kill
        d2 = make_daemon("256MiB", name="dd")
        t_up = time.monotonic()
        watcher = d2.client()
        assert wait_until(lambda: c.connected, 10)
        reconnected_s = time.monotonic() - t_up
        assert wait_until(lambda: any(e["engine_id"] == "dd-0" for e in watcher.stats()["engines"]), 10, 0.005)
        reregistered_s = time.monotonic() - t_up
        c.submit_store("dd-0", 1000, keys[:8], range(8))
        assert c.wait_notices({1000}, 10)[0].ok
        eng.poison(range(8, 16))
        c.submit_load("dd-0", 1001, keys[:8], range(8, 16))
        assert c.wait_notices({1001}, 10)[0].ok
        assert eng.matches(range(8, 16), keys[:8]).all()
        resumed_s = time.monotonic() - t_up
        record(f"daemon_death_client_outage_{outage_s:g}s", loads_in_flight_at_kill=in_flight, load_mib_each=NB * SLOT >> 20,
               completed_before_kill=len(ok), failed_by_client=len(failed), hung=len(jobs) - len(got),
               all_noticed_s=round(all_noticed_s, 3), daemon_down_s=round(down_s, 2),
               reconnected_s=round(reconnected_s, 3), reregistered_s=round(reregistered_s, 3),
               store_load_round_trip_done_s=round(resumed_s, 3))
        assert reregistered_s < 1.0, f"offloading resumed only {reregistered_s:.2f} s after the daemon was up"
    finally:
        c.close()
        eng.close()


def test_requests_in_flight_are_answered_when_the_daemon_dies(make_daemon):
    """A lookup the daemon took with it is answered ``unavailable`` within the link grace, so the
    engine treats it as a miss now instead of waiting out its lookup timeout (seconds, in CI)."""
    d = make_daemon(name="dl")
    c = KvoffdClient(d.address, timeout_s=5.0, link_grace_s=0.5)
    try:
        assert c.connect(10)
        d.proc.send_signal(signal.SIGSTOP)  # the daemon cannot answer what is sent now
        seq = c.send_lookup("ns", chain_keys(4, b"dl"))
        assert seq is not None
        time.sleep(0.2)
        assert c.take_reply(seq) is None
        t_kill = time.monotonic()
        d.proc.send_signal(signal.SIGKILL)
        d.proc.wait(10)
        replies = []
        assert wait_until(lambda: replies.append(c.take_reply(seq)) or replies[-1] is not None, 5, 0.005)
        reply_s = time.monotonic() - t_kill
        assert isinstance(replies[-1], P.Error) and replies[-1].code == "unavailable", replies[-1]
        assert reply_s < 0.5 + 1.0, f"the lookup was answered only {reply_s:.2f} s after the daemon died"
    finally:
        c.close()
