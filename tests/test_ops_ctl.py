"""kvoffctl against a live daemon: every command, the JSON mode, and the unreachable case.

Runs the real console entry point in a subprocess (what an operator types), against a real daemon
with a stand-in engine that stores real blocks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from disktier import POOL, Rig, disk_flags, fill_and_spill
from kvtest import chain_keys, start_daemon, wait_until

NS = "ops-ctl"


def ctl(address: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvoffd.ops.ctl", "--address", address, *args],
                          capture_output=True, text=True, timeout=timeout)


@pytest.fixture
def loaded(make_daemon, engines):
    """A private daemon (clear must not touch other tests' data) holding 6 blocks of NS."""
    d = make_daemon("64MiB", name="ctl")
    eng = engines(d.address, "ctl-eng-0", namespace=NS, blocks=16)
    keys = chain_keys(6, b"ctl")
    eng("fill", ids=list(range(6)), seed=3)
    assert eng.store(1, keys, list(range(6)))["ok"]
    assert eng.lookup(keys)["hits"] == 6
    return d, eng, keys


def test_status_stats_engines_namespaces(loaded):
    d, _eng, _keys = loaded
    r = ctl(d.address, "status")
    assert r.returncode == 0, r.stderr
    assert "daemon" in r.stdout and "ping" in r.stdout and "hit rate" in r.stdout
    # one lookup found 6 of 6 blocks, but none was loaded: the served rate says so (issue 19, item 2)
    assert "0.0% served" in r.stdout and "100.0% found by lookup" in r.stdout, r.stdout
    r = ctl(d.address, "stats")
    assert r.returncode == 0, r.stderr
    assert "stored_blocks" in r.stdout and "capacity" in r.stdout
    r = ctl(d.address, "--json", "stats")
    st = json.loads(r.stdout)
    assert st["counters"]["stored_blocks"] == 6
    assert st["counters"]["lookup_hit_blocks"] == 6
    r = ctl(d.address, "engines")
    assert r.returncode == 0, r.stderr
    assert "ctl-eng-0" in r.stdout and NS in r.stdout and "0/1" in r.stdout
    r = ctl(d.address, "namespaces")
    assert r.returncode == 0, r.stderr
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith(NS))
    assert line.split()[2] == "6"
    assert [n["namespace"] for n in json.loads(ctl(d.address, "--json", "namespaces").stdout)] == [NS]


def test_status_hit_rate_counts_loaded_blocks(loaded):
    """A hit is "served" once its block is loaded into an engine, not when a LOOKUP found it: two
    lookups of 6 resident blocks and one load of 3 of them is 25% served, 100% found."""
    d, eng, keys = loaded
    assert eng.lookup(keys)["hits"] == 6
    assert eng.load(2, keys[:3], [8, 9, 10])["ok"]
    r = ctl(d.address, "status")
    assert r.returncode == 0, r.stderr
    assert "25.0% served" in r.stdout and "100.0% found by lookup" in r.stdout, r.stdout
    st = json.loads(ctl(d.address, "--json", "stats").stdout)["counters"]
    assert (st["loaded_blocks"], st["lookup_hit_blocks"], st["lookup_miss_blocks"]) == (3, 12, 0)


def test_explain_resident_and_never_seen(loaded):
    d, _eng, keys = loaded
    other = chain_keys(1, b"never")[0]
    r = ctl(d.address, "explain", "--namespace", NS, keys[0].hex(), other.hex())
    assert r.returncode == 0, r.stderr
    rows = r.stdout.splitlines()[1:]
    assert "resident" in rows[0] and "stored" in rows[0]
    assert "never_seen" in rows[1]
    r = ctl(d.address, "--json", "explain", "--namespace", "no-such-ns", keys[0].hex())
    assert json.loads(r.stdout)[0]["state"] == "namespace_unknown"


def test_clear_namespace_then_lookup_misses(loaded):
    d, eng, keys = loaded
    r = ctl(d.address, "clear", "--namespace", NS)
    assert r.returncode == 0, r.stderr
    assert "removed 6 blocks" in r.stdout
    assert "no jobs were in flight" in r.stdout
    assert eng.lookup(keys)["hits"] == 0  # the reset really resets
    r = ctl(d.address, "--json", "stats")
    assert json.loads(r.stdout)["counters"]["lookup_miss_blocks"] >= 6
    # store again, then clear everything
    assert eng.store(2, keys, list(range(6)))["ok"]
    r = ctl(d.address, "--json", "clear")
    assert json.loads(r.stdout) == {"namespace": "", "removed_blocks": 6, "in_flight_jobs": 0,
                                    "removed_tier_blocks": {}}  # no tier below the pool
    assert eng.lookup(keys)["hits"] == 0


