"""The deploy/ files against the daemon they deploy.

* the systemd unit passes `systemd-analyze verify`, and its environment file is a valid config;
* the daemon really sends READY=1 over $NOTIFY_SOCKET (what Type=notify waits for);
* every metric (and label value) the Grafana dashboard and the alert rules query is one a live daemon
  exports, and every exported metric is documented in docs/metrics.md;
* the Kubernetes and compose YAML parse, and name the socket path, volumes and ports the daemon uses.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import time
from pathlib import Path

import yaml
from kvtest import start_daemon
from prometheus_client.parser import text_string_to_metric_families

from kvoffd import sdnotify
from kvoffd.config import Config, build_parser, load_config
from kvoffd_client.vllm.launch import kv_transfer_config

ROOT = Path(__file__).resolve().parent.parent
DEPLOY = ROOT / "deploy"
UNIT = DEPLOY / "systemd" / "kvoffd.service"
SYSTEMD_INSTALL = "apt-get update && apt-get install -y --no-install-recommends systemd"


# --------------------------------------------------------------------------------------------------
# systemd


def _unit() -> dict[str, str]:
    out = {}
    for line in UNIT.read_text().splitlines():
        if "=" in line and not line.lstrip().startswith(("#", ";", "[")):
            k, _, v = line.partition("=")
            out[k.strip()] = v.strip()
    return out


def _env_file(path: Path) -> dict[str, str]:
    env = {}
    for line in path.read_text().splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            k, _, v = line.partition("=")
            env[k] = v
    return env


def test_systemd_unit_verifies(tmp_path):
    tool = shutil.which("systemd-analyze")
    assert tool, f"systemd-analyze is needed for this check; install it with: {SYSTEMD_INSTALL}"
    kvoffd_bin = Path(sys.executable).with_name("kvoffd")
    assert kvoffd_bin.exists(), "the kvoffd console script is not installed (pip install -e .)"
    # verify checks that ExecStart exists: point it at this checkout's console script
    text = re.sub(r"^ExecStart=\S+", f"ExecStart={kvoffd_bin}", UNIT.read_text(), flags=re.M)
    unit = tmp_path / "kvoffd.service"
    unit.write_text(text)
    r = subprocess.run([tool, "verify", str(unit)], capture_output=True, text=True, timeout=60)
    complaints = [ln for ln in (r.stdout + r.stderr).splitlines() if "kvoffd.service" in ln]
    assert r.returncode == 0 and not complaints, r.stdout + r.stderr


def test_systemd_unit_has_what_the_daemon_needs():
    u = _unit()
    assert u["Type"] == "notify" and u["NotifyAccess"] == "main"
    assert u["LimitMEMLOCK"] == "infinity"
    assert u["Restart"] == "on-failure"
    assert u["RuntimeDirectory"] == "kvoffd" and u["RuntimeDirectoryMode"] == "0700"
    assert u.get("PrivateDevices", "no") == "no", "PrivateDevices hides /dev/nvidia* and /dev/shm"
    assert u.get("RemoveIPC", "no") == "no", "RemoveIPC would delete the engines' /dev/shm files (same user)"
    assert "MemoryDenyWriteExecute" not in u, "the CUDA driver needs W+X memory for its JIT"
    env = _env_file(DEPLOY / "systemd" / "kvoffd.env")
    cfg = load_config([], environ=env)  # every value the env file sets is one the daemon accepts
    assert cfg.address == f"ipc:///run/{u['RuntimeDirectory']}/kvoffd.sock"
    known = {"KVOFFD_" + a.dest.upper() for a in build_parser()._actions}
    assert set(env) <= known, set(env) - known
    assert "KVOFFD_POOL_PATH" not in env, "a fixed name in /dev/shm can be taken by any user: use the default"


def test_daemon_sends_ready_over_notify_socket(tmp_path):
    path = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(path)
    sock.settimeout(0.2)
    d = start_daemon(f"ipc://{tmp_path}/d.sock", "32MiB", env={**os.environ, "NOTIFY_SOCKET": path})
    try:
        got = []
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline and not any("READY=1" in m for m in got):
            try:
                got.append(sock.recv(4096).decode())
            except TimeoutError:
                pass
        assert any("READY=1" in m for m in got), got
    finally:
        d.stop()
        sock.close()


def test_sdnotify_module(tmp_path, monkeypatch):
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False  # outside systemd: a no-op
    path = str(tmp_path / "n.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind(path)
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    assert sdnotify.ready("serving on\nipc://x")
    msg = s.recv(4096).decode()
    assert msg.startswith("READY=1\n") and "STATUS=serving on ipc://x" in msg and "MAINPID=" in msg
    assert sdnotify.stopping("draining 2 jobs") and s.recv(4096).decode().startswith("STOPPING=1")
    s.close()
    # abstract namespace (@name)
    a = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    name = f"kvoffd-test-{time.monotonic_ns()}"
    a.bind("\0" + name)
    monkeypatch.setenv("NOTIFY_SOCKET", "@" + name)
    assert sdnotify.notify("STATUS=pinning 1/2 GiB") and a.recv(4096) == b"STATUS=pinning 1/2 GiB"
    a.close()
    monkeypatch.setenv("NOTIFY_SOCKET", str(tmp_path / "gone.sock"))
    assert sdnotify.notify("READY=1") is False  # never raises
    monkeypatch.setenv("WATCHDOG_USEC", "30000000")
    monkeypatch.delenv("WATCHDOG_PID", raising=False)
    assert sdnotify.watchdog_interval() == 15.0
    monkeypatch.setenv("WATCHDOG_PID", "1")
    assert sdnotify.watchdog_interval() is None  # meant for another process


# --------------------------------------------------------------------------------------------------
# Dashboard and alerts vs the live /metrics


def _exported(daemon) -> dict[str, dict[str, set[str]]]:
    """sample name -> label name -> values seen, from a live daemon's /metrics."""
    out: dict[str, dict[str, set[str]]] = {}
    for fam in text_string_to_metric_families(daemon.metrics()):
        for s in fam.samples:
            labels = out.setdefault(s.name, {})
            for k, v in s.labels.items():
                labels.setdefault(k, set()).add(v)
    return out


