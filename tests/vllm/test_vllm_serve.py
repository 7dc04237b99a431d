"""docs/vllm.md's quick test, run as a user runs it: `vllm serve` over HTTP with the connector.

The steps come from the docs' quick-test block itself (the `vllm serve` command line, its
environment, its `--kv-transfer-config`, the prompt and the request; only the model path, socket and
port are this test's), so the docs cannot drift from what CI proves: build the tiny model with
bench/make_tiny_model.py, start a daemon, start `vllm serve`, wait for /health and for the engine's
registration, send a prompt, reset vLLM's prefix cache, send it again. The answers must be
identical and the daemon's `kvoffd_loaded_blocks_total` must rise by the prompt's full blocks: the
repeat was served by loads from the daemon, not by vLLM's own prefix cache (issue 19: without the
reset, or with a reset that 404s, the daemon counts hits while loading nothing).

One server start (25 to 60 s on 2 cores); the timeouts are generous for a loaded CI machine.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import BLOCK, Daemon

pytestmark = pytest.mark.vllm

ROOT = Path(__file__).resolve().parents[2]
DOC = ROOT / "docs" / "vllm.md"
STARTUP_S = 180.0  # /health of a fresh `vllm serve`: ~25 s idle; much more on a loaded 2-core box


def quick_test_block() -> str:
    """The bash block of docs/vllm.md's "A quick test" section."""
    text = DOC.read_text()
    section = text[text.index("### A quick test"):]
    return re.search(r"```bash\n(.*?)```", section, re.S).group(1)


def doc_serve_command() -> tuple[dict[str, str], list[str]]:
    """The quick test's `vllm serve` line: its environment assignments and its argv."""
    block = quick_test_block().replace("\\\n", " ")
    line = next(ln for ln in _commands(block) if " vllm serve " in f" {ln} ")
    words = shlex.split(line.rstrip().rstrip("&"))
    env = {}
    while "=" in words[0]:
        k, v = words.pop(0).split("=", 1)
        env[k] = v
    return env, words


def _commands(block: str) -> list[str]:
    """Logical lines, with single-quoted strings spanning lines joined, comments dropped."""
    out, cur = [], ""
    for raw in block.splitlines():
        ln = raw if cur else raw.split("  #")[0]
        if not cur and ln.lstrip().startswith("#"):
            continue
        cur = f"{cur}\n{ln}" if cur else ln
        if cur.count("'") % 2 == 0:
            out.append(cur)
            cur = ""
    return out


def doc_prompt() -> list[int]:
    m = re.search(r"PROMPT=\$\(python -c '(print\(.*?\))'\)", quick_test_block())
    code = m.group(1).removeprefix("print(").removesuffix(")")
    return list(eval(code, {"__builtins__": {"range": range}}))  # noqa: S307 - our own docs


def doc_request(model: str, prompt: list[int]) -> dict[str, Any]:
    """The quick test's completion request (``REQ='...'``), with its prompt and model filled in."""
    m = re.search(r"""^REQ='(.*)'$""", quick_test_block(), re.M)
    body = json.loads(m.group(1).replace("""'"$PROMPT"'""", json.dumps(prompt)))
    assert body["model"] == "/tmp/tiny-llama"
    return {**body, "model": model}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _http(url: str, body: dict[str, Any] | None = None, timeout: float = 60) -> Any:
    """GET, or POST ``body`` as JSON."""
    data = None if body is None else json.dumps(body).encode()
    method = "GET" if body is None else "POST"
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        raw = r.read()
    return json.loads(raw) if raw else None


def _wait(cond, timeout: float, what: str, proc: subprocess.Popen, log: Path) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if proc.poll() is not None:
            raise AssertionError(f"vllm serve exited ({proc.returncode}) while waiting for {what}:\n"
                                 f"{log.read_text()[-4000:]}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{what} not within {timeout:.0f} s:\n{log.read_text()[-4000:]}")
        time.sleep(0.2)


