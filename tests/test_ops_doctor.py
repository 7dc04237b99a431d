"""`kvoffd doctor` on a machine without a GPU (CI): every check reports, GPU checks skip with a
reason, and nothing ever prints a traceback. Host checks are driven into each verdict directly."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import uuid
from pathlib import Path

import pytest
from daemon import DaemonProc

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
    c.gpu_probe = {"probe_error": "the GPU probe did not finish in 1s (a hung driver?)"}
    for check in (doctor_gpu_checks.check_gpus, doctor_gpu_checks.check_ipc, doctor_gpu_checks.check_bandwidth):
        r = check(c)
        assert r.status in (SKIP, FAIL) and "probe" in r.detail


def test_gpu_results_are_judged(monkeypatch):
    """Findings as a GPU host would report them: a slow link warns, a failed IPC open fails."""
    c = ctx(ipc=True, bandwidth_bytes=256 << 20)
    c.gpu_probe = {"torch": "2.x", "torch_cuda": "12.8", "available": True, "count": 2, "gpus": [
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


# --- the pool the doctor checks is the daemon's (issue 33, point 6) ------------------------------------


@pytest.fixture
def shm_pool_path():
    d = f"/dev/shm/kvtest-doctor-{uuid.uuid4().hex[:10]}"
    os.makedirs(d, mode=0o700)
    yield f"{d}/kvoffd.pool"
    shutil.rmtree(d, ignore_errors=True)


def _doctor(*args: str) -> dict[str, dict]:
    """The doctor's results by name, run as an operator's shell would: none of the daemon's KVOFFD_*."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("KVOFFD_")}
    r = run_doctor("--json", "--bandwidth-size", "0", "--no-ipc", *args, env=env)
    assert r.returncode in (0, 1) and "Traceback" not in r.stderr, r.stderr
    return {x["name"]: x for x in json.loads(r.stdout)["results"]}


def test_the_pool_file_check_is_about_the_running_daemons_pool(make_daemon, shm_pool_path, tmp_path):
    """Without the daemon's environment the doctor checked its own default pool size and path: the
    running daemon's file was described as another one, and a file the next start would not adopt was
    a PASS. Now it asks the daemon (STATS) for its pool's size and file, the unit's --env-file wins
    (what the next start uses), and "will not adopt" is a WARN with its reason and a fix."""
    d = make_daemon("128MiB", "--pool-path", shm_pool_path, name="doc")
    pid = d.client().stats()["daemon"]["pid"]
    r = _doctor("--address", d.address)["pool-file"]
    assert r["status"] == PASS, r
    assert r["detail"].startswith(f"{shm_pool_path} (from the running daemon (pid {pid}))"), r
    assert f"for a 128MiB pool (from the running daemon (pid {pid}))" in r["detail"], r
    assert "adopted at the next start" in r["detail"], r

    r = _doctor("--address", d.address, "--pool-size", "256MiB")["pool-file"]  # the next start, resized
    assert r["status"] == WARN and r["fix"], r
    assert "will not adopt (its pool size is 128MiB, this daemon's 256MiB)" in r["detail"], r
    assert f"the pool size of the running daemon (pid {pid}), 128MiB (overruled by --pool-size)" in r["detail"], r

    unit = tmp_path / "kvoffd.env"  # the systemd unit's EnvironmentFile, as deploy/systemd ships it
    unit.write_text(f"# kvoffd.env\n; a comment\nKVOFFD_ADDRESS={d.address}\nKVOFFD_POOL_SIZE=\"256MiB\"\n"
                    "#KVOFFD_POOL_PATH=none\n")
    r = _doctor("--env-file", str(unit))["pool-file"]
    assert r["status"] == WARN and f"a 256MiB pool (from {unit})" in r["detail"], r
    assert r["detail"].startswith(f"{shm_pool_path} (from the running daemon (pid {pid}))"), r
    unit.write_text(f"KVOFFD_ADDRESS={d.address}\nKVOFFD_POOL_SIZE='128MiB'\n")
    res = _doctor("--env-file", str(unit))
    assert res["pool-file"]["status"] == PASS and "adopted at the next start" in res["pool-file"]["detail"], res
    assert res["daemon"]["status"] == PASS and shm_pool_path in res["daemon"]["detail"], res["daemon"]


