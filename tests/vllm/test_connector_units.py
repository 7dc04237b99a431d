"""The connector's pure parts: hash-stability refusal, key folding, settings, result aggregation."""

from __future__ import annotations

import subprocess
import sys
from types import SimpleNamespace

import pytest

pytestmark = pytest.mark.vllm


def _cfg(algo: str) -> SimpleNamespace:
    return SimpleNamespace(cache_config=SimpleNamespace(prefix_caching_hash_algo=algo))


def test_xxhash_without_pythonhashseed_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    from kvoffd_client.vllm.identity import UnsupportedConfig, check_hash_stability

    monkeypatch.delenv("PYTHONHASHSEED", raising=False)
    for algo in ("xxhash", "xxhash_cbor"):
        with pytest.raises(UnsupportedConfig, match="PYTHONHASHSEED"):
            check_hash_stability(_cfg(algo))
    check_hash_stability(_cfg("sha256"))
    check_hash_stability(_cfg("sha256_cbor"))
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    check_hash_stability(_cfg("xxhash"))


def test_fold_key() -> None:
    from kvoffd_client.protocol import KEY_SIZE
    from kvoffd_client.vllm.identity import fold_key

    h = bytes(range(32))
    assert fold_key(h) is h
    short = bytes(16)
    assert len(fold_key(short)) == KEY_SIZE and fold_key(short) == fold_key(bytes(16)) != fold_key(bytes(17))


def test_settings() -> None:
    from kvoffd_client.vllm.settings import Settings

    with pytest.raises(ValueError, match="kvoffd_address"):
        Settings.from_extra({})
    s = Settings.from_extra({"kvoffd_address": "ipc:///x", "kvoffd_lease_ms": "5000",
                             "kvoffd_store_decode": "false", "kvoffd_job_timeout_s": 3})
    assert (s.address, s.lease_ms, s.store_decode, s.job_timeout_s) == ("ipc:///x", 5000, False, 3.0)


def test_worker_meta_and_stats_aggregate() -> None:
    from kvoffd_client.vllm.metadata import KvoffdWorkerMeta
    from kvoffd_client.vllm.stats import KvoffdStats

    a = KvoffdWorkerMeta(stores_done={1: 1}, load_failed_at={"r": 2})
    b = KvoffdWorkerMeta(stores_done={1: 1, 2: 1}, stores_failed={2: 1}, load_failed_at={"r": 0})
    m = a.aggregate(b)
    assert m.stores_done == {1: 2, 2: 1} and m.stores_failed == {2: 1} and m.load_failed_at == {"r": 0}
    s = KvoffdStats()
    assert s.take() is None
    s.add("store_blocks", 3)
    t = s.take()
    assert t is not None and t.reduce() == {"store_blocks": 3} and s.is_empty()
    assert s.lifetime == {"store_blocks": 3}
    assert KvoffdStats(data=dict(t.to_dict())).aggregate(t).reduce() == {"store_blocks": 6}


def test_module_imports_nothing_heavy() -> None:
    """vLLM imports the connector module in its API-server process: it must not pull vllm or torch."""
    code = "import sys, kvoffd_client.vllm; assert 'vllm' not in sys.modules and 'torch' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)


def test_lookup_sends_a_slice_of_the_packed_keys_up_to_the_first_negative(daemon) -> None:
    """The scheduler sends LOOKUP its packed keys [start, limit), cut at the first key whose load
    failed recently (a negative entry), through a real client to a real daemon."""
    import time

    from kvoffd_client.client import KvoffdClient
    from kvoffd_client.vllm.sched_state import RequestState
    from kvoffd_client.vllm.scheduler import KvoffdScheduler
    from kvoffd_client.vllm.settings import Settings

    sent: list[bytes] = []

    class RecordingClient(KvoffdClient):
        def send_lookup(self, namespace, keys, lease_ms=0):
            sent.append(keys)
            return super().send_lookup(namespace, keys, lease_ms)

    sched = KvoffdScheduler(Settings(address=daemon.address), None, 1, "units")
    sched.state.identity = SimpleNamespace(namespace="units", hashes_per_block=1)
    sched.state.client = RecordingClient(daemon.address, heartbeat=False)
    try:
        assert sched.state.client.connect(10)
        hashes = [bytes([i]) * 32 for i in range(8)]
        st = RequestState(SimpleNamespace(request_id="r", block_hashes=hashes))
        now = time.monotonic()
        assert sched.lookups.send(st, 2, 6, now)
        assert sent[-1] == b"".join(hashes[2:6])
        sched.state.known.negative[hashes[4]] = now + 60
        assert sched.lookups.send(st, 2, 6, now)
        assert sent[-1] == b"".join(hashes[2:4])
        sched.state.known.negative[hashes[2]] = now + 60
        assert not sched.lookups.send(st, 2, 6, now) and len(sent) == 2
        reply = None
        for _ in range(500):
            reply = sched.state.client.take_reply(st.lookup.seq)
            if reply is not None:
                break
            time.sleep(0.01)
        assert reply is not None and reply.hits == 0  # the daemon took the packed keys
    finally:
        sched.state.client.close()


