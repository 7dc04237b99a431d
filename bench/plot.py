"""PNG charts for the docs from the benchmarks' JSON files (issue 17). Needs matplotlib (extra ``bench``).

    python bench/plot.py --ttft ttft.json --transfer transfer.json --trace trace.json   # -> docs/img/

Every input is optional; each chart is drawn from its own file only, and a missing figure inside a
file leaves its line or bar out (with a note on stderr) rather than drawing a made-up one:

  docs/img/ttft.png       <- bench/ttft.py --out FILE        time to first token vs prompt length:
                                                             recompute, kvoffd hit, layer-wise kvoffd
                                                             hit, in-process copy, and the bound
                                                             max(load at the link, suffix) + 1 layer
  docs/img/transfer.png   <- bench/transfer.py --json FILE   GB/s of the backend and the daemon next to
                                                             the measured link ceiling
  docs/img/hit_ratio.png  <- bench/trace_replay.py           hit ratio vs pool capacity per policy
  docs/img/cluster_hit_ratio.png <- bench/trace_cluster.py --out FILE   hit ratio of N nodes sharing a
                                                             cluster, one node with a disk, N nodes alone

The trace-replay file has this schema (validated here; a violation is an error naming the field):

  {
    "capacities": [c0, c1, ...],          # pool capacities, ascending, > 0 (the x axis)
    "policies": {"lru": [h0, h1, ...],    # per policy: hit ratio in [0, 1] at each capacity,
                 ...},                    #   as many values as capacities
    "unbounded": h,                       # hit ratio with an unbounded pool (drawn as the ceiling)
    "capacity_unit": "GiB",               # optional: the x axis unit (default "blocks")
    "title": "..."                        # optional: the chart's title
  }
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_OUT = os.path.join(ROOT, "docs", "img")

COLORS = {"recompute": "#c0392b", "hit": "#1f6fb4", "lw_hit": "#e67e22", "inproc": "#27ae60", "contend": "#8e44ad",
          "ceiling": "#555555"}


def _plt() -> Any:
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("bench/plot.py needs matplotlib: pip install 'kvoffd[bench]'") from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _note(msg: str) -> None:
    print(f"plot: {msg}", file=sys.stderr)


def _load(path: str) -> dict[str, Any]:
    with open(path) as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path}: expected a JSON object")
    return data


# --- TTFT ------------------------------------------------------------------------------------------


def plot_ttft(data: dict[str, Any], out: str) -> str:
    """A line per path (median, with the min-max of the repeats as error bars) on log-log axes, and
    the layer-wise bound dashed (a file from before the layer-wise paths draws without them)."""
    plt = _plt()
    if "error" in data:
        raise ValueError(f"the TTFT run failed ({data['error']}); nothing to draw")
    lengths_d = (data.get("engine") or {}).get("lengths") or {}
    if not lengths_d:
        raise ValueError("the TTFT file has no engine.lengths")
    lengths = sorted(lengths_d, key=int)
    xs = [int(n) for n in lengths]
    fig, ax = plt.subplots(figsize=(8, 5))
    series = (("recompute_s", "recompute (prefill of the whole prompt)", "recompute", "o"),
              ("hit_s", "kvoffd hit (LOOKUP + LOAD from the daemon, then the last tokens)", "hit", "s"),
              ("lw_hit_s", "layer-wise kvoffd hit (LOAD in parts, each layer computed as its part lands)",
               "lw_hit", "v"),
              ("inproc_s", "in-process copy (same DMA from the engine's own pinned buffer)", "inproc", "^"))
    for key, label, color, marker in series:
        pts = [(x, lengths_d[n][key]) for x, n in zip(xs, lengths, strict=True) if lengths_d[n].get(key)]
        if not pts:
            _note(f"ttft: no '{key}' figures; line left out")
            continue
        px = [p[0] for p in pts]
        med = [_median(p[1]) * 1e3 for p in pts]
        lo = [m - min(p[1]) * 1e3 for m, p in zip(med, pts, strict=True)]
        hi = [max(p[1]) * 1e3 - m for m, p in zip(med, pts, strict=True)]
        ax.errorbar(px, med, yerr=[lo, hi], label=label, color=COLORS[color], marker=marker, capsize=3, lw=2)
    bound = [(x, lengths_d[n]["bound_s"] * 1e3) for x, n in zip(xs, lengths, strict=True) if lengths_d[n].get("bound_s")]
    if bound:
        ax.plot([b[0] for b in bound], [b[1] for b in bound], color=COLORS["ceiling"], ls="--", lw=1.5,
                label="bound: max(load at the link speed, suffix compute) + first layer")
    else:
        _note("ttft: no 'bound_s' figures; bound left out")
    c = (data.get("summary") or {}).get("contention")
    if c:
        ax.scatter([c["length"]], [c["hit_median_s"] * 1e3], color=COLORS["contend"], marker="D", s=60, zorder=5,
                   label=f"kvoffd hit, {c['engines']} engines loading at once (median engine)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(xs)
    ax.set_xticklabels([f"{x // 1024}k" if x % 1024 == 0 else str(x) for x in xs])
    ax.set_xlabel("prompt length (tokens)")
    ax.set_ylabel("time to first token (ms, log scale)")
    shape = (data.get("config") or {}).get("shape") or {}
    model = "Llama-3-8B shape" if shape.get("layers") == 32 else f"{shape.get('layers', '?')}-layer test model"
    ax.set_title(f"Time to first token, {model}, bf16, {data.get('device', '?')}")
    a = (data.get("summary") or {}).get("acceptance_16k")
    notes = []
    if a:
        notes.append(f"16k tokens: kvoffd hit {a['speedup_vs_recompute']:.1f}x faster than recompute, "
                     f"{a['overhead_vs_inproc'] * 100:+.1f}% vs in-process copy")
    r16 = lengths_d.get("16384") or {}
    if r16.get("lw_hit_s") and r16.get("recompute_s"):
        lw = _median(r16["lw_hit_s"])
        notes.append(f"layer-wise hit {_median(r16['recompute_s']) / lw:.1f}x faster"
                     + (f", {lw / r16['bound_s']:.3f}x the bound" if r16.get("bound_s") else ""))
    if notes:
        ax.text(0.02, 0.97, "\n".join(notes), transform=ax.transAxes, va="top", fontsize=9,
                bbox={"fc": "white", "ec": "#cccccc"})
    ax.grid(True, which="both", alpha=0.3)
    handles, labels = ax.get_legend_handles_labels()
    order = sorted(range(len(labels)), key=lambda i: "engines loading at once" in labels[i])  # the point last
    ax.legend([handles[i] for i in order], [labels[i] for i in order], loc="lower right", fontsize=8)
    return _save(fig, plt, out)


def _median(xs: list[float]) -> float:
    s = sorted(xs)
    n = len(s)
    return s[n // 2] if n % 2 else (s[n // 2 - 1] + s[n // 2]) / 2


# --- transfer --------------------------------------------------------------------------------------


def plot_transfer(data: dict[str, Any], out: str, layout: str = "blocks") -> str:
    """Grouped bars (store / load / both) per way of moving; a dashed ceiling line over each group."""
    plt = _plt()
    groups = [("store", "store (GPU → pool)", "d2h_GBps"), ("load", "load (pool → GPU)", "h2d_GBps"),
              ("both", "store + load at once", "both_GBps")]
    backend, daemon = data.get(layout) or {}, data.get(f"daemon_{layout}") or {}
    series = [("kvoffd backend (no control plane)", backend, {"store": "store", "load": "load", "both": "both"}),
              ("daemon, one job (submit → notice)", daemon, {"store": "store", "load": "load", "both": "both"}),
              ("daemon, steady state", daemon,
               {"store": "stream_store", "load": "stream_load", "both": "stream_both"})]
    series = [s for s in series if any(isinstance(s[1].get(k), (int, float)) for k in s[2].values())]
    if not series:
        raise ValueError(f"the transfer file has no '{layout}' or 'daemon_{layout}' figures")
    ceiling = data.get("ceiling") or {}
    if not ceiling:
        _note("transfer: no 'ceiling' in the file (run bench/transfer.py without --daemon-only); no ceiling line")
    fig, ax = plt.subplots(figsize=(8, 5))
    width = 0.8 / len(series)
    palette = ["#7fb3d5", "#1f6fb4", "#154360"]
    for i, (label, src, keys) in enumerate(series):
        for g, (gk, _, _) in enumerate(groups):
            v = src.get(keys[gk])
            if not isinstance(v, (int, float)):
                continue
            x = g - 0.4 + width * (i + 0.5)
            ax.bar(x, v, width * 0.92, color=palette[i % len(palette)], label=label)
            ax.text(x, v * 0.97, f"{v:.1f}", ha="center", va="top", fontsize=7, color="white")
    labelled = False
    for g, (_, _, ck) in enumerate(groups):
        v = ceiling.get(ck)
        if isinstance(v, (int, float)):
            ax.hlines(v, g - 0.45, g + 0.45, colors=COLORS["ceiling"], linestyles="dashed", lw=1.5,
                      label=None if labelled else "link ceiling (one contiguous pinned copy)")
            ax.text(g + 0.45, v * 1.01, f"{v:.1f}", ha="right", va="bottom", fontsize=7, color=COLORS["ceiling"])
            labelled = True
    handles, labels = ax.get_legend_handles_labels()
    uniq = dict(zip(labels, handles, strict=True))
    ax.legend(uniq.values(), uniq.keys(), fontsize=8, loc="upper left")
    ax.set_xticks(range(len(groups)))
    ax.set_xticklabels([g[1] for g in groups])
    ax.set_ylabel("GB/s")
    top = max([ceiling.get(g[2], 0) or 0 for g in groups]
              + [s[1].get(k, 0) or 0 for s in series for k in s[2].values()])
    ax.set_ylim(0, top * 1.25)
    desc = "block-contiguous (one run per block)" if layout == "blocks" else "per-layer (32 runs per block)"
    ax.set_title(f"GPU ↔ pool, 1024 scattered 2 MiB blocks, {desc}")
    ax.grid(True, axis="y", alpha=0.3)
    return _save(fig, plt, out)


# --- hit ratio -------------------------------------------------------------------------------------


def validate_trace(data: dict[str, Any]) -> None:
    caps = data.get("capacities")
    if not isinstance(caps, list) or not caps or not all(isinstance(c, (int, float)) and c > 0 for c in caps):
        raise ValueError("trace: 'capacities' must be a non-empty list of positive numbers")
    if any(b <= a for a, b in zip(caps, caps[1:], strict=False)):
        raise ValueError("trace: 'capacities' must be ascending")
    pols = data.get("policies")
    if not isinstance(pols, dict) or not pols:
        raise ValueError("trace: 'policies' must be a non-empty object {name: [hit ratio per capacity]}")
    for name, hs in pols.items():
        if not isinstance(hs, list) or len(hs) != len(caps):
            raise ValueError(f"trace: policies[{name!r}] must list {len(caps)} hit ratios (one per capacity)")
        if not all(isinstance(h, (int, float)) and 0 <= h <= 1 for h in hs):
            raise ValueError(f"trace: policies[{name!r}] values must be hit ratios in [0, 1]")
    u = data.get("unbounded")
    if not isinstance(u, (int, float)) or not 0 <= u <= 1:
        raise ValueError("trace: 'unbounded' must be a hit ratio in [0, 1]")


def plot_hit_ratio(data: dict[str, Any], out: str) -> str:
    plt = _plt()
    validate_trace(data)
    caps = data["capacities"]
    fig, ax = plt.subplots(figsize=(8, 5))
    markers = "os^vDP*X"
    for i, (name, hs) in enumerate(data["policies"].items()):
        label = f"daemon ({data['daemon_policy']})" if name == "daemon" and data.get("daemon_policy") else name
        ax.plot(caps, [h * 100 for h in hs], marker=markers[i % len(markers)], lw=2, label=label)
    ax.axhline(data["unbounded"] * 100, color=COLORS["ceiling"], ls="--", lw=1.5,
               label=f"unbounded pool ({data['unbounded'] * 100:.1f}%)")
    if caps[-1] / caps[0] >= 10:
        ax.set_xscale("log")
        ax.minorticks_off()
    ax.set_xticks(caps)
    ax.set_xticklabels([f"{c:g}" for c in caps])
    top = max([data["unbounded"], *(h for hs in data["policies"].values() for h in hs)])
    ax.set_ylim(0, min(100.0, top * 115 + 2))
    ax.set_xlabel(f"pool capacity ({data.get('capacity_unit', 'blocks')})")
    ax.set_ylabel("hit ratio (%)")
    ax.set_title(data.get("title") or "Hit ratio vs pool capacity (trace replay)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8, loc="lower right")
    return _save(fig, plt, out)


_CLUSTER_SETUPS = (("single", "1 node: DRAM {dram:,} + disk {cluster:,}"),
                   ("cluster", "{nodes} nodes: DRAM {dram:,} each + shared cluster {cluster:,}"),
                   ("local", "{nodes} nodes: DRAM {dram:,} each, node-local only"))


def plot_cluster(data: dict[str, Any], out: str) -> str:
    """Block and token hit ratios per set-up of bench/trace_cluster.py, the unbounded ratio as the ceiling."""
    plt = _plt()
    setups = data["setups"]
    names = [(k, f.format(dram=data["dram_blocks"], cluster=data["cluster_blocks"], nodes=data["nodes"]))
             for k, f in _CLUSTER_SETUPS if k in setups]
    if not names:
        raise ValueError("no set-up in the file")
    for k, _ in names:
        for f in ("block_ratio", "token_ratio"):
            if not 0 <= setups[k][f] <= 1:
                raise ValueError(f"setups.{k}.{f} must be in [0, 1]")
    fig, ax = plt.subplots(figsize=(8, 5))
    xs = range(len(names))
    w = 0.38
    blocks = [setups[k]["block_ratio"] * 100 for k, _ in names]
    tokens = [setups[k]["token_ratio"] * 100 for k, _ in names]
    ax.bar([x - w / 2 for x in xs], blocks, w, color=COLORS["hit"], label="block hit ratio")
    ax.bar([x + w / 2 for x in xs], tokens, w, color=COLORS["inproc"], label="token hit ratio")
    for x, b in zip(xs, blocks, strict=True):
        ax.text(x - w / 2, b + 0.4, f"{b:.1f}", ha="center", fontsize=8)
    ax.axhline(data["unbounded"] * 100, color=COLORS["ceiling"], ls="--", lw=1.5,
               label=f"unbounded ({data['unbounded'] * 100:.1f}%)")
    ax.set_xticks(list(xs))
    ax.set_xticklabels([n.replace(": ", ":\n") for _, n in names], fontsize=8)
    ax.set_ylabel("hit ratio (%)")
    ax.set_ylim(0, data["unbounded"] * 115 + 2)
    share = data.get("cluster_of_single")
    ax.set_title(f"{data.get('trace', 'trace')}, random router"
                 + (f": cluster = {share:.0%} of one node with a disk" if share else ""))
    ax.grid(True, axis="y", alpha=0.3)
    ax.legend(fontsize=8, loc="upper right")
    return _save(fig, plt, out)


# --------------------------------------------------------------------------------------------------


def _save(fig: Any, plt: Any, out: str) -> str:
    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    fig.tight_layout()
    fig.savefig(out, dpi=150)
    plt.close(fig)
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ttft", help="JSON of bench/ttft.py --out")
    ap.add_argument("--transfer", help="JSON of bench/transfer.py --json")
    ap.add_argument("--trace", help="JSON of bench/trace_replay.py (schema above)")
    ap.add_argument("--cluster", help="JSON of bench/trace_cluster.py --out")
    ap.add_argument("--layout", default="blocks", choices=["blocks", "layers"], help="transfer chart's layout")
    ap.add_argument("--outdir", default=DEFAULT_OUT, help="where the PNGs go (default docs/img)")
    args = ap.parse_args(argv)
    if not (args.ttft or args.transfer or args.trace or args.cluster):
        ap.error("give at least one of --ttft, --transfer, --trace, --cluster")
    jobs = [(args.ttft, "ttft.png", plot_ttft), (args.transfer, "transfer.png",
                                                lambda d, o: plot_transfer(d, o, args.layout)),
            (args.trace, "hit_ratio.png", plot_hit_ratio), (args.cluster, "cluster_hit_ratio.png", plot_cluster)]
    failed = False
    for path, name, fn in jobs:
        if not path:
            continue
        try:
            print(fn(_load(path), os.path.join(args.outdir, name)))
        except (OSError, ValueError, KeyError, TypeError) as e:
            print(f"plot: {name} from {path}: {e}", file=sys.stderr)
            failed = True
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