def test_unreachable_daemon_is_one_line_and_exit_3(tmp_path):
    for address in (f"ipc://{tmp_path}/nobody.sock", "tcp://127.0.0.1:9"):
        r = ctl(address, "--timeout", "0.5", "status")
        assert r.returncode == 3
        assert "Traceback" not in r.stderr
        lines = r.stderr.strip().splitlines()
        assert len(lines) == 1 and "cannot reach kvoffd" in lines[0] and address in lines[0]


def test_stale_socket_is_named(tmp_path):
    import socket

    path = tmp_path / "stale.sock"
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    s.bind(str(path))  # a socket file nobody listens on, as a crashed daemon leaves
    s.close()
    r = ctl(f"ipc://{path}", "--timeout", "0.5", "status")
    assert r.returncode == 3 and "stale socket" in r.stderr


def test_bad_key_is_a_usage_error(tmp_path):
    r = ctl(f"ipc://{tmp_path}/x.sock", "explain", "--namespace", "n", "abcd")
    assert r.returncode == 2 and "64 hex digits" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("value", ["nan", "inf", "-1", "0", "1e9", "soon"])
def test_timeout_must_be_finite_and_positive(tmp_path, value):
    r = ctl(f"ipc://{tmp_path}/x.sock", "--timeout", value, "status")
    assert r.returncode == 2 and "--timeout" in r.stderr and "Traceback" not in r.stderr


def test_status_names_backends_readably(loaded):
    d, _eng, _keys = loaded
    r = ctl(d.address, "status")
    assert r.returncode == 0, r.stderr
    line = next(x for x in r.stdout.splitlines() if x.startswith("backends"))
    assert "cpu (threads" in line and "{" not in line


def test_default_address_comes_from_env(loaded, monkeypatch):
    d, _eng, _keys = loaded
    env = {"KVOFFD_ADDRESS": d.address, "PATH": "/usr/bin:/bin"}
    if "PYTHONPATH" in os.environ:  # (where kvoffd runs from a checkout, not an install)
        env["PYTHONPATH"] = os.environ["PYTHONPATH"]
    r = subprocess.run([sys.executable, "-m", "kvoffd.ops.ctl", "status"], capture_output=True, text=True, env=env,
                       timeout=30)
    assert r.returncode == 0, r.stderr
    assert d.address in r.stdout


def test_a_disk_tier_line_shows_spills_in_flight_and_an_unbuilt_index_kernel():
    """``kvoffctl status``'s tier line: the spills still being written, and a warning when the disk
    index answers through numpy because its compiled probe was not built at install."""
    from kvoffd.ops.ctl_status import tier_line

    t = {"name": "disk", "resident_bytes": 1 << 20, "resident_blocks": 4, "capacity_bytes": 1 << 30, "hits": 2,
         "spills": 9, "spills_in_flight": 3, "spills_dropped": {"busy": 1}, "notes": {"index_kernel": "numpy"}}
    line = tier_line(t)
    assert "9 spilled (1 dropped, 0 copied on the loop, 3 in flight)" in line
    assert "index probe numpy" in line
    assert "index probe" not in tier_line({**t, "notes": {"index_kernel": "c"}})


def test_ping_answers_for_liveness_probes_and_says_when_nobody_does(make_daemon):
    """`kvoffctl ping`: what the deployments' liveness probes run (deploy/k8s, deploy/docker) instead of
    /healthz on the metrics port, which any local user can load (issue 28, item 3)."""
    d = make_daemon("16MiB", name="ping")
    r = ctl(d.address, "ping")
    assert r.returncode == 0 and "answered in" in r.stdout, r.stderr
    assert json.loads(ctl(d.address, "--json", "ping").stdout)["ping_s"] > 0
    d.stop()
    r = ctl(d.address, "--timeout", "2", "ping")
    assert r.returncode == 3 and "cannot reach kvoffd" in r.stderr, (r.returncode, r.stderr)