def _expressions() -> list[tuple[str, str]]:
    exprs: list[tuple[str, str]] = []

    def walk(o, where):
        if isinstance(o, dict):
            for k, v in o.items():
                if k in ("expr", "definition") and isinstance(v, str):
                    exprs.append((where, v))
                else:
                    walk(v, o.get("title", where) if isinstance(o.get("title"), str) else where)
        elif isinstance(o, list):
            for v in o:
                walk(v, where)

    walk(json.loads((DEPLOY / "grafana" / "kvoffd.json").read_text()), "grafana")
    for g in yaml.safe_load((DEPLOY / "prometheus" / "alerts.yaml").read_text())["groups"]:
        for rule in g["rules"]:
            exprs.append((f"alert {rule['alert']}", rule["expr"]))
    return exprs


_SELECTOR = re.compile(r"\b(kvoffd_[a-z0-9_]+)\b(\{[^}]*\})?")
_MATCHER = re.compile(r'([a-z_]+)\s*(=~|!=|!~|=)\s*"([^"]*)"')
_BY = re.compile(r"\b(?:by|without)\s*\(([^)]*)\)")


def test_dashboard_and_alerts_query_only_exported_metrics(daemon):
    exported = _exported(daemon)
    exprs = _expressions()
    assert len(exprs) > 20
    used = set()
    for where, e in exprs:
        assert e.count("(") == e.count(")"), f"{where}: unbalanced parentheses in {e}"
        names = []
        for name, sel in _SELECTOR.findall(e):
            if name.startswith("kvoffd_remote_"):  # the cluster tier's own series exist only with --remote:
                continue  # tests/test_tier_remote_ops.py checks the cluster row against a --remote daemon
            assert name in exported, f"{where}: {name} is not exported by the daemon"
            names.append(name)
            used.add(name)
            for label, op, value in _MATCHER.findall(sel or ""):
                if label in ("instance", "job"):
                    continue
                assert label in exported[name], f"{where}: {name} has no label {label}"
                if op == "=" and "$" not in value:
                    assert value in exported[name][label], f"{where}: {name}{{{label}}} never has {value!r}"
        for group in _BY.findall(e):
            for label in filter(None, (x.strip() for x in group.split(","))):
                ok = label in ("instance", "job", "le") or any(label in exported[n] for n in names) \
                    or len(names) < len(_SELECTOR.findall(e))  # a --remote series (tests/test_tier_remote_ops.py)
                assert ok, f"{where}: grouping by {label}, which no metric in the expression has"
    # the questions the dashboard must answer (issue 5): hit rate, GB/s vs ceiling, pool use,
    # evictions, errors, in-flight age
    for need in ("kvoffd_lookup_blocks_total", "kvoffd_transfer_gbps", "kvoffd_link_ceiling_gbps",
                 "kvoffd_pool_bytes", "kvoffd_evicted_blocks_total", "kvoffd_errors_total",
                 "kvoffd_oldest_in_flight_seconds", "kvoffd_misses_total", "kvoffd_dropped_stores_total"):
        assert need in used, f"the dashboard or alerts do not show {need}"


