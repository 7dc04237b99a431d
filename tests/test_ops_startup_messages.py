"""Issue 33 points 8 and 9: what the daemon says at start tells the operator what to do next.

Real daemon processes: the line that connects vLLM (the exact ``--kv-transfer-config`` for the
address it serves on, wherever that is), and a metrics port another process holds, which must name
the flag that moves it.
"""

from __future__ import annotations

import socket

from daemon import DaemonProc, run_daemon
from kvtest import wait_until

from kvoffd_client.vllm.launch import vllm_serve_argument


def test_the_start_log_says_what_to_give_vllm(make_daemon):
    d = make_daemon("64MiB")
    assert wait_until(lambda: "for vLLM:" in d.log(), 10), d.log()[-2000:]
    line = next(ln for ln in d.log().splitlines() if "for vLLM:" in ln)
    assert line.endswith(vllm_serve_argument(d.address)), line


def test_a_busy_metrics_port_names_the_flag_that_moves_it(tmp_path):
    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    holder.listen(1)
    port = holder.getsockname()[1]
    sock = tmp_path / "s"
    sock.mkdir(mode=0o700)
    try:
        r = run_daemon(["--address", f"ipc://{sock}/d.sock", "--pool-size", "64MiB", "--pool-path", "none",
                        "--metrics-address", f"127.0.0.1:{port}"])
    finally:
        holder.close()
    assert r.returncode == 1, r.stderr[-2000:]
    assert "cannot serve metrics" in r.stderr and "--metrics-address" in r.stderr, r.stderr[-2000:]


def test_every_interface_without_allow_remote_is_said_to_be_loopback(tmp_path, monkeypatch):
    """`--address tcp://0.0.0.0:P` binds loopback unless --allow-remote; the daemon says so at start
    (test_reliability_security.py checks the socket the kernel has)."""
    from kvoffd_client.client import KvoffdClient

    holder = socket.socket()
    holder.bind(("127.0.0.1", 0))
    port = holder.getsockname()[1]
    holder.close()
    monkeypatch.setenv("KVOFFD_AUTH_TOKEN_FILE", str(tmp_path / "run" / "auth-token"))  # daemon and client
    log = tmp_path / "d.log"
    proc = DaemonProc(f"tcp://0.0.0.0:{port}", ["--pool-size", "16MiB", "--pool-path", "none", "--metrics-address",
                                                "off"], log_path=log).start()
    c = KvoffdClient(f"tcp://127.0.0.1:{port}", heartbeat=False)
    try:
        assert c.connect(20), log.read_text()[-2000:]
        line = next((ln for ln in log.read_text().splitlines() if "bound on 127.0.0.1" in ln), "")
        assert "WARNING" in line and "--allow-remote" in line, log.read_text()[-2000:]
    finally:
        c.close()
        proc.kill()
