"""deploy/prometheus and deploy/grafana against a real Prometheus (issue 19, item 8).

* `promtool check rules` passes on alerts.yaml and `promtool check config` on the scrape config;
* `promtool test rules` passes alerts_test.yaml, which has, for every alert, a case where it fires and
  a case where it must stay quiet; mutated rules (an alert that never fires, one that always does)
  make it fail, so those cases are really checked;
* a real Prometheus (127.0.0.1, a free port, its own data directory) scrapes a live daemon with the
  scrape job of deploy/prometheus/scrape.yaml (targets and interval adapted) and the alert rules
  loaded: every dashboard query and every alert expression returns series, the hit-rate panel shows
  the served hit rate of the traffic the test made, a healthy daemon fires nothing, a stopped one
  makes KvoffdDown pending.

Without the binaries the tests skip with the reason where they cannot be installed (promtest.binaries).
"""

from __future__ import annotations

import copy
import json
import os
import re
import shutil
import subprocess
import time

import pytest
import yaml
from kvtest import chain_keys, wait_until
from promtest import PROMETHEUS_DIR, ROOT, Prometheus, binaries, comparisons_as_bool, without_offsets
from reliability_util import ShmEngine
from valkey_cluster import Servers, server_binary

ALERTS = PROMETHEUS_DIR / "alerts.yaml"
ALERT_TESTS = PROMETHEUS_DIR / "alerts_test.yaml"
SCRAPE = PROMETHEUS_DIR / "scrape.yaml"
DASHBOARD = ROOT / "deploy" / "grafana" / "kvoffd.json"


@pytest.fixture(scope="module")
def bins():
    return binaries()


def _rules() -> list[dict]:
    return [r for g in yaml.safe_load(ALERTS.read_text())["groups"] for r in g["rules"]]


def _panel_queries() -> list[tuple[str, str]]:
    """(panel title, expr) for every target of every panel, rows included."""
    out: list[tuple[str, str]] = []

    def walk(panels: list[dict]) -> None:
        for p in panels:
            walk(p.get("panels", []))
            out.extend((p.get("title", "?"), t["expr"]) for t in p.get("targets", []) if t.get("expr"))

    walk(json.loads(DASHBOARD.read_text())["panels"])
    return out


def _doc_queries() -> list[tuple[str, str]]:
    """(file, expr) for every ```promql block of the docs that show queries to operators."""
    out = []
    for name in ("metrics.md", "operations.md"):
        for block in re.findall(r"```promql\n(.*?)```", (ROOT / "docs" / name).read_text(), flags=re.S):
            out.append((f"docs/{name}", " ".join(block.split())))
    assert out
    return out


def _promtool(tool: str, *args: str, cwd=None) -> subprocess.CompletedProcess:
    return subprocess.run([tool, *args], capture_output=True, text=True, timeout=300, cwd=cwd)


# --------------------------------------------------------------------------------------------------
# promtool


