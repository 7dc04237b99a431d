"""An idle engine waits for a lookup's reply; a busy one never does (issue 32 point 4).

Answering a lookup "not yet" costs the request one engine step. While other requests run that step
happens anyway; on an idle engine it is an empty step (the workers run the connector's hooks, then
vLLM's engine loop sleeps 1 ms), longer than the daemon takes to answer. So the scheduler half waits
for the reply (``kvoffd_lookup_wait_ms`` per step) only when the step would otherwise run nothing.

The waits are read from the connector's counters and vLLM's own schedule; the daemon is frozen
(SIGSTOP) where a reply must not come, so no assertion depends on how fast anything runs. The
bounds are far longer than any daemon takes: where a wait is expected it ends with the reply.
"""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from engine_helpers import (
    PROMPTS,
    Daemon,
    close_llm,
    connector_of,
    core_of,
    drain,
    generate,
    greedy,
    make_llm,
)

pytestmark = pytest.mark.vllm

LONG_MS = 120_000  # a wait bound no daemon answer comes near


class Answers:
    """What the scheduler-side connector answered vLLM's ``get_num_new_matched_tokens``, per prompt,
    and the schedule() call (counted from 0) that first scheduled each prompt's tokens."""

    def __init__(self, llm: Any):
        self.sched = core_of(llm).scheduler
        self.conn = connector_of(llm)
        self.answers: dict[tuple[int, ...], list[Any]] = {}
        self.first_run: dict[str, int] = {}
        self.calls = 0
        self._real_gnmt, self._real_schedule = self.conn.get_num_new_matched_tokens, self.sched.schedule

        def gnmt(request: Any, num_computed_tokens: int) -> Any:
            out = self._real_gnmt(request, num_computed_tokens)
            self.answers.setdefault(tuple(request.prompt_token_ids), []).append(out[0])
            return out

        def schedule(*a: Any, **kw: Any) -> Any:
            out = self._real_schedule(*a, **kw)
            for req_id in out.num_scheduled_tokens:
                self.first_run.setdefault(req_id, self.calls)
            self.calls += 1
            return out

        self.conn.get_num_new_matched_tokens, self.sched.schedule = gnmt, schedule

    def of(self, prompt: list[int]) -> list[Any]:
        return self.answers.get(tuple(prompt), [])

    def undo(self) -> None:
        self.conn.get_num_new_matched_tokens, self.sched.schedule = self._real_gnmt, self._real_schedule


@pytest.fixture
def answers() -> Iterator[Any]:
    made: list[Answers] = []

    def start(llm: Any) -> Answers:
        made.append(Answers(llm))
        return made[-1]

    yield start
    for a in made:
        a.undo()


def _stat(llm: Any, key: str) -> int:
    return connector_of(llm)._scheduler.state.stats.lifetime.get(key, 0)


def _step_until_tokens(llm: Any, req_id: str, n: int) -> None:
    engine = llm.llm_engine
    for _ in range(10_000):
        for o in engine.step():
            if o.request_id == req_id and o.outputs and len(o.outputs[0].token_ids) >= n:
                return
    raise AssertionError(f"{req_id} produced no {n} tokens")


def _run_all(llm: Any) -> dict[str, list[int]]:
    engine = llm.llm_engine
    out: dict[str, list[int]] = {}
    for _ in range(100_000):
        if not engine.has_unfinished_requests():
            return out
        for o in engine.step():
            if o.finished:
                out[o.request_id] = list(o.outputs[0].token_ids)
    raise AssertionError("requests did not finish")


