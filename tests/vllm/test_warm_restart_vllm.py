"""Issue 14 at the vLLM level: a real engine keeps serving while its daemon restarts (SIGTERM, then
SIGKILL); the next round is served from the blocks the new daemon adopted from the pool file (loads
counted, outputs identical to an engine without kvoffd), without restarting vLLM."""

from __future__ import annotations

import os
import shutil
import signal
import time
import uuid
from pathlib import Path

import pytest
from engine_helpers import Daemon, close_llm, drain, external_hits, generate, make_llm

pytestmark = pytest.mark.vllm

N = 8
LOADABLE = 64  # 72-token prompts: two full 32-token blocks (a hit never covers the last token)


def _prompts(salt: int) -> list[list[int]]:
    return [[3 + (11 * i + 7 * salt + j * 13) % 500 for j in range(72)] for i in range(N)]


def _wait(pred, what: str, timeout: float = 15.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, what
        time.sleep(0.02)


def test_engine_serves_through_warm_restarts(tiny_model: str, tmp_path: Path) -> None:
    prompts, during = _prompts(0), _prompts(1)
    plain = make_llm(tiny_model)
    try:
        reference, reference_during = generate(plain, prompts), generate(plain, during)
    finally:
        close_llm(plain)
    shm = f"/dev/shm/kvtest-warm-vllm-{uuid.uuid4().hex[:10]}"
    os.makedirs(shm, mode=0o700)
    d = Daemon(tmp_path, pool_path=f"{shm}/kvoffd.pool").start()
    llm = make_llm(tiny_model, d.address)
    try:
        assert generate(llm, prompts) == reference  # stores the prompts' blocks
        drain(llm)
        stored = d.stats()["counters"]["stored_blocks"]
        assert stored >= N * LOADABLE // 32
        for sig in (signal.SIGTERM, signal.SIGKILL):
            _wait(lambda n=stored: d.stats()["persistence"]["sealed_blocks"]
                  + d.stats()["persistence"]["adopted_blocks"] >= n, "blocks not sealed")
            if sig == signal.SIGTERM:
                d.stop()
            else:
                d.kill()
            # the daemon is down: the engine keeps serving (recomputing), outputs unchanged
            assert generate(llm, during) == reference_during
            drain(llm)
            assert llm.reset_prefix_cache()  # the next round can only hit in kvoffd
            d.start()
            _wait(lambda: d.stats()["engines"], "the worker did not re-register")
            st = d.stats()
            assert st["persistence"]["adopted_blocks"] >= stored, st["persistence"]
            h0 = external_hits(llm)
            assert generate(llm, prompts) == reference, f"outputs differ after the {sig.name} restart"
            drain(llm)
            assert external_hits(llm) - h0 == N * LOADABLE, f"not served from adopted blocks after {sig.name}"
            assert d.stats()["counters"]["loaded_blocks"] >= N * LOADABLE // 32
            assert llm.reset_prefix_cache()
            stored = d.stats()["persistence"]["adopted_blocks"]
    finally:
        close_llm(llm)
        d.stop()
        shutil.rmtree(shm, ignore_errors=True)
