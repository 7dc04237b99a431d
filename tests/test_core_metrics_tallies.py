"""The counters STATS reports are the daemon's own tallies (kvoffd/metrics.py ``Tally``): what STATS
says is what a scrape exports, read without prometheus_client's private state."""

from __future__ import annotations

import ast
from pathlib import Path

from prometheus_client import generate_latest

from kvoffd.metrics import Metrics

KVOFFD = Path(__file__).resolve().parent.parent / "kvoffd"


def test_no_module_reads_prometheus_clients_private_value():
    found = [f"{p.relative_to(KVOFFD.parent)}:{n.lineno}" for p in sorted(KVOFFD.rglob("*.py"))
             for n in ast.walk(ast.parse(p.read_text())) if isinstance(n, ast.Attribute) and n.attr == "_value"]
    assert found == [], f"a counter STATS reads is a Tally (kvoffd/metrics.py): {found}"


def test_a_tally_counts_what_the_scrape_exports():
    m = Metrics("test")
    m.stored_blocks.inc(3)
    m.transfer_bytes.labels("load").inc(4096)
    m.dropped_stores.labels("pool_full").inc(2)
    m.errors.labels("busy").inc()
    text = generate_latest(m.registry).decode().splitlines()
    assert m.stored_blocks.value == 3 and "kvoffd_stored_blocks_total 3.0" in text
    assert m.transfer_bytes.labels("load").value == 4096
    assert 'kvoffd_transfer_bytes_total{direction="load"} 4096.0' in text
    assert 'kvoffd_transfer_bytes_total{direction="store"} 0.0' in text  # every series from the start
    assert 'kvoffd_dropped_stores_total{reason="pool_full"} 2.0' in text
    assert 'kvoffd_errors_total{code="busy"} 1.0' in text
    assert "# TYPE kvoffd_kv_events_dropped_total counter" in text