def test_idle_engine_schedules_a_prompt_in_its_first_step(tiny_model: str, reference: list[list[int]],
                                                          daemon: Any, answers: Any) -> None:
    """One prompt at a time on an idle engine: each is answered (a hit or a miss, never "not yet")
    in the schedule() right after its arrival, which schedules it; vLLM's outputs are unchanged."""
    llm = make_llm(tiny_model, daemon.address, extra={"kvoffd_lookup_wait_ms": LONG_MS})
    try:
        seen = answers(llm)
        for i, p in enumerate(PROMPTS):
            calls0 = seen.calls
            assert generate(llm, [p]) == [reference[i]]
            # (the reply was waited for, unless it was in before vLLM asked: a fast daemon)
            assert seen.of(p) and None not in seen.of(p), seen.of(p)
            (req_id,) = [r for r, c in seen.first_run.items() if c >= calls0]
            assert seen.first_run[req_id] == calls0
            drain(llm)
        # and again with every block in the daemon (vLLM's own cache emptied): the hits load
        # asynchronously here (make_llm's sync budget is 0), the answer still comes in the first step
        assert llm.reset_prefix_cache()
        for i, p in enumerate(PROMPTS):
            n0 = len(seen.of(p))
            assert generate(llm, [p]) == [reference[i]]
            got = seen.of(p)[n0:]
            assert got and None not in got, got
            drain(llm)
        assert _stat(llm, "lookup_hit_blocks") > 0
    finally:
        close_llm(llm)


def test_busy_engine_never_waits_for_a_lookup(tiny_model: str, reference: list[list[int]], tmp_path: Path,
                                              answers: Any) -> None:
    """A prompt arrives while another decodes and the daemon is frozen: its lookup is answered "not
    yet" at once (no wait: the running request's steps go on), and after the daemon thaws both
    finish with vLLM's own tokens."""
    from vllm.inputs import TokensPrompt

    d = Daemon(tmp_path).start()
    llm = make_llm(tiny_model, d.address, extra={"kvoffd_lookup_wait_ms": LONG_MS})
    pid = None
    try:
        seen = answers(llm)
        engine = llm.llm_engine
        engine.add_request("a", TokensPrompt(prompt_token_ids=PROMPTS[0]), greedy(20))
        _step_until_tokens(llm, "a", 2)  # "a" decodes
        pid = d.proc.pid
        os.kill(pid, signal.SIGSTOP)
        waits0 = _stat(llm, "lookup_waits")
        engine.add_request("b", TokensPrompt(prompt_token_ids=PROMPTS[1]), greedy(20))
        _step_until_tokens(llm, "a", 5)  # three more steps of "a" while "b"'s lookup is unanswered
        assert seen.of(PROMPTS[1]) and all(x is None for x in seen.of(PROMPTS[1])), seen.of(PROMPTS[1])
        assert _stat(llm, "lookup_waits") == waits0
        os.kill(pid, signal.SIGCONT)
        pid = None
        out = _run_all(llm)
        assert [out["a"], out["b"]] == [reference[0], reference[1]]
        drain(llm)
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        close_llm(llm)
        d.stop()


def test_idle_wait_is_bounded_by_a_frozen_daemon(tiny_model: str, reference: list[list[int]], tmp_path: Path,
                                                 answers: Any) -> None:
    """The daemon frozen on an idle engine: each step waits at most its bound, the request is answered
    "not yet" until its lookup times out, then computed (vLLM's own tokens) while the daemon is
    still frozen."""
    d = Daemon(tmp_path).start()
    llm = make_llm(tiny_model, d.address, extra={"kvoffd_lookup_wait_ms": 20, "kvoffd_lookup_timeout_ms": 500})
    pid = None
    try:
        seen = answers(llm)
        pid = d.proc.pid
        os.kill(pid, signal.SIGSTOP)
        out = generate(llm, [PROMPTS[2]], max_tokens=1)  # a store of its blocks waits for the thaw
        assert out == [reference[2][:1]]
        got = seen.of(PROMPTS[2])
        assert got[:-1] and all(x is None for x in got[:-1]) and got[-1] == 0, got
        assert _stat(llm, "lookup_timeouts") == 1
        assert _stat(llm, "lookup_waits") >= 1
        os.kill(pid, signal.SIGCONT)
        pid = None
        drain(llm)
    finally:
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        close_llm(llm)
        d.stop()
