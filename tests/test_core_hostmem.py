"""Issue 33 point 11: a pool larger than the memory the daemon can really have.

The figures come from /proc/meminfo and the daemon's memory cgroup, read from the files the kernel
writes (here laid out in a directory of the same shape), and, end to end, from a real memory cgroup
the test creates with a limit below the pool.
"""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from kvoffd.hostmem import MemoryView, pool_memory_problem, read_memory_view

MiB = 1 << 20


def _host(tmp: Path, meminfo: str, cgroup_line: str, files: dict[str, str]) -> tuple[str, str]:
    proc, root = tmp / "proc", tmp / "cg"
    (proc / "self").mkdir(parents=True)
    (proc / "meminfo").write_text(meminfo)
    (proc / "self" / "cgroup").write_text(cgroup_line + "\n")
    for rel, text in files.items():
        (root / rel).parent.mkdir(parents=True, exist_ok=True)
        (root / rel).write_text(text)
    return str(proc), str(root)


MEMINFO = "MemTotal:       24000000 kB\nMemAvailable:    6000000 kB\nShmem:           1000000 kB\n"


def test_the_available_memory_and_shared_memory_bound_a_pool(tmp_path: Path) -> None:
    proc, root = _host(tmp_path, MEMINFO, "0::/", {"memory.max": "max\n"})
    view = read_memory_view(proc, root)
    assert (view.available, view.shmem, view.cgroup_limit) == (6000000 * 1024, 1000000 * 1024, None)
    refusal, warning = pool_memory_problem(20 << 30, view)  # the case: 20 GiB with 6 available
    assert refusal == "" and "more than this host has available" in warning
    assert pool_memory_problem(6 << 30, view) == ("", "")  # within available + shared (an adopted pool)


@pytest.mark.parametrize("layout", ["v2", "v1"])
def test_the_tightest_cgroup_limit_on_the_path_refuses(tmp_path: Path, layout: str) -> None:
    if layout == "v2":
        files = {"kubepods/memory.max": f"{512 * MiB}\n", "kubepods/pod/memory.max": "max\n"}
        line = "0::/kubepods/pod"
    else:
        files = {"memory/memory.limit_in_bytes": "9223372036854771712\n",
                 "memory/docker/abc/memory.limit_in_bytes": f"{256 * MiB}\n"}
        line = "4:memory:/docker/abc"
    proc, root = _host(tmp_path, MEMINFO, line, files)
    view = read_memory_view(proc, root)
    assert view.cgroup_limit == (512 if layout == "v2" else 256) * MiB
    refusal, _ = pool_memory_problem(1 << 30, view)
    assert "memory cgroup limit" in refusal and view.cgroup_path in refusal
    assert pool_memory_problem(128 * MiB, view) == ("", "")


def test_no_figures_no_verdict() -> None:
    assert pool_memory_problem(1 << 40, MemoryView(None, None, None)) == ("", "")


def _make_memory_cgroup(limit: int) -> Path | None:
    """A real child memory cgroup with ``limit`` (v2 or v1), or None where this host does not allow it."""
    for base, knob in ((Path("/sys/fs/cgroup"), "memory.max"), (Path("/sys/fs/cgroup/memory"), "memory.limit_in_bytes")):
        if not (base / knob).exists() and not (base / "cgroup.procs").exists():
            continue
        d = base / f"kvoffd-test-{uuid.uuid4().hex[:8]}"
        try:
            d.mkdir()
            (d / knob).write_text(str(limit))
            return d
        except OSError:
            if d.exists():
                d.rmdir()
    return None


def test_a_daemon_in_a_cgroup_smaller_than_its_pool_refuses_to_start(tmp_path: Path) -> None:
    cg = _make_memory_cgroup(256 * MiB) if os.geteuid() == 0 else None
    if cg is None:
        pytest.skip("cannot create a memory cgroup here (needs root and a writable cgroup file system)")
    sock = tmp_path / "s"
    sock.mkdir(mode=0o700)
    code = (f"import os; open({str(cg / 'cgroup.procs')!r}, 'w').write(str(os.getpid())); "
            "from kvoffd.cli import main; raise SystemExit(main())")
    try:
        r = subprocess.run([sys.executable, "-c", code, "--address", f"ipc://{sock}/d.sock", "--pool-size", "512MiB",
                            "--pool-path", "none", "--metrics-address", "127.0.0.1:0"],
                           capture_output=True, text=True, timeout=60)
    finally:
        cg.rmdir()
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "memory cgroup limit" in r.stderr and "256.0 MiB" in r.stderr, r.stderr[-2000:]