_SERVED = re.compile(r"rate\(kvoffd_loaded_blocks_total(\{[^}]*\})?\[[^]]+\](?: offset \w+)?\)\)\s*/\s*"
                     r"clamp_min\(sum by \(instance\) \(rate\(kvoffd_lookup_blocks_total(\{[^}]*\})?\[")


def test_hit_rate_panels_and_alert_use_served_blocks():
    """Issue 19, item 2: a block a LOOKUP found is not a block served (vLLM may already hold it, or
    ask again before scheduling the request: 187 found vs 150 loaded in one run). The hit-rate stat
    and the alert divide loaded blocks by blocks looked up; the over-time panel shows both, named."""
    exprs = _expressions()
    by_where: dict[str, list[str]] = {}
    for where, e in exprs:
        by_where.setdefault(where, []).append(e)
    stat = by_where["Hit rate (blocks served)"]
    assert len(stat) == 1 and _SERVED.search(stat[0]) and 'result="hit"' not in stat[0], stat
    alert = by_where["alert KvoffdHitRateDropped"]
    assert len(alert) == 1 and len(_SERVED.findall(alert[0])) == 2 and 'result="hit"' not in alert[0], alert
    over_time = by_where["Hit rate over time"]
    assert any(_SERVED.search(e) for e in over_time) and any('result="hit"' in e for e in over_time), over_time
    doc = (ROOT / "docs" / "metrics.md").read_text()
    assert "served" in doc and "kvoffd_loaded_blocks_total" in doc.split("## Transfers")[0], \
        "docs/metrics.md's hit-rate query must be the served one"


def test_every_exported_metric_is_documented(daemon):
    doc = (ROOT / "docs" / "metrics.md").read_text()
    documented = set(re.findall(r"`(kvoffd_[a-z0-9_]+)`", doc))
    exported = set()
    for f in text_string_to_metric_families(daemon.metrics()):
        if f.name.endswith("_created"):  # prometheus-client's per-series creation times
            continue
        exported.add(f.name + {"counter": "_total"}.get(f.type, ""))
    missing = exported - documented
    assert not missing, f"exported but not in docs/metrics.md: {sorted(missing)}"
    stale = documented - exported
    assert not stale, f"documented but not exported: {sorted(stale)}"


# --------------------------------------------------------------------------------------------------
# Kubernetes, compose, Dockerfile, scrape config


def _docs(name: str) -> list[dict]:
    return [d for d in yaml.safe_load_all((DEPLOY / "k8s" / name).read_text()) if d]


