"""`make run` (the README's first command) starts a daemon that `kvoffctl status` reaches."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from kvtest import ROOT, wait_until


@pytest.mark.skipif(not (ROOT / ".venv" / "bin" / "kvoffd").exists(), reason="needs the project's .venv (make test)")
def test_make_run_then_kvoffctl_status(tmp_path):
    rt = tmp_path / "rt"
    rt.mkdir()
    env = {**os.environ, "XDG_RUNTIME_DIR": str(rt), "KVOFFD_METRICS_ADDRESS": "127.0.0.1:0",
           "KVOFFD_POOL_SIZE": "64MiB"}
    make = subprocess.Popen(["make", "--no-print-directory", "run"], cwd=ROOT, env=env, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        sock = rt / "kvoffd" / "kvoffd.sock"
        assert wait_until(sock.exists, 60), "make run did not bring up the default socket"
        ctl = Path(sys.executable).with_name("kvoffctl")
        r = subprocess.run([str(ctl), "status"], env=env, capture_output=True, text=True, timeout=60)
        assert r.returncode == 0, r.stdout + r.stderr
        assert "kvoffd" in r.stdout.lower()
    finally:
        os.killpg(make.pid, signal.SIGTERM)
        out = make.communicate(timeout=30)[0]
    assert "serving on ipc://" in out


def test_make_says_what_it_does_when_systemd_analyze_is_missing(tmp_path):
    """Issue 19 item 7: `make test` silently ran `apt-get install systemd` when systemd-analyze was
    missing. Now it says so; with NO_APT=1 it only prints the command (and never runs apt-get)."""
    make = shutil.which("make")
    if make is None:
        pytest.skip("needs make")
    bin_dir = tmp_path / "bin"  # a PATH with the shell's tools but no systemd-analyze and no apt-get
    bin_dir.mkdir()
    for tool in ("sh", "id"):
        (bin_dir / tool).symlink_to(shutil.which(tool))
    env = {**os.environ, "PATH": str(bin_dir)}
    r = subprocess.run([make, "--no-print-directory", "check-systemd", "NO_APT=1"], cwd=ROOT, env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    assert "systemd-analyze is missing" in r.stdout and "apt-get install systemd" in r.stdout, r.stdout
    assert "running apt-get" not in r.stdout