def _healthy(base: str) -> bool:
    try:
        urllib.request.urlopen(f"{base}/health", timeout=5).read()
        return True
    except (OSError, urllib.error.URLError):
        return False


def _vllm_metric(base: str, name: str) -> float:
    text = urllib.request.urlopen(f"{base}/metrics", timeout=10).read().decode()
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", text, re.M))


def _stop(proc: subprocess.Popen) -> None:
    """SIGINT as Ctrl-C does; then the whole process group (EngineCore) if it does not exit."""
    if proc.poll() is not None:
        return
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(60)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(30)


def test_docs_quick_test_loads_blocks_through_vllm_serve(tmp_path: Path) -> None:
    vllm_bin = Path(sys.executable).parent / "vllm"
    if not vllm_bin.exists():
        pytest.skip("no `vllm` command beside this Python (make install-vllm)")
    model = tmp_path / "tiny-llama"
    subprocess.run([sys.executable, str(ROOT / "bench" / "make_tiny_model.py"), str(model)], check=True,
                   timeout=300, capture_output=True)

    env_doc, argv = doc_serve_command()
    assert env_doc == {"VLLM_SERVER_DEV_MODE": "1"}
    assert argv[:3] == ["vllm", "serve", "/tmp/tiny-llama"]
    d = Daemon(tmp_path).start()
    port = _free_port()
    argv = [str(vllm_bin), "serve", str(model)] + [
        {"8000": str(port)}.get(a, a.replace("ipc:///tmp/kvoffd-quick/kvoffd.sock", d.address)) for a in argv[3:]]
    assert any(d.address in a for a in argv), "the docs' config names no kvoffd_address"
    import kvoffd_client

    env = {**os.environ, **env_doc}
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING", None)  # as users run it: EngineCore in its own process
    # kvoffd_client must import in vLLM's processes (installed, or from this checkout)
    env["PYTHONPATH"] = os.pathsep.join(
        [str(Path(kvoffd_client.__file__).resolve().parent.parent), env.get("PYTHONPATH", "")]).rstrip(os.pathsep)
    log = tmp_path / "vllm-serve.log"
    base = f"http://127.0.0.1:{port}"
    with open(log, "w") as log_f:
        proc = subprocess.Popen(argv, env=env, stdout=log_f, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        _wait(lambda: _healthy(base), STARTUP_S, "/health", proc, log)
        _wait(lambda: bool(d.stats()["engines"]), 60, "the engine's registration with kvoffd", proc, log)

        prompt = doc_prompt()
        req = doc_request(str(model), prompt)
        assert req["return_token_ids"] and req["temperature"] == 0
        first = _http(f"{base}/v1/completions", req)["choices"][0]["token_ids"]
        assert len(first) == 8

        # {"success": false} while the first request's stores are still being acknowledged
        _wait(lambda: _http(f"{base}/reset_prefix_cache", {})["success"], 60, "a successful /reset_prefix_cache",
              proc, log)

        loaded0 = d.metric("kvoffd_loaded_blocks_total")
        second = _http(f"{base}/v1/completions", req)["choices"][0]["token_ids"]
        loaded = d.metric("kvoffd_loaded_blocks_total") - loaded0
        assert second == first
        full_blocks = (len(prompt) - 1) // BLOCK  # never the block holding the prompt's last token
        assert loaded == full_blocks == 6, f"{loaded} blocks loaded by the repeat"
        # vLLM's own view, as the docs list it (its counters arrive with the engine's stats: poll)
        _wait(lambda: _vllm_metric(base, "vllm:kvoffd_load_blocks_total") == full_blocks
              and _vllm_metric(base, "vllm:external_prefix_cache_hits_total") == full_blocks * BLOCK,
              60, "vLLM's load counters", proc, log)
    finally:
        _stop(proc)
        d.stop()
