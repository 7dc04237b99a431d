"""KvoffdConnector when things go wrong: no daemon, a daemon SIGKILLed mid-load, preemption under load."""

from __future__ import annotations

import os
import signal
import threading
import time
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import (
    PROMPTS,
    Daemon,
    check_served,
    close_llm,
    drain,
    external_hits,
    generate,
    generate_cached,
    greedy,
    make_llm,
)

pytestmark = pytest.mark.vllm


def _worker() -> Any:
    from vllm.distributed.kv_transfer import get_kv_transfer_group

    return get_kv_transfer_group()._worker


def _wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise TimeoutError(what)
        time.sleep(0.05)


def _registered(d: Daemon) -> bool:
    try:
        return bool(d.stats()["engines"])
    except Exception:
        return False


def _offload_works(llm: Any, d: Daemon, reference: list[list[int]]) -> None:
    """Store PROMPTS, drop vLLM's own cache, and get every offered block back from the daemon."""
    assert generate(llm, PROMPTS) == reference
    drain(llm)
    assert llm.reset_prefix_cache()
    h0 = external_hits(llm)
    outputs, cached = generate_cached(llm, PROMPTS)
    assert outputs == reference
    check_served(PROMPTS, external_hits(llm) - h0, cached)
    drain(llm)


def test_no_daemon_at_start_serves_then_connects(tiny_model: str, reference: list[list[int]],
                                                 tmp_path: Path) -> None:
    d = Daemon(tmp_path)  # not started
    llm = make_llm(tiny_model, d.address, extra={"kvoffd_connect_timeout_s": 0.5})  # the default
    try:
        assert generate(llm, PROMPTS) == reference
        drain(llm)
        d.start()
        _wait(lambda: _registered(d), 15, "the worker did not register once the daemon appeared")
        _offload_works(llm, d, reference)
    finally:
        close_llm(llm)
        d.stop()


def test_daemon_sigkilled_while_loading(tiny_model: str, reference: list[list[int]], tmp_path: Path) -> None:
    """Loads in flight when the daemon dies fail within a bounded time, vLLM recomputes with identical
    output, and a restarted daemon is used again without restarting vLLM."""
    from vllm.inputs import TokensPrompt

    d = Daemon(tmp_path).start()
    llm = make_llm(tiny_model, d.address)
    try:
        assert generate(llm, PROMPTS) == reference
        drain(llm)
        assert llm.reset_prefix_cache()
        worker = _worker()
        real_start = worker.start_load_kv

        def freeze_daemon_then_load(meta: Any, **kw: Any) -> None:
            # The daemon stops before it sees the LOADs, so they are certainly in flight at the kill.
            if meta.loads and d.proc is not None:
                os.kill(d.proc.pid, signal.SIGSTOP)
            real_start(meta, **kw)

        worker.start_load_kv = freeze_daemon_then_load
        engine = llm.llm_engine
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), greedy())
        outputs: dict[str, list[int]] = {}
        killed_at = None
        t0 = time.monotonic()
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
            if killed_at is None and worker._loads:
                d.kill()
                killed_at = time.monotonic()
            assert time.monotonic() - t0 < 60, "requests hang after the daemon died"
        assert killed_at is not None, "no load was in flight"
        assert time.monotonic() - killed_at < 10
        assert [outputs[str(i)] for i in range(len(PROMPTS))] == reference
        assert worker.stats.lifetime.get("load_failed_jobs", 0) >= 1
        worker.start_load_kv = real_start
        drain(llm)

        d.start()
        _wait(lambda: _registered(d), 15, "the worker did not re-register with the restarted daemon")
        _offload_works(llm, d, reference)
    finally:
        close_llm(llm)
        d.stop()


