"""bench/plot.py: the trace-replay schema is enforced, and each chart renders from its JSON."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
spec = importlib.util.spec_from_file_location("bench_plot", ROOT / "bench" / "plot.py")
plot = importlib.util.module_from_spec(spec)
sys.modules["bench_plot"] = plot
spec.loader.exec_module(plot)

TRACE = {"capacities": [1, 4, 16], "policies": {"lru": [0.1, 0.3, 0.5]}, "unbounded": 0.55}


@pytest.mark.parametrize("bad, field", [
    ({"capacities": []}, "capacities"),
    ({"capacities": [4, 1, 16]}, "ascending"),
    ({"policies": {"lru": [0.1, 0.3]}}, "lru"),
    ({"policies": {"lru": [0.1, 0.3, 1.5]}}, "lru"),
    ({"unbounded": 2}, "unbounded"),
])
def test_trace_schema_violations_name_the_field(bad: dict, field: str) -> None:
    with pytest.raises(ValueError, match=field):
        plot.validate_trace({**TRACE, **bad})


def test_charts_render(tmp_path: Path) -> None:
    ttft = {"device": "test", "config": {"shape": {"layers": 32}},
            "engine": {"lengths": {str(n): {"recompute_s": [n * 3e-5, n * 3.1e-5], "hit_s": [0.002 + n * 2.5e-6],
                                            "inproc_s": [0.002 + n * 2.4e-6]} for n in (1024, 4096, 16384)}},
            "summary": {"contention": {"engines": 4, "length": 16384, "hit_median_s": 0.15},
                        "acceptance_16k": {"speedup_vs_recompute": 12.0, "overhead_vs_inproc": 0.04}}}
    transfer = {"blocks": {"store": 54.1, "load": 54.2, "both": 96.9},
                "daemon_blocks": {"store": 52.3, "load": 52.0, "both": 92.0, "stream_store": 54.4,
                                  "stream_load": 54.4, "stream_both": 96.7},
                "ceiling": {"d2h_GBps": 55.0, "h2d_GBps": 55.1, "both_GBps": 100.9}}
    files = {}
    for name, data in (("ttft", ttft), ("transfer", transfer), ("trace", TRACE)):
        files[name] = tmp_path / f"{name}.json"
        files[name].write_text(json.dumps(data))
    out = tmp_path / "img"
    assert plot.main(["--ttft", str(files["ttft"]), "--transfer", str(files["transfer"]), "--trace",
                      str(files["trace"]), "--outdir", str(out)]) == 0
    for png in ("ttft.png", "transfer.png", "hit_ratio.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_failed_ttft_run_draws_nothing(tmp_path: Path) -> None:
    f = tmp_path / "ttft.json"
    f.write_text(json.dumps({"error": "BenchError: LOOKUP found 0 of 1023 blocks"}))
    assert plot.main(["--ttft", str(f), "--outdir", str(tmp_path / "img")]) == 1
    assert not (tmp_path / "img" / "ttft.png").exists()
