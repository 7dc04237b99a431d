"""What KvoffdConnector adds to each vLLM engine step, measured on a real CPU vLLM engine.

One process runs the same workload on three engines, interleaved over several repetitions: without a
connector, with a connector that does nothing (vLLM's own cost of having one), and with
KvoffdConnector talking to a real kvoffd daemon. Two numbers per step:

* the step's wall time (EngineCore.step): the end-to-end cost. Each run's median step is taken, and
  across repetitions both the median and the minimum (the least disturbed run) are reported;
* the time spent inside KvoffdConnector's hooks (scheduler and worker halves, timed around each
  call): the part that is ours, separated from run-to-run noise.

Prompts are unique (no reuse), so every step stores its newly full blocks and nothing is loaded: the
connector does all its per-step work and saves no compute. The model is a tiny random Llama, so the
forward is short and the overhead shows at its largest relative size.

    python bench/engine_overhead.py [--prompts 32] [--prompt-len 480] [--max-tokens 64] [--reps 3] [--json out.json]

Needs vllm (make install-vllm). Prints a table and, with --json, writes the figures.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")

CONFIGS = ("without", "noop", "with")


def _noop_connector_cls() -> type:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1, KVConnectorMetadata

    class NoopConnector(KVConnectorBase_V1):
        """Implements the abstract hooks as no-ops: what any connector costs inside vLLM."""

        def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None: ...
        def wait_for_layer_load(self, layer_name: str) -> None: ...
        def save_kv_layer(self, layer_name: str, kv_layer: Any, attn_metadata: Any, **kwargs: Any) -> None: ...
        def wait_for_save(self) -> None: ...
        def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int, bool]:
            return 0, False
        def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None: ...
        def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
            return KVConnectorMetadata()

    return NoopConnector


def __getattr__(name: str) -> Any:  # lets vLLM's factory import NoopConnector from this module lazily
    if name == "NoopConnector":
        return _noop_connector_cls()
    raise AttributeError(name)


SCHED_HOOKS = ("on_new_request", "get_num_new_matched_tokens", "update_state_after_alloc", "build_connector_meta",
               "update_connector_output", "request_finished", "get_kv_connector_stats")
WORKER_HOOKS = ("handle_preemptions", "start_load_kv", "wait_for_save", "get_transfer_results",
                "build_connector_worker_meta", "get_kv_connector_stats")


class Timer:
    """Accumulates time per hook, and per engine step the step's wall time and its hooks' share."""

    def __init__(self) -> None:
        self.total: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)
        self.step_s: list[float] = []
        self.step_hooks_s: list[float] = []
        self._in_step = 0.0

    def clear(self) -> None:
        self.total.clear()
        self.calls.clear()
        self.step_s.clear()
        self.step_hooks_s.clear()

    def wrap(self, obj: Any, name: str, label: str) -> None:
        fn: Callable = getattr(obj, name)

        def timed(*a: Any, **k: Any) -> Any:
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                dt = time.perf_counter() - t0
                self.total[label] += dt
                self.calls[label] += 1
                self._in_step += dt

        setattr(obj, name, timed)

    def wrap_step(self, obj: Any, name: str) -> None:
        fn: Callable = getattr(obj, name)

        def step(*a: Any, **k: Any) -> Any:
            self._in_step = 0.0
            t0 = time.perf_counter()
            try:
                return fn(*a, **k)
            finally:
                self.step_s.append(time.perf_counter() - t0)
                self.step_hooks_s.append(self._in_step)

        setattr(obj, name, step)


def run_once(model: str, cfg: str, address: str, prompts: list[list[int]], max_tokens: int) -> dict[str, Any]:
    from support.vllm_engines import close_llm, core_of, drain, generate, make_llm

    if cfg == "noop":
        from vllm.config import KVTransferConfig

        ktc = KVTransferConfig(kv_connector="NoopConnector", kv_connector_module_path="engine_overhead",
                               kv_role="kv_both")
        llm = make_llm(model, None, kv_bytes=256 << 20, max_model_len=2048, kv_transfer_config=ktc)
    else:
        llm = make_llm(model, address if cfg == "with" else None, kv_bytes=256 << 20, max_model_len=2048)
    address = address if cfg == "with" else None
    try:
        core = core_of(llm)
        timer = Timer()
        timer.wrap_step(core, "step_fn")
        if address is not None:
            from vllm.distributed.kv_transfer import get_kv_transfer_group

            sched_conn = core.scheduler.get_kv_connector()
            for h in SCHED_HOOKS:
                timer.wrap(sched_conn, h, f"sched.{h}")
            worker_conn = get_kv_transfer_group()
            for h in WORKER_HOOKS:
                timer.wrap(worker_conn, h, f"worker.{h}")
        generate(llm, prompts[:2], max_tokens=4)  # warm-up (first-call costs)
        drain(llm)
        timer.clear()
        t0 = time.perf_counter()
        generate(llm, prompts, max_tokens=max_tokens)
        drain(llm)
        wall = time.perf_counter() - t0
        steps = len(timer.step_s)
        sched = sum(v for k, v in timer.total.items() if k.startswith("sched."))
        worker = sum(v for k, v in timer.total.items() if k.startswith("worker."))
        out: dict[str, Any] = {
            "wall_s": wall,
            "steps": steps,
            "step_ms": 1e3 * statistics.median(timer.step_s),  # median: robust to a noisy shared box
            "step_ms_mean": 1e3 * statistics.fmean(timer.step_s),
            "hooks_us_per_step_median": 1e6 * statistics.median(timer.step_hooks_s),
            "sched_hooks_us_per_step": 1e6 * sched / max(steps, 1),
            "worker_hooks_us_per_step": 1e6 * worker / max(steps, 1),
            "hooks_us": {k: round(1e6 * v / max(steps, 1), 2) for k, v in sorted(timer.total.items())},
        }
        if address is not None:
            w = get_kv_transfer_group()._worker
            out["store_blocks"] = w.stats.lifetime.get("store_blocks", 0)
            out["store_jobs"] = w.stats.lifetime.get("store_jobs", 0)
        return out
    finally:
        close_llm(llm)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", help="model dir (default: build the tiny random Llama)")
    ap.add_argument("--prompts", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=480)
    ap.add_argument("--max-tokens", type=int, default=64)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)

    from support.daemon import BenchDaemon
    from support.vllm_engines import build_tiny_llama

    work = Path(tempfile.mkdtemp(prefix="kvoffd-bench-"))
    model = args.model or str(build_tiny_llama(work / "tiny-llama"))
    daemon = BenchDaemon(f"ipc://{work}/kvoffd.sock", ["--pool-size", "1GiB", "--metrics-address", "127.0.0.1:0",
                                                      "--log-level", "info", "--pool-path", "none"]).start()
    rows: dict[str, list[dict[str, Any]]] = {c: [] for c in CONFIGS}
    try:
        for rep in range(args.reps):
            # Unique prompts per repetition and per config: nothing is ever a hit.
            order = CONFIGS if rep % 2 == 0 else tuple(reversed(CONFIGS))
            for ci, cfg in enumerate(order):
                seed = 1000 * rep + 300 * ci
                prompts = [[(seed + 31 * i + 7 * j + (j * j) % 13) % 500 + 3 for j in range(args.prompt_len)]
                           for i in range(args.prompts)]
                rows[cfg].append(run_once(model, cfg, daemon.address, prompts, args.max_tokens))
                print(f"rep {rep} {cfg:8s} median step {rows[cfg][-1]['step_ms']:.3f} ms over {rows[cfg][-1]['steps']} steps",
                      file=sys.stderr)
    finally:
        daemon.stop()

    def med(cfg: str, key: str) -> float:
        return statistics.median(r[key] for r in rows[cfg])

    def least(cfg: str, key: str) -> float:
        return min(r[key] for r in rows[cfg])

    result = {
        "workload": {"prompts": args.prompts, "prompt_len": args.prompt_len, "max_tokens": args.max_tokens,
                     "reps": args.reps, "block_size": 32, "model": "tiny random Llama (2 layers)" if not args.model
                     else args.model},
        "step_ms_without": med("without", "step_ms"),
        "step_ms_noop": med("noop", "step_ms"),
        "step_ms_with": med("with", "step_ms"),
        "min_step_ms_without": least("without", "step_ms"),
        "min_step_ms_noop": least("noop", "step_ms"),
        "min_step_ms_with": least("with", "step_ms"),
        "steps_without": med("without", "steps"),
        "steps_with": med("with", "steps"),
        "wall_s_without": med("without", "wall_s"),
        "wall_s_with": med("with", "wall_s"),
        "step_ms_mean_without": med("without", "step_ms_mean"),
        "step_ms_mean_with": med("with", "step_ms_mean"),
        "hooks_us_per_step_median": med("with", "hooks_us_per_step_median"),
        "sched_hooks_us_per_step": med("with", "sched_hooks_us_per_step"),
        "worker_hooks_us_per_step": med("with", "worker_hooks_us_per_step"),
        "hooks_us_per_step": rows["with"][len(rows["with"]) // 2]["hooks_us"],
        "store_blocks_per_run": rows["with"][0].get("store_blocks"),
        "runs": rows,
    }
    result["step_ms_delta"] = result["step_ms_with"] - result["step_ms_without"]
    result["min_step_ms_delta"] = result["min_step_ms_with"] - result["min_step_ms_without"]
    print(f"engine step, median of {args.reps} runs' median steps: without {result['step_ms_without']:.3f} ms, "
          f"no-op connector {result['step_ms_noop']:.3f} ms, KvoffdConnector {result['step_ms_with']:.3f} ms")
    print(f"least disturbed run: without {result['min_step_ms_without']:.3f} ms, no-op connector "
          f"{result['min_step_ms_noop']:.3f} ms, KvoffdConnector {result['min_step_ms_with']:.3f} ms")
    print(f"connector hooks per step: median {result['hooks_us_per_step_median']:.1f} us; mean scheduler "
          f"{result['sched_hooks_us_per_step']:.1f} us + worker {result['worker_hooks_us_per_step']:.1f} us")
    for k, v in result["hooks_us_per_step"].items():
        print(f"  {k:40s} {v:8.2f} us/step")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
