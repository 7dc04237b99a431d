"""`kvoffd doctor` on a machine without a GPU (CI): every check reports, GPU checks skip with a
reason, and nothing ever prints a traceback. Host checks are driven into each verdict directly."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from kvoffd.ops import doctor, doctor_daemon, doctor_gpu_checks, doctor_host
from kvoffd.ops.doctor_result import FAIL, PASS, SKIP, WARN, Context

GPU_CHECKS = ("gpus", "cuda-ipc", "bandwidth")


def run_doctor(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "kvoffd", "doctor", *args], capture_output=True, text=True,
                          timeout=300, env=env)


def ctx(**kw) -> Context:
    base = dict(pool_size=64 << 20, pool_size_source="test", address="ipc:///nonexistent/kvoffd.sock",
                bandwidth_bytes=0, ipc=False, gpu_timeout_s=60)
    base.update(kw)
    return Context(**base)


def test_doctor_runs_without_gpu_and_explains_skips(tmp_path):
    r = run_doctor("--address", f"ipc://{tmp_path}/kvoffd/kvoffd.sock", "--pool-size", "64MiB")
    out = r.stdout + r.stderr
    assert "Traceback" not in out and "internal error" not in out
    assert r.returncode in (0, 1)
    lines = {ln.split()[1]: ln for ln in r.stdout.splitlines() if ln[:4] in ("PASS", "WARN", "FAIL", "SKIP")}
    for name in ("memlock", "shm", "hugepages", "memory", "socket", "daemon", *GPU_CHECKS):
        assert name in lines, r.stdout
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        for name in GPU_CHECKS:
            status, _, detail = lines[name].split(None, 2)
            assert status in ("SKIP", "FAIL", "WARN"), lines[name]
            assert len(detail) > 20, f"no reason given: {lines[name]}"
    assert r.returncode == (1 if any(ln.startswith("FAIL") for ln in lines.values()) else 0)


def test_doctor_json_and_exit_code_on_failure(tmp_path):
    r = run_doctor("--json", "--pool-size", "1000TiB", "--address", f"ipc://{tmp_path}/k/k.sock")
    assert "Traceback" not in r.stderr
    res = {x["name"]: x for x in json.loads(r.stdout)["results"]}
    assert res["memory"]["status"] == FAIL and res["memory"]["fix"]
    assert r.returncode == 1


def test_doctor_without_torch_skips_gpu_checks(tmp_path):
    """A kvoffd installed without the cuda extra: torch cannot be imported at all."""
    fake = tmp_path / "site"
    fake.mkdir()
    (fake / "torch.py").write_text("raise ImportError('No module named torch (test)')\n")
    env = {**os.environ, "PYTHONPATH": f"{fake}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    r = run_doctor("--json", "--address", f"ipc://{tmp_path}/k/k.sock", "--pool-size", "64MiB", env=env)
    assert "Traceback" not in r.stderr, r.stderr
    res = {x["name"]: x for x in json.loads(r.stdout)["results"]}
    if not Path("/dev/nvidia0").exists():
        assert res["gpus"]["status"] == SKIP and "torch is not installed" in res["gpus"]["detail"]
        assert res["cuda-ipc"]["status"] == SKIP and res["bandwidth"]["status"] == SKIP


def test_gpu_probe_failure_is_a_result_not_a_crash(monkeypatch):
    c = ctx(ipc=True, bandwidth_bytes=1 << 20)
    c._gpu = {"probe_error": "the GPU probe did not finish in 1s (a hung driver?)"}
    for check in (doctor_gpu_checks.check_gpus, doctor_gpu_checks.check_ipc, doctor_gpu_checks.check_bandwidth):
        r = check(c)
        assert r.status in (SKIP, FAIL) and "probe" in r.detail


def test_gpu_results_are_judged(monkeypatch):
    """Findings as a GPU host would report them: a slow link warns, a failed IPC open fails."""
    c = ctx(ipc=True, bandwidth_bytes=256 << 20)
    c._gpu = {"torch": "2.x", "torch_cuda": "12.8", "available": True, "count": 2, "gpus": [
        {"index": 0, "name": "H200", "uuid": "GPU-aaaa", "bus_id": "0000:19:00.0",
         "link": {"max": {"gts": 32.0, "width": 16, "gbps": 63.0}, "current": {"gts": 32.0, "width": 16, "gbps": 63.0}},
         "bandwidth": {"h2d": 53.1, "d2h": 54.0}, "ipc": {"ok": True, "open_s": 0.01}},
        {"index": 1, "name": "H200", "uuid": "GPU-bbbb", "bus_id": "0000:3b:00.0",
         "link": {"max": {"gts": 32.0, "width": 16, "gbps": 63.0}, "current": {"gts": 2.5, "width": 16, "gbps": 4.0}},
         "bandwidth": {"h2d": 12.0, "d2h": 13.0}, "ipc": {"ok": False, "error": "cudaIpcOpenMemHandle failed"}},
    ]}
    g = doctor_gpu_checks.check_gpus(c)
    assert g.status == PASS and "GPU-aaaa" in g.detail and "GPU-bbbb" in g.detail
    b = doctor_gpu_checks.check_bandwidth(c)
    assert b.status == WARN and "GPU 1" in b.detail and "trained now at 2.5 GT/s" in b.detail and b.fix
    i = doctor_gpu_checks.check_ipc(c)
    assert i.status == FAIL and "GPU 1" in i.detail and "shareProcessNamespace" in i.fix


@pytest.mark.parametrize("mode,status", [(0o700, PASS), (0o750, PASS), (0o770, WARN), (0o755, FAIL), (0o777, FAIL)])
def test_socket_dir_modes(tmp_path, mode, status):
    d = tmp_path / "kvoffd"
    d.mkdir()
    d.chmod(mode)
    r = doctor_daemon.check_socket_dir(ctx(address=f"ipc://{d}/kvoffd.sock"))
    assert r.status == status, r
    if status != PASS:
        assert "chmod" in r.fix


def test_socket_dir_missing_and_tcp(tmp_path):
    assert doctor_daemon.check_socket_dir(ctx(address=f"ipc://{tmp_path}/new/kvoffd.sock")).status == PASS
    assert doctor_daemon.check_socket_dir(ctx(address="tcp://127.0.0.1:5555")).status == SKIP
    assert doctor_daemon.check_socket_dir(ctx(address="tcp://10.1.2.3:5555")).status == WARN


def test_memlock_and_memory_verdicts(monkeypatch):
    assert doctor_host.check_memory(ctx(pool_size=1 << 20)).status == PASS
    assert doctor_host.check_memory(ctx(pool_size=1 << 60)).status == FAIL
    monkeypatch.setattr(doctor_host, "device_nodes", lambda: ["nvidiactl", "nvidia-uvm"])  # no GPU: nothing pinned
    assert doctor_host.check_memlock(ctx(pool_size=1 << 50)).status == SKIP
    monkeypatch.setattr(doctor_host, "device_nodes", lambda: ["nvidia0", "nvidiactl"])
    m = doctor_host.check_memlock(ctx(pool_size=1 << 50))
    assert m.status in (PASS, WARN)
    if m.status == WARN:
        assert "LimitMEMLOCK=infinity" in m.fix and "memlock=-1" in m.fix


def test_a_crashed_probe_names_its_signal():
    assert doctor_gpu_checks._exit_words(-7) == "was killed by SIGBUS (signal 7)"
    assert doctor_gpu_checks._exit_words(3) == "exited with status 3"


def test_a_broken_check_is_reported_not_raised():
    def check_boom(_ctx):
        raise RuntimeError("boom")

    (r,) = doctor.run_checks(ctx(), [check_boom])
    assert r.name == "boom" and r.status == WARN and "boom" in r.detail


def test_doctor_sees_a_live_daemon(daemon):
    r = doctor_daemon.check_daemon(ctx(address=daemon.address))
    assert r.status == PASS and "answers" in r.detail