def _pod(doc: dict) -> dict:
    return doc["spec"]["template"]["spec"]


def _containers(pod: dict) -> dict[str, dict]:
    return {c["name"]: c for c in pod.get("initContainers", []) + pod.get("containers", [])}


def _env(c: dict) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def _engine_address(c: dict) -> str:
    args = c.get("args", []) + c.get("command", [])
    cfg = json.loads(args[args.index("--kv-transfer-config") + 1])
    address = cfg["kv_connector_extra_config"]["kvoffd_address"]
    assert cfg == kv_transfer_config(address)  # the one configuration (tests/test_docs_recipes.py)
    return address


def _mount_for(c: dict, path: str) -> dict:
    best = None
    for m in c.get("volumeMounts", []):
        if path.startswith(m["mountPath"].rstrip("/") + "/") and (best is None or len(m["mountPath"]) > len(best["mountPath"])):
            best = m
    assert best is not None, f"{c['name']}: nothing mounted above {path}"
    return best


def _check_kvoffd_container(c: dict) -> tuple[str, Config]:
    env = _env(c)
    cfg = load_config([], environ=env)
    default_port = Config().metrics_host_port[1]
    ports = {p["name"]: p["containerPort"] for p in c["ports"]}
    assert ports["kvoffd-metrics"] == cfg.metrics_host_port[1] == default_port
    assert cfg.metrics_host_port[0] == "0.0.0.0", "metrics must listen beyond loopback for Prometheus"
    assert c["readinessProbe"]["httpGet"] == {"path": "/readyz", "port": "kvoffd-metrics"}
    for probe in ("startupProbe", "livenessProbe"):  # never the metrics port: anyone on the node can load it
        assert c[probe]["exec"]["command"] == ["kvoffctl", "ping"] and "httpGet" not in c[probe], probe
        assert c[probe]["timeoutSeconds"] >= 5  # a Python process starting on a busy node
    assert cfg.address.startswith("ipc://")
    return cfg.address[len("ipc://"):], cfg


def test_k8s_sidecar_matches_the_daemon():
    (dep,) = _docs("sidecar.yaml")
    pod = _pod(dep)
    assert pod["shareProcessNamespace"] is True
    cs = _containers(pod)
    kv, vllm = cs["kvoffd"], cs["vllm"]
    assert kv.get("restartPolicy") == "Always"  # a native sidecar
    sock, cfg = _check_kvoffd_container(kv)
    assert _engine_address(vllm) == cfg.address
    m_kv, m_vllm = _mount_for(kv, sock), _mount_for(vllm, sock)
    assert m_kv["name"] == m_vllm["name"] and m_kv["mountPath"] == m_vllm["mountPath"]
    vols = {v["name"]: v for v in pod["volumes"]}
    assert "emptyDir" in vols[m_kv["name"]]
    assert _mount_for(kv, "/dev/shm/x")["name"] == _mount_for(vllm, "/dev/shm/x")["name"]
    # one UID for both (the socket is 0600)
    assert pod["securityContext"]["runAsUser"] == 10001
    assert all("runAsUser" not in c.get("securityContext", {}) for c in cs.values())


def test_k8s_daemonset_matches_the_daemon():
    docs = {d["kind"]: d for d in _docs("daemonset.yaml")}
    pod = _pod(docs["DaemonSet"])
    assert pod["hostPID"] is True
    cs = _containers(pod)
    sock, cfg = _check_kvoffd_container(cs["kvoffd"])
    vols = {v["name"]: v for v in pod["volumes"]}
    m = _mount_for(cs["kvoffd"], sock)
    host_dir = vols[m["name"]]["hostPath"]["path"]
    assert _mount_for(cs["socket-dir"], sock)["name"] == m["name"]
    # the engine example: hostPID, the same host directory at the same place, the same UID
    eng_pod = _pod(docs["Deployment"])
    assert eng_pod["hostPID"] is True
    eng = _containers(eng_pod)["vllm"]
    assert _engine_address(eng) == cfg.address
    em = _mount_for(eng, sock)
    assert em["mountPath"] == m["mountPath"]
    assert {v["name"]: v for v in eng_pod["volumes"]}[em["name"]]["hostPath"]["path"] == host_dir
    assert eng_pod["securityContext"]["runAsUser"] == cs["kvoffd"]["securityContext"]["runAsUser"]