def test_preemption_fences_in_flight_stores(tiny_model: str, tmp_path: Path) -> None:
    """A KV cache of 9 usable blocks for 4 requests needing 17 (48 tokens each): vLLM preempts and
    reuses the victims' blocks at once. The daemon is held (SIGSTOP) from the first store until the
    worker is told of a preemption, so the preempted request's stores are certainly still in flight
    when the fence runs (a 50 ms pause per store used to race the next step on a loaded machine:
    ``fence_waits`` 0). The daemon is released only then, and the fence waits for its answers. The
    stored blocks are then loaded back and the outputs match: nothing was overwritten under a store."""
    plain = make_llm(tiny_model)
    try:
        reference = generate(plain, PROMPTS, max_tokens=48)
    finally:
        close_llm(plain)
    d = Daemon(tmp_path).start()
    llm = make_llm(tiny_model, d.address, kv_bytes=10 * 2 * 16384, max_model_len=256,
                   extra={"kvoffd_prefetch_lookups": False})
    held = threading.Event()  # the daemon is stopped
    released = threading.Event()  # ... and was let go at the first preemption (or at the end)
    try:
        worker = _worker()
        real_save, real_fence = worker.wait_for_save, worker.handle_preemptions
        preemptions: list[list[str]] = []
        in_flight_at_preemption: list[int] = []

        def hold_daemon_after_store(meta: Any) -> None:
            real_save(meta)
            if meta.store_job_id and not held.is_set() and d.proc is not None:
                os.kill(d.proc.pid, signal.SIGSTOP)  # every store from now on stays in flight
                held.set()

        def fence(meta: Any) -> None:
            if meta.preempted:
                preemptions.append(list(meta.preempted))
                if held.is_set() and not released.is_set():
                    # The worker has not consumed a notice since the hold, so the preempted
                    # request's stores are still in flight: the fence below must wait for them.
                    in_flight_at_preemption.append(len(worker._stores))
                    released.set()
                    os.kill(d.proc.pid, signal.SIGCONT)
            real_fence(meta)

        worker.wait_for_save, worker.handle_preemptions = hold_daemon_after_store, fence
        try:
            out = generate(llm, PROMPTS, max_tokens=48)
        finally:
            worker.wait_for_save, worker.handle_preemptions = real_save, real_fence
            if held.is_set() and not released.is_set():
                released.set()
                os.kill(d.proc.pid, signal.SIGCONT)
        drain(llm)
        assert preemptions, "the workload did not preempt"
        assert in_flight_at_preemption and in_flight_at_preemption[0] > 0, "the daemon was not held"
        assert worker.stats.lifetime.get("fence_waits", 0) >= 1
        assert worker.stats.lifetime.get("fence_timeouts", 0) == 0
        assert out == reference
        assert llm.reset_prefix_cache()
        h0 = external_hits(llm)
        assert generate(llm, PROMPTS, max_tokens=48) == reference
        assert external_hits(llm) > h0
        drain(llm)
    finally:
        close_llm(llm)
        d.stop()


def test_frozen_daemon_holds_only_the_loading_requests(tiny_model: str, reference: list[list[int]],
                                                       tmp_path: Path) -> None:
    """The daemon freezes (SIGSTOP: cgroup freezer, ``docker pause``) with loads in flight, well past
    ``kvoffd_job_timeout_s``: the loads are not failed while it may still write into their blocks (a
    timer used to fail them, vLLM reused the blocks, the thawed daemon overwrote them), a new request
    is served meanwhile, and after the thaw the loads end (``expired``: not started after their
    deadline) and vLLM recomputes with identical output."""
    from vllm.inputs import TokensPrompt

    d = Daemon(tmp_path).start()
    llm = make_llm(tiny_model, d.address, extra={"kvoffd_job_timeout_s": 1, "kvoffd_lookup_timeout_ms": 500})
    try:
        assert generate(llm, PROMPTS) == reference
        drain(llm)
        assert llm.reset_prefix_cache()
        worker = _worker()
        real_start = worker.start_load_kv
        frozen_at: list[float] = []

        def freeze_daemon_then_load(meta: Any, **kw: Any) -> None:
            if meta.loads and not frozen_at and d.proc is not None:
                os.kill(d.proc.pid, signal.SIGSTOP)  # before it sees the LOADs: they wait past their deadline
                frozen_at.append(time.monotonic())
            real_start(meta, **kw)

        worker.start_load_kv = freeze_daemon_then_load
        engine = llm.llm_engine
        for i, p in enumerate(PROMPTS):
            engine.add_request(str(i), TokensPrompt(prompt_token_ids=p), greedy())
        outputs: dict[str, list[int]] = {}
        fresh = [1 + (7 * i) % 97 for i in range(40)]  # shares no block with PROMPTS
        added_fresh = False
        t0 = time.monotonic()
        # frozen past the deadline + the old 2 s grace, and until the new request is served (bounded)
        while not frozen_at or time.monotonic() - frozen_at[0] < 4.0 or "fresh" not in outputs:
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
            if frozen_at and not added_fresh:
                engine.add_request("fresh", TokensPrompt(prompt_token_ids=fresh), greedy())
                added_fresh = True
            assert time.monotonic() - t0 < 90, ("no load was submitted" if not frozen_at else
                                                "a request with no job in flight did not proceed while the "
                                                "daemon was frozen")
            time.sleep(0.01)
        print(f"frozen {time.monotonic() - frozen_at[0]:.1f} s; the new request was served meanwhile")
        in_flight = len(worker._loads)
        assert in_flight >= 1, "loads were given up while the daemon that took them was frozen"
        assert worker.stats.lifetime.get("load_failed_jobs", 0) == 0
        os.kill(d.proc.pid, signal.SIGCONT)
        while engine.has_unfinished_requests():
            for out in engine.step():
                if out.finished:
                    outputs[out.request_id] = list(out.outputs[0].token_ids)
            assert time.monotonic() - t0 < 90, "requests hang after the daemon thawed"
        worker.start_load_kv = real_start
        assert [outputs[str(i)] for i in range(len(PROMPTS))] == reference
        drain(llm)
        _offload_works(llm, d, reference)
    finally:
        close_llm(llm)
        d.stop()