def test_a_running_daemon_with_its_pool_in_private_memory_is_a_warn(make_daemon):
    """Its blocks go with it at the restart: never a PASS, whatever file the next start would use."""
    d = make_daemon("64MiB", "--pool-path", "none", name="private")
    r = _doctor("--address", d.address)["pool-file"]
    assert r["status"] == WARN and "keeps its pool in private memory" in r["detail"] and r["fix"], r


def test_an_env_file_systemd_would_not_take_is_refused_with_its_line(tmp_path):
    bad = tmp_path / "kvoffd.env"
    bad.write_text("KVOFFD_POOL_SIZE=64GiB\nexport KVOFFD_ADDRESS ipc:///run/kvoffd/kvoffd.sock\n")
    r = run_doctor("--env-file", str(bad), "--bandwidth-size", "0", "--no-ipc")
    assert r.returncode == 2 and f"--env-file {bad}, line 2: not KEY=VALUE" in r.stderr, r.stderr
    r = run_doctor("--env-file", str(tmp_path / "missing.env"))
    assert r.returncode == 2 and "No such file" in r.stderr, r.stderr


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None, reason="plays another user (needs root)")
def test_a_daemon_of_another_user_is_checked_as_that_user_never_guessed(tmp_path):
    """The unit runs the daemon as its own user (User=vllm); root's client does not talk to another
    user's socket. Run as root, the doctor cannot ask the daemon, so its default pool is not the
    daemon's: a WARN naming the user to run it as (before: a PASS about a 4 GiB default pool and a
    file that did not exist). Run as that user, it checks the daemon's own file: PASS, adopted."""
    home = Path(tempfile.mkdtemp(prefix="kvtest-doctor-uid-"))  # reachable by uid 65534 (tmp_path is not)
    pool_dir = Path(f"/dev/shm/kvtest-doctor-uid-{uuid.uuid4().hex[:10]}")
    address, pool = f"ipc://{home}/k.sock", str(pool_dir / "kvoffd.pool")
    log = tmp_path / "nobody.log"
    nobody = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups"]
    env = {k: v for k, v in os.environ.items() if k != "XDG_RUNTIME_DIR" and not k.startswith("KVOFFD_")}
    proc = None
    try:
        for p in (home, pool_dir):
            os.makedirs(p, mode=0o700, exist_ok=True)
            os.chown(p, 65534, 65534)
        proc = DaemonProc(address, ["--pool-size", "128MiB", "--pool-path", pool, "--metrics-address", "off"],
                          wrapper=nobody, env=env, cwd="/", log_path=log).start(30)
        assert proc.proc.poll() is None, log.read_text()
        r = _doctor("--address", address)["pool-file"]
        assert r["status"] == WARN and "could not be asked for its pool" in r["detail"], r
        assert "sudo -u nobody" in r["fix"], r
        out = subprocess.run([*nobody, sys.executable, "-m", "kvoffd", "doctor", "--json", "--bandwidth-size", "0",
                              "--no-ipc", "--address", address], capture_output=True, text=True, env=env, cwd="/",
                             timeout=300)
        r = {x["name"]: x for x in json.loads(out.stdout)["results"]}["pool-file"]
        assert r["status"] == PASS and r["detail"].startswith(pool) and "a 128MiB pool" in r["detail"], r
        assert "adopted at the next start" in r["detail"], r
    finally:
        if proc is not None:
            proc.stop(signal.SIGTERM, 30)
        shutil.rmtree(pool_dir, ignore_errors=True)
        shutil.rmtree(home, ignore_errors=True)