def test_a_miss_logs_its_keys_at_debug_for_kvoffctl_explain(daemon) -> None:
    """docs/operations.md's runbook takes a missed request's keys from the connector's debug log and
    passes them to ``kvoffctl explain``: the line must be there at DEBUG (and only then), name the
    namespace and the keys in hex, and the command it shows must run against the daemon."""
    import logging
    import os
    import time

    from kvoffd_client.client import KvoffdClient
    from kvoffd_client.vllm.scheduler import KvoffdScheduler
    from kvoffd_client.vllm.settings import Settings

    lines: list[str] = []

    class Collect(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("vllm.kvoffd")
    handler, level = Collect(), logger.level
    logger.addHandler(handler)
    sched = KvoffdScheduler(Settings(address=daemon.address, prefetch_lookups=False), None, 1, "units")
    sched.state.identity = SimpleNamespace(namespace="units-miss-log", hashes_per_block=1, block_size=16)
    sched.state.enabled = True
    sched.state.client = KvoffdClient(daemon.address, heartbeat=False)
    hashes = [bytes([0xA0 + i]) * 32 for i in range(6)]

    def lookup(req_id: str) -> None:
        req = SimpleNamespace(request_id=req_id, block_hashes=hashes, num_tokens=6 * 16 + 1)
        deadline = time.monotonic() + 10
        while sched.get_num_new_matched_tokens(req, 0)[0] is None:
            assert time.monotonic() < deadline, "no lookup answer"
            time.sleep(0.01)

    try:
        assert sched.state.client.connect(10)
        logger.setLevel(logging.INFO)
        lookup("quiet")
        assert not [m for m in lines if "missed" in m], "logged without debug on"
        logger.setLevel(logging.DEBUG)
        lookup("r1")
        line = next(m for m in lines if "request r1 missed" in m)
        assert hashes[0].hex() in line and hashes[5].hex() in line and "6 of" in line
        cmd = line[line.index("(kvoffctl ") + 1:-1].split()
        assert cmd[:4] == ["kvoffctl", "explain", "--namespace", "units-miss-log"]
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
        out = subprocess.run([sys.executable, "-m", "kvoffd.ops.ctl", "--address", daemon.address, "--json",
                              *cmd[1:]], capture_output=True, text=True, timeout=60, env=env)
        assert out.returncode == 0, out.stderr
        import json

        assert len(json.loads(out.stdout)) == 2  # one answer per key from the log
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        sched.state.client.close()


def test_known_keys_are_forgotten_while_the_daemon_is_out_of_reach(tmp_path) -> None:
    """The scheduler does not store again keys the daemon recently confirmed. A daemon out of reach
    may come back restarted and empty, and the scheduler's client may learn of the restart only after
    the worker's client registered with the new daemon (so a new daemon id alone is seen too late): a
    step taken while the link is down forgets what the daemon confirmed."""
    import time

    from engine_helpers import Daemon
    from kvtest import wait_until

    from kvoffd_client.client import KvoffdClient
    from kvoffd_client.vllm.scheduler import KvoffdScheduler
    from kvoffd_client.vllm.settings import Settings

    d = Daemon(tmp_path).start()
    sched = KvoffdScheduler(Settings(address=d.address), None, 1, "units")
    sched.state.identity = SimpleNamespace(namespace="units", hashes_per_block=1, block_size=16)
    sched.state.enabled = True
    sched.state.client = KvoffdClient(d.address, heartbeat=False)
    step = SimpleNamespace(preempted_req_ids=(), scheduled_new_reqs=[], kv_connector_block_state=None,
                           scheduled_cached_reqs=SimpleNamespace(resumed_req_ids=()), num_scheduled_tokens={})
    key = bytes(range(32))
    try:
        assert sched.state.client.connect(10)
        sched.build_connector_meta(step)
        sched.state.known.confirm([key], time.monotonic())
        sched.build_connector_meta(step)
        assert sched.state.known.is_known(key, time.monotonic()), "forgotten while the daemon is up"
        d.kill()
        assert wait_until(lambda: not sched.state.client.connected, 10)
        sched.build_connector_meta(step)
        assert not sched.state.known.is_known(key, time.monotonic()), "still trusted with the daemon out of reach"
    finally:
        sched.state.client.close()
        d.stop()


def test_kv_groups_classify_and_refuse() -> None:
    """Full and sliding groups are offloaded; a group whose blocks kvoffd cannot restore refuses the model."""
    import torch
    from vllm.v1.kv_cache_interface import ChunkedLocalAttentionSpec, FullAttentionSpec, SlidingWindowSpec

    from kvoffd_client.vllm.groups import GroupKind, UnsupportedGroups, group_key, kv_groups

    kw = {"block_size": 32, "num_kv_heads": 2, "head_size": 32, "dtype": torch.float32}

    def cfg(*specs: object) -> SimpleNamespace:
        return SimpleNamespace(kv_cache_groups=[SimpleNamespace(kv_cache_spec=s, layer_names=[f"l{i}"])
                                                for i, s in enumerate(specs)])

    gs = kv_groups(cfg(SlidingWindowSpec(**kw, sliding_window=64), FullAttentionSpec(**kw)))
    assert [(g.kind, g.window, g.layer_names) for g in gs] == [(GroupKind.SLIDING, 64, ("l0",)),
                                                             (GroupKind.FULL, 0, ("l1",))]
    with pytest.raises(UnsupportedGroups, match="ChunkedLocal"):
        kv_groups(cfg(ChunkedLocalAttentionSpec(**kw, attention_chunk_size=64), FullAttentionSpec(**kw)))
    with pytest.raises(UnsupportedGroups, match="block sizes"):
        kv_groups(cfg(FullAttentionSpec(**kw), SlidingWindowSpec(**{**kw, "block_size": 64}, sliding_window=64)))
    k = bytes(32)
    assert len({group_key(k, 0), group_key(k, 1), k}) == 3 and group_key(k, 1) == group_key(bytes(32), 1)


def _budget(extra: dict, block_bytes: int = 1000, device: str = "cpu", single_group: bool = True):
    from kvoffd_client.vllm.settings import Settings
    from kvoffd_client.vllm.syncload import SyncLoadBudget

    return SyncLoadBudget.from_settings(Settings.from_extra({"kvoffd_address": "ipc:///x", **extra}),
                                        block_bytes, device, single_group)


def test_sync_budget_is_per_step_and_derived_from_the_link() -> None:
    from kvoffd_client.vllm.syncload import PRIOR_RATE

    b = _budget({"kvoffd_sync_step_ms": 1})
    assert b.per_step() == int(PRIOR_RATE["cpu"] * 1e-3)
    assert _budget({"kvoffd_link_gbps": 4, "kvoffd_sync_step_ms": 2}).per_step() == 8_000_000
    b = _budget({"kvoffd_sync_load_bytes": 2500})
    assert b.take(2, 0.0) and not b.take(1, 0.0)  # 2000 spent, 500 left: a third block does not fit
    assert not b.take(3, 0.0)
    b.new_step()
    assert b.take(1, 0.0) and b.take(1, 0.0) and not b.take(1, 0.0)
    assert not b.take(0, 0.0)


def test_sync_budget_off_cases() -> None:
    assert not _budget({"kvoffd_sync_load_bytes": 0}).take(1, 0.0)
    assert not _budget({}, single_group=False).take(1, 0.0)  # vLLM takes block errors from one group only
    assert not _budget({}, block_bytes=0).take(1, 0.0)


def test_sync_budget_follows_measurements_and_cools_down_after_a_timeout() -> None:
    b = _budget({"kvoffd_sync_step_ms": 1})
    before = b.per_step()
    for _ in range(50):
        b.observe(nbytes=10_000_000, us=1000, timeouts=0, now=0.0)  # 10 GB/s measured
    b.new_step()
    assert b.per_step() > 4 * before and abs(b.rate - 1e10) / 1e10 < 0.01
    fixed = _budget({"kvoffd_link_gbps": 1, "kvoffd_sync_step_ms": 1})
    fixed.observe(nbytes=10_000_000, us=1000, timeouts=0, now=0.0)
    assert fixed.per_step() == 1_000_000  # a configured link speed is not overridden
    b.observe(0, 0, timeouts=1, now=100.0)
    assert not b.take(1, 105.0) and b.take(1, 111.0)


def test_worker_meta_aggregates_same_step_results() -> None:
    from kvoffd_client.vllm.metadata import KvoffdWorkerMeta

    a = KvoffdWorkerMeta(sync_settled={7: 1}, sync_bytes=100, sync_us=10)
    b = KvoffdWorkerMeta(sync_settled={7: 1, 8: 1}, sync_timeouts=1)
    assert not a.is_empty() and KvoffdWorkerMeta().is_empty()
    a.aggregate(b)
    assert a.sync_settled == {7: 2, 8: 1} and a.sync_timeouts == 1 and a.sync_bytes == 100 and a.sync_us == 10
