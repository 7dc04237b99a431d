"""Fixtures for the end-to-end connector tests: a tiny random Llama, a real daemon, in-process engines.

Engines run in-process (VLLM_ENABLE_V1_MULTIPROCESSING=0): ~2 s to start on CPU and both connector
halves reachable from the test. The whole directory skips when vllm is not installed.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from engine_helpers import HAVE_VLLM, PROMPTS, Daemon, build_tiny_llama, close_llm, generate, make_llm


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    here = Path(__file__).parent
    for item in items:
        if here in Path(str(item.fspath)).parents:
            item.add_marker(pytest.mark.vllm)
            if not HAVE_VLLM:
                item.add_marker(pytest.mark.skip(reason="vllm is not installed (make install-vllm)"))


@pytest.fixture(scope="session", autouse=True)
def vllm_sockets_in_a_directory_of_their_own() -> Iterator[None]:
    """vLLM makes a ZeroMQ socket file per engine in its RPC base path (/tmp by default) and leaves it
    there when the engine stops: the tests' go in a directory of their own (inherited by the engines'
    child processes and ``vllm serve``), removed when the session ends."""
    d = tempfile.mkdtemp(prefix="kvoffd-vllm-rpc-")
    old = os.environ.get("VLLM_RPC_BASE_PATH")
    os.environ["VLLM_RPC_BASE_PATH"] = d
    try:
        yield
    finally:
        if old is None:
            os.environ.pop("VLLM_RPC_BASE_PATH", None)
        else:
            os.environ["VLLM_RPC_BASE_PATH"] = old
        shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    if not HAVE_VLLM:
        pytest.skip("vllm is not installed")
    return str(build_tiny_llama(tmp_path_factory.mktemp("tiny-llama")))


@pytest.fixture(scope="module")
def daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Daemon]:
    d = Daemon(tmp_path_factory.mktemp("kvoffd")).start()
    yield d
    d.stop()


@pytest.fixture(scope="session")
def reference(tiny_model: str) -> list[list[int]]:
    """Greedy outputs of PROMPTS from an engine without any connector."""
    llm = make_llm(tiny_model)
    try:
        return generate(llm, PROMPTS)
    finally:
        close_llm(llm)