def test_promtool_checks_the_rules_and_the_scrape_config(bins, tmp_path):
    r = _promtool(bins.promtool, "check", "rules", str(ALERTS))
    assert r.returncode == 0 and f"SUCCESS: {len(_rules())} rules found" in r.stdout, r.stdout + r.stderr
    # the deploy's scrape jobs as shipped, inside a whole prometheus.yml. Debian's build of Prometheus
    # has no Kubernetes discovery ("field kubernetes_sd_configs not found"): there the pods' job is
    # checked by the YAML tests of test_ops_deploy.py only.
    cfg = {"rule_files": [str(ALERTS)], **yaml.safe_load(SCRAPE.read_text())}
    (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
    r = _promtool(bins.promtool, "check", "config", str(tmp_path / "prometheus.yml"))
    if r.returncode != 0 and "field kubernetes_sd_configs not found" in r.stdout + r.stderr:
        cfg["scrape_configs"] = [j for j in cfg["scrape_configs"] if "kubernetes_sd_configs" not in j]
        (tmp_path / "prometheus.yml").write_text(yaml.safe_dump(cfg))
        r = _promtool(bins.promtool, "check", "config", str(tmp_path / "prometheus.yml"))
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def _evals_by_alert() -> dict[str, list[list]]:
    out: dict[str, list[list]] = {}
    for t in yaml.safe_load(ALERT_TESTS.read_text())["tests"]:
        for ev in t.get("alert_rule_test", []):
            out.setdefault(ev["alertname"], []).append(ev.get("exp_alerts") or [])
    return out


def test_promtool_unit_tests_pass_and_cover_every_alert(bins):
    evals = _evals_by_alert()
    for rule in _rules():
        name = rule["alert"]
        assert any(evals.get(name, [])), f"alerts_test.yaml never expects {name} to fire"
        assert any(not e for e in evals[name]), f"alerts_test.yaml never expects {name} to stay quiet"
    assert set(evals) <= {r["alert"] for r in _rules()}, "alerts_test.yaml tests an alert that does not exist"
    r = _promtool(bins.promtool, "test", "rules", ALERT_TESTS.name, cwd=PROMETHEUS_DIR)
    assert r.returncode == 0 and "SUCCESS" in r.stdout, r.stdout + r.stderr


def test_the_unit_tests_catch_an_alert_that_never_or_always_fires(bins, tmp_path):
    """Each alert mutated twice: its expression made never true (`vector(1) == 0`), and made true for
    every series it compares, at once (comparisons as `bool`, no `for`). Run on only that alert's
    test cases, promtool must fail both: the firing case catches the first, a quiet case the second."""
    tests = yaml.safe_load(ALERT_TESTS.read_text())
    rules = yaml.safe_load(ALERTS.read_text())
    files: dict[str, str] = {}
    for rule in _rules():
        name = rule["alert"]
        for kind in ("never", "always"):
            mutated = copy.deepcopy(rules)
            for r in (r for g in mutated["groups"] for r in g["rules"] if r["alert"] == name):
                if kind == "never":
                    r["expr"] = "vector(1) == 0"
                else:
                    r["expr"] = comparisons_as_bool(r["expr"])
                    r.pop("for", None)
            stem = f"{name}-{kind}"
            (tmp_path / f"{stem}-rules.yaml").write_text(yaml.safe_dump(mutated))
            mine = [t for t in tests["tests"] if any(e["alertname"] == name for e in t["alert_rule_test"])]
            t = {**tests, "rule_files": [f"{stem}-rules.yaml"], "tests": mine}
            (tmp_path / f"{stem}-test.yaml").write_text(yaml.safe_dump(t))
            files[stem] = f"{stem}-test.yaml"
    # one promtool for all: it names each file on stdout and writes its failures to stderr, unbuffered
    r = subprocess.run([bins.promtool, "test", "rules", *files.values()], cwd=tmp_path, timeout=300,
                       stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    assert r.returncode != 0
    sections = dict(re.findall(r"Unit Testing:\s+(\S+)\n(.*?)(?=Unit Testing:|\Z)", r.stdout, flags=re.S))
    for stem, f in files.items():
        out = sections.get(f, "")
        assert "FAILED" in out, f"{stem}: the unit tests passed a mutated alert:\n{out}"
        if stem.endswith("-always"):
            assert "exp:[]" in out, f"{stem}: no quiet case caught an alert firing everywhere:\n{out}"


def test_make_says_what_it_does_when_prometheus_is_missing(tmp_path):
    """Like check-systemd: with NO_APT=1 `make` only prints how to install the package."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("needs make")
    bin_dir = tmp_path / "bin"  # the shell's tools, no prometheus, no promtool, no apt-get
    bin_dir.mkdir()
    for tool in ("sh", "id"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    r = subprocess.run([make, "--no-print-directory", "check-prometheus", "NO_APT=1"], cwd=ROOT,
                       env={**os.environ, "PATH": str(bin_dir)}, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "promtool are missing" in r.stdout and "apt-get install" in r.stdout, r.stdout
    assert "running apt-get" not in r.stdout


# --------------------------------------------------------------------------------------------------
# a real Prometheus scraping a live daemon


def _config(*targets: str) -> dict:
    """The deploy's static scrape job, pointed at the test daemon and scraped every second, with the
    alert rules loaded. (The Kubernetes job needs an API server; promtool checks it above.)"""
    job = copy.deepcopy(next(j for j in yaml.safe_load(SCRAPE.read_text())["scrape_configs"]
                             if "static_configs" in j))
    job["static_configs"] = [{"targets": list(targets)}]
    job["scrape_interval"] = job["scrape_timeout"] = "1s"
    return {"global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
            "rule_files": [str(ALERTS)], "scrape_configs": [job]}


def _traffic(d, engine: ShmEngine) -> tuple[int, int]:
    """Store 6 blocks, look up 8 (6 hits), load the 6: returns (blocks looked up, blocks loaded)."""
    c = d.client(job_deadline_s=30.0)
    c.register("prom-0", "prom", 0, 1, engine.memory, engine.layout)
    keys = chain_keys(8, b"prom")
    engine.fill(range(6), keys[:6])
    c.submit_store("prom-0", 1, keys[:6], list(range(6)))
    (n,) = c.wait_notices({1}, 30)
    assert n.ok, n
    hits = c.lookup("prom", keys).hits
    assert hits == 6
    c.submit_load("prom-0", 2, keys[:6], list(range(8, 14)))
    (n,) = c.wait_notices({2}, 30)
    assert n.ok and engine.matches(range(8, 14), keys[:6]).all(), n
    return 8, 6


def _value(series: list[dict]) -> float:
    assert len(series) == 1, series
    return float(series[0]["value"][1])


def _rules_evaluated_since(p: Prometheus, since: float) -> list[dict] | None:
    rules = [r for g in p.api("rules")["groups"] for r in g["rules"]]
    ok = all(r["health"] == "ok" and r.get("lastEvaluation", "").startswith("2")
             and _rfc3339(r["lastEvaluation"]) > since for r in rules)
    return rules if ok else None


def _rfc3339(s: str) -> float:
    from datetime import datetime

    return datetime.fromisoformat(re.sub(r"(\.\d{6})\d*", r"\1", s.replace("Z", "+00:00"))).timestamp()


def test_a_real_prometheus_scrapes_the_daemon_and_every_query_returns_series(bins, make_daemon, tmp_path):
    # With a disk tier, so that the dashboard's tier panels have series too (a daemon without one has
    # only the pool's: those panels are empty there by design), and beside it a daemon on a real
    # Valkey/Redis cluster (--remote), which the cluster row's panels show: the dashboard's instance
    # variable selects both, as an operator's does.
    binary = server_binary()
    if binary is None:
        pytest.skip("no valkey-server/redis-server: the dashboard's cluster row needs a --remote daemon")
    (tmp_path / "disk").mkdir()
    d = make_daemon("64MiB", "--disk-path", str(tmp_path / "disk"), "--disk-size", "64MiB", name="prom")
    target = d.metrics_address
    engine = ShmEngine(16, 4096, tag="prom")
    with Servers(binary, shards=3) as cluster:
        cluster.start()
        remote = make_daemon("16MiB", "--remote", cluster.url, name="prom-remote").metrics_address
        _scrape_and_query(bins, d, target, remote, engine, tmp_path)


def _scrape_and_query(bins, d, target: str, remote: str, engine: ShmEngine, tmp_path) -> None:
    with Prometheus(bins.prometheus, _config(target, remote), tmp_path) as p:
        up = f'up{{job="kvoffd",instance="{target}"}}'
        assert wait_until(lambda: [s for s in p.query(up) if s["value"][1] == "1"], 60), p.log()
        both = f'{target}|{remote}'
        # a rate needs two samples: the remote daemon scraped twice at least (a gate, not a sleep)
        twice = f'count_over_time(up{{job="kvoffd",instance="{remote}"}}[5m]) >= 2'
        assert wait_until(lambda: p.query(twice), 60), p.log()
        looked_up, loaded = _traffic(d, engine)
        # a deterministic gate, not a sleep: Prometheus has scraped the counters after the traffic
        seen = (f'sum(kvoffd_lookup_blocks_total{{instance="{target}"}}) == {looked_up} and on() '
                f'sum(kvoffd_loaded_blocks_total{{instance="{target}"}}) == {loaded}')
        assert wait_until(lambda: p.query(seen), 60), p.log()
        seen_at = time.time()

        # the dashboard: the template variable's values, then every panel's query
        assert target in p.api("label/instance/values", **{"match[]": "kvoffd_build_info"})
        queries = _panel_queries()
        assert len(queries) > 20
        for title, expr in queries:
            q = expr.replace("$__rate_interval", "5m").replace("$instance", both)
            assert "$" not in q, f"{title}: a Grafana variable the test does not know: {q}"
            q = comparisons_as_bool(q)  # "errors > 0" shows only errors; the series must exist
            assert p.query(q), f"panel {title!r}: no series for {q}"
        for doc, expr in _doc_queries():
            q = comparisons_as_bool(expr)  # this Prometheus scrapes only the test's two daemons
            assert p.query(q), f"{doc}: no series for {q}"
        hit_rate = next(e for t, e in queries if t == "Hit rate (blocks served)")
        served = hit_rate.replace("$__rate_interval", "5m").replace("$instance", target)
        assert _value(p.query(served)) == pytest.approx(loaded / looked_up)

        # the alert rules: loaded and evaluated by Prometheus itself, on data that includes the traffic
        assert wait_until(lambda: _rules_evaluated_since(p, seen_at), 60), p.api("rules")
        for rule in _rules():
            q = comparisons_as_bool(without_offsets(rule["expr"]))
            assert p.query(q), f"alert {rule['alert']}: no series for {q}"
        firing = [a for a in p.api("alerts")["alerts"] if a["state"] == "firing"]
        assert not firing, f"a healthy daemon fires alerts: {firing}"

        # and a daemon that stops answering makes KvoffdDown pending (it fires after its 2 minutes)
        d.stop()

        def down_pending() -> bool:
            return any(a["labels"]["alertname"] == "KvoffdDown" and a["labels"].get("instance") == target
                       for a in p.api("alerts")["alerts"])

        assert wait_until(down_pending, 60), p.api("alerts")
    engine.close()