def test_options_after_the_command_and_a_mistyped_namespace(loaded):
    """Issue 33 point 13: `kvoffctl status --address A` works as `kvoffctl --address A status`, and a
    CLEAR of a namespace the daemon does not hold is an error naming the ones it does, not a success
    that cleared nothing."""
    d, eng, keys = loaded
    r = subprocess.run([sys.executable, "-m", "kvoffd.ops.ctl", "stats", "--json", "--address", d.address],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["counters"]["stored_blocks"] == 6
    r = ctl(d.address, "clear", "--namespace", NS + "-typo")
    assert r.returncode == 1 and "no namespace 'ops-ctl-typo'" in r.stderr and repr(NS) in r.stderr, r.stderr
    assert eng.lookup(keys)["hits"] == 6  # nothing was cleared
    r = ctl(d.address, "clear", "--namespace", NS)
    assert r.returncode == 0, r.stderr
    assert eng.lookup(keys)["hits"] == 0


def _spaces(address: str) -> dict[str, dict]:
    r = ctl(address, "--json", "namespaces")
    assert r.returncode == 0, r.stderr
    return {n["namespace"]: n for n in json.loads(r.stdout)}


def _disk_blocks(n: dict | None) -> int:
    return ((n or {}).get("tiers") or {}).get("disk", {}).get("blocks", 0)


def _two_namespaces_on_disk(d) -> None:
    for ns in ("tenant-a", "tenant-b"):
        rig = Rig(d, ns=ns)
        fill_and_spill(rig, rounds=2)
        rig.c.unregister("disk-0")
        rig.close()
    c = d.client()
    assert wait_until(lambda: next(t for t in c.stats()["tiers"] if t["name"] == "disk")["spills_in_flight"] == 0,
                      30)


def test_namespaces_and_clear_count_the_disk_tier_and_one_namespace_leaves_every_tier(tmp_path):
    """Issue 33 point 10: `kvoffctl namespaces` shows each namespace's blocks in the pool and on disk
    (before: the pool's only), `kvoffctl clear --namespace` says what it removed from each, and it
    purges that namespace from every tier while another keeps all its blocks in both."""
    d = start_daemon(f"ipc://{tmp_path}/a.sock", POOL, *disk_flags(tmp_path))
    try:
        _two_namespaces_on_disk(d)
        before = _spaces(d.address)
        disk = next(t for t in d.client().stats()["tiers"] if t["name"] == "disk")
        assert _disk_blocks(before["tenant-a"]) >= 100 and _disk_blocks(before["tenant-b"]) >= 100, before
        assert _disk_blocks(before["tenant-a"]) + _disk_blocks(before["tenant-b"]) == disk["resident_blocks"]
        table = ctl(d.address, "namespaces").stdout
        assert "POOL BLOCKS" in table and "DISK BLOCKS" in table, table
        row = next(ln for ln in table.splitlines() if ln.startswith("tenant-a")).split()
        assert row[2] == f"{before['tenant-a']['blocks']:,}" and f"{_disk_blocks(before['tenant-a']):,}" in row[4:]

        r = ctl(d.address, "clear", "--namespace", "tenant-a")
        assert r.returncode == 0, r.stderr
        assert (f"removed {before['tenant-a']['blocks']} blocks from the pool, "
                f"{_disk_blocks(before['tenant-a'])} from the disk tier") in r.stdout, r.stdout
        after = _spaces(d.address)
        assert "tenant-a" not in after or (after["tenant-a"]["blocks"], _disk_blocks(after["tenant-a"])) == (0, 0)
        assert after["tenant-b"]["blocks"] == before["tenant-b"]["blocks"]
        assert _disk_blocks(after["tenant-b"]) == _disk_blocks(before["tenant-b"])
        c = d.client()
        assert c.lookup("tenant-a", chain_keys(100, b"old")).hits == 0
        assert c.lookup("tenant-b", chain_keys(100, b"old")).hits == 100  # from disk: untouched
    finally:
        d.stop()


def test_a_namespace_only_the_disk_holds_after_a_restart_is_listed_and_cleared(tmp_path):
    """After a restart, before any engine registers again, the disk's blocks are the daemon's all the
    same: `kvoffctl namespaces` lists their namespaces (before: "no namespaces") and `kvoffctl clear
    --namespace` takes one (before: refused as a namespace the daemon does not hold)."""
    args = disk_flags(tmp_path)
    d = start_daemon(f"ipc://{tmp_path}/a.sock", POOL, *args)
    try:
        _two_namespaces_on_disk(d)
        held = {ns: _disk_blocks(n) for ns, n in _spaces(d.address).items()}
    finally:
        d.stop()
    d = start_daemon(f"ipc://{tmp_path}/b.sock", POOL, *args)
    try:
        spaces = _spaces(d.address)
        assert {ns: _disk_blocks(n) for ns, n in spaces.items()} == held, spaces
        assert spaces["tenant-a"]["blocks"] == 0 and spaces["tenant-a"]["world_size"] == 1
        r = ctl(d.address, "clear", "--namespace", "tenant-a")
        assert r.returncode == 0, r.stderr
        assert f"removed 0 blocks from the pool, {held['tenant-a']} from the disk tier" in r.stdout, r.stdout
        assert set(_spaces(d.address)) == {"tenant-b"}
        r = ctl(d.address, "--json", "clear")
        assert json.loads(r.stdout)["removed_tier_blocks"] == {"disk": held["tenant-b"]}, r.stdout
        assert ctl(d.address, "namespaces").stdout.startswith("no namespaces")
    finally:
        d.stop()
