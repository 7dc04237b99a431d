"""`make run` (the README's first command) starts a daemon that `kvoffctl status` reaches."""

from __future__ import annotations

import os
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