def test_compose_matches_the_daemon():
    c = yaml.safe_load((DEPLOY / "docker" / "compose.yaml").read_text())
    s = c["services"]
    kv, vllm = s["kvoffd"], s["vllm"]
    # compose substitutes ${VAR:-default}; the defaults are what an unconfigured `up` runs with
    env = {k: re.sub(r"\$\{[A-Z_]+:-([^}]*)\}", r"\1", str(v)) for k, v in kv["environment"].items()}
    cfg = load_config([], environ=env)
    assert _engine_address({"args": vllm["command"]}) == cfg.address
    for svc in (kv, vllm):
        assert svc["pid"] == "service:pod" and svc["ipc"] == "service:pod"
        assert svc["ulimits"]["memlock"] == -1
        assert svc["deploy"]["resources"]["reservations"]["devices"][0]["capabilities"] == ["gpu"]
    assert s["pod"]["ipc"] == "shareable"
    vol = {v.split(":")[1]: v.split(":")[0] for v in kv["volumes"]}
    sock_dir = cfg.address[len("ipc://"):]
    mount = max((p for p in vol if sock_dir.startswith(p + "/")), key=len)
    assert f"{vol[mount]}:{mount}" in vllm["volumes"]
    assert kv["ports"] == [f"127.0.0.1:{cfg.metrics_host_port[1]}:{cfg.metrics_host_port[1]}"]


def test_dockerfile_runs_as_non_root_with_the_same_defaults():
    text = (DEPLOY / "docker" / "Dockerfile").read_text()
    users = re.findall(r"^USER\s+(\S+)", text, flags=re.M)
    assert users and not users[-1].startswith(("0", "root"))
    env = dict(re.findall(r"(KVOFFD_[A-Z_]+)=(\S+)", text))
    cfg = load_config([], environ=env)
    k8s_env = _env(_containers(_pod(_docs("sidecar.yaml")[0]))["kvoffd"])
    assert cfg.address == k8s_env["KVOFFD_ADDRESS"]
    assert f"EXPOSE {cfg.metrics_host_port[1]}" in text
    assert re.search(r'^\s+CMD \["kvoffctl", "ping"\]$', text, re.M)  # liveness on the daemon's own socket


def test_prometheus_scrape_config_finds_the_pods():
    sc = yaml.safe_load((DEPLOY / "prometheus" / "scrape.yaml").read_text())["scrape_configs"]
    pods = next(j for j in sc if "kubernetes_sd_configs" in j)
    keep = next(r for r in pods["relabel_configs"] if r.get("action") == "keep")
    assert re.fullmatch(keep["regex"], "kvoffd-metrics")
    static = next(j for j in sc if "static_configs" in j)
    assert all(t.endswith(f":{Config().metrics_host_port[1]}") for t in static["static_configs"][0]["targets"])




def test_a_request_line_that_is_not_utf8_is_a_404_without_a_traceback(make_daemon):
    """Issue 19 item 17: any local user could make the daemon log a traceback per request."""
    import socket

    d = make_daemon("16MiB", name="http-bytes")
    host, port = d.metrics_address.rsplit(":", 1)
    for _ in range(3):
        with socket.create_connection((host, int(port)), timeout=5) as s:
            s.sendall(b"GET /\xff\xfe HTTP/1.1\r\nHost: x\r\n\r\n")
            reply = s.recv(4096)
        assert reply.startswith(b"HTTP/1.1 404"), reply[:80]
    assert "Traceback" not in d.log() and "HTTP request failed" not in d.log()
