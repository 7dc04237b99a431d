"""Configuration: embedded defaults, env vars, flags, one clear line for a bad value."""

from __future__ import annotations

import os
import resource
import stat
import subprocess
import sys

import pytest
from daemon import DaemonProc, run_daemon

from kvoffd.cache.policy import DiskPolicy, RemotePublish
from kvoffd.config import (
    SETTINGS,
    ConfigError,
    build_parser,
    check_pool_fits,
    load_config,
    parse_size,
    physical_ram,
)
from kvoffd.units import format_size
from kvoffd_client.paths import default_address


def test_sizes_with_units():
    assert parse_size("512MiB") == 512 << 20
    assert parse_size("64GiB") == 64 << 30
    assert parse_size("1.5 GiB") == 3 << 29
    assert parse_size("1000") == 1000
    for bad in ("12XB", "-1GiB", "", "GiB", "0"):
        with pytest.raises(ConfigError):
            parse_size(bad)


def test_defaults_env_and_flags(tmp_path):
    cfg = load_config([], environ={})
    assert cfg.address == default_address() and cfg.address.startswith("ipc://")
    assert cfg.pool_size <= 4 << 30 and cfg.metrics_address == "127.0.0.1:9464"
    cfg = load_config([], environ={"KVOFFD_POOL_SIZE": "1GiB", "KVOFFD_LOG_LEVEL": "debug"})
    assert cfg.pool_size == 1 << 30 and cfg.log_level == "debug"
    cfg = load_config(["--pool-size", "2GiB"], environ={"KVOFFD_POOL_SIZE": "1GiB"})
    assert cfg.pool_size == 2 << 30  # flags win over the environment


def test_default_address_prefers_xdg_runtime_dir(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert default_address() == f"ipc://{tmp_path}/kvoffd/kvoffd.sock"
    monkeypatch.delenv("XDG_RUNTIME_DIR")
    assert default_address() == f"ipc:///tmp/kvoffd-{os.getuid()}/kvoffd.sock"


def test_tcp_binds_loopback_unless_told():
    cfg = load_config(["--address", "tcp://*:5555"], environ={})
    assert cfg.address == "tcp://127.0.0.1:5555"
    assert any("loopback" in n and "--allow-remote" in n for n in cfg.notices), cfg.notices  # said, not silent
    assert load_config(["--address", "tcp://127.0.0.1:5555"], environ={}).notices == []
    assert load_config(["--address", "tcp://*:5555", "--allow-remote"], environ={}).address == "tcp://*:5555"
    with pytest.raises(ConfigError, match="--allow-remote"):
        load_config(["--address", "tcp://10.1.2.3:5555"], environ={})
    with pytest.raises(ConfigError):
        load_config(["--address", "http://x"], environ={})


def test_address_forms_kept_or_refused():
    assert load_config(["--address", "tcp://[::1]:5555"], environ={}).address == "tcp://[::1]:5555"
    assert load_config(["--address", "tcp://::1:5555"], environ={}).address == "tcp://[::1]:5555"
    for bad in ("inproc://kvoffd", "ipc:///tmp/" + "x" * 120 + "/kvoffd.sock"):
        with pytest.raises(ConfigError):
            load_config(["--address", bad], environ={})


@pytest.mark.parametrize("args", [["--pool-size", "lots"], ["--log-level", "loud"], ["--backend", "tpu"],
                                  ["--metrics-address", "nowhere"], ["--address", "tcp://8.8.8.8:1"],
                                  ["--engine-timeout", "abc"], ["--address", "inproc://x"],
                                  ["--address", "ipc:///tmp/" + "y" * 200]])
def test_bad_values_fail_at_start_with_one_line(args):
    r = run_daemon(args, timeout=30)
    assert r.returncode == 2
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvoffd: "), r.stderr


def test_each_setting_is_one_name_as_field_flag_and_variable():
    """A setting is named once: its Config field, its flag (the name, dashed) and its KVOFFD_ variable
    (the name, upper case) cannot drift apart, and the parser knows every one."""
    parser_dests = {a.dest for a in build_parser()._actions}
    for f in SETTINGS:
        assert f.metadata["flag"] == "--" + f.name.replace("_", "-"), f.name
        assert f.metadata["env"] == "KVOFFD_" + f.name.upper(), f.name
        assert f.name in parser_dests
    assert load_config(["--engine-timeout", "2.5"], environ={}).engine_timeout == 2.5
    assert load_config([], environ={"KVOFFD_ENGINE_TIMEOUT": "7"}).engine_timeout == 7.0


def test_the_disk_policy_is_one_of_the_tiers_and_a_bad_one_says_which():
    assert load_config([], environ={}).disk_policy is DiskPolicy.CLOCK2_GHOST
    assert load_config(["--disk-policy", "CLOCK2"], environ={}).disk_policy is DiskPolicy.CLOCK2
    with pytest.raises(ConfigError, match=r"^--disk-policy must be one of clock2-ghost, clock2, got 'lru'$"):
        load_config([], environ={"KVOFFD_DISK_POLICY": "lru"})


def test_remote_publish_is_admitted_or_evicted_and_needs_remote():
    url = "redis://127.0.0.1:6379"
    assert load_config(["--remote", url], environ={}).remote_publish is RemotePublish.ADMITTED
    assert load_config(["--remote", url, "--remote-publish", "Evicted"], environ={}).remote_publish is \
        RemotePublish.EVICTED
    with pytest.raises(ConfigError, match=r"^--remote-publish must be one of admitted, evicted, got 'spilled'$"):
        load_config(["--remote", url], environ={"KVOFFD_REMOTE_PUBLISH": "spilled"})
    with pytest.raises(ConfigError, match=r"^--remote-publish needs --remote$"):
        load_config(["--remote-publish", "evicted"], environ={})


def test_help_explains_every_flag():
    r = subprocess.run([sys.executable, "-m", "kvoffd", "--help"], capture_output=True, text=True, timeout=30)
    assert r.returncode == 0
    for flag in ("--address", "--pool-size", "--metrics-address", "--log-level", "--backend", "--allow-remote",
                 "KVOFFD_"):
        assert flag in r.stdout


def test_socket_directory_and_socket_are_private(make_daemon, tmp_path):
    d = make_daemon("16MiB", name="private")
    path = d.address[len("ipc://"):]
    assert stat.S_IMODE(os.stat(path).st_mode) == 0o600
    # the default runtime directory is created 0700
    rt = tmp_path / "rt"
    rt.mkdir()
    env = {**os.environ, "XDG_RUNTIME_DIR": str(rt), "KVOFFD_METRICS_ADDRESS": "off", "KVOFFD_POOL_SIZE": "16MiB"}
    p = DaemonProc(f"ipc://{rt}/kvoffd/kvoffd.sock", env=env, argv=[sys.executable, "-m", "kvoffd"]).start()
    try:
        from kvtest import wait_until

        assert wait_until(lambda: (rt / "kvoffd" / "kvoffd.sock").exists(), 20)
        assert stat.S_IMODE(os.stat(rt / "kvoffd").st_mode) == 0o700
        assert stat.S_IMODE(os.stat(rt / "kvoffd" / "kvoffd.sock").st_mode) == 0o600
        # a second daemon on the same socket refuses to steal it
        r = run_daemon([], env=env, timeout=30)
        assert r.returncode == 1 and "another daemon" in r.stderr
    finally:
        p.stop()


def test_an_address_naming_a_regular_file_keeps_the_file(tmp_path):
    """Issue 19 item 18: --address ipc://<an existing regular file> used to delete that file."""
    d = tmp_path / "run"
    d.mkdir(mode=0o700)
    victim = d / "notes.txt"
    victim.write_text("keep me")
    r = run_daemon(["--address", f"ipc://{victim}", "--metrics-address", "off", "--pool-size", "16MiB"], timeout=30)
    assert r.returncode == 1 and "not a socket" in r.stderr
    assert victim.read_text() == "keep me"


def test_stopping_an_old_daemon_keeps_a_newer_daemons_socket(make_daemon):
    """Issue 19 item 19: an operator removed daemon A's socket and started B on the same path; A's
    stop must not unlink B's socket."""
    a = make_daemon("16MiB", name="same")
    path = a.address[len("ipc://"):]
    os.unlink(path)
    os.unlink(path + ".fd")  # (the memfd hand-over socket beside it)
    b = make_daemon("16MiB", name="same")
    assert a.stop() == 0
    assert os.path.exists(path) and os.path.exists(path + ".fd")
    assert b.client().ping(timeout_s=5) >= 0


def test_pool_larger_than_ram_is_refused_at_start_with_one_line(tmp_path):
    """Issue 19 item 7: a pool larger than RAM failed with a bare "Cannot allocate memory" (or, with
    overcommit, started and swapped). It is a configuration error, named with both sizes."""
    ram = physical_ram()
    assert ram
    r = run_daemon(["--address", f"ipc://{tmp_path}/d.sock", "--metrics-address", "off", "--pool-size", str(2 * ram)],
                   timeout=30)
    assert r.returncode == 2, r.stderr
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kvoffd: "), r.stderr
    assert "larger than this host's RAM" in lines[0] and format_size(ram) in lines[0], lines[0]
    assert format_size(2 * ram) in lines[0], lines[0]


def test_pool_near_ram_warns_and_a_small_one_does_not():
    assert check_pool_fits(50 << 20, ram=100 << 20) == ""
    warning = check_pool_fits(95 << 20, ram=100 << 20)
    assert "95% of this host's RAM" in warning and "100.0 MiB" in warning, warning
    assert check_pool_fits(100 << 20, ram=100 << 20)  # all of it: a warning, not a refusal
    with pytest.raises(ConfigError, match="larger than this host's RAM"):
        check_pool_fits((100 << 20) + 1, ram=100 << 20)


def test_pool_the_kernel_refuses_fails_with_one_clear_line(tmp_path):
    """Within RAM, but the kernel still refuses the mapping (here RLIMIT_AS; a cgroup or strict
    overcommit in production): one line naming the pool and the host's memory, no traceback."""

    def limit_address_space():
        resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))

    ram = physical_ram()
    if not ram or ram < (5 << 30):
        pytest.skip("needs a host with more than 4 GiB of RAM (the pool must fit RAM to pass the config check)")
    r = run_daemon(["--address", f"ipc://{tmp_path}/d.sock", "--metrics-address", "off", "--backend", "cpu",
                    "--pool-size", "4GiB"], preexec_fn=limit_address_space)
    assert r.returncode == 1, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    line = next(ln for ln in r.stderr.splitlines() if "cannot start" in ln)
    assert "cannot reserve a pool of 4.0 GiB" in line and "RAM " in line and "available" in line, line


def test_disk_tier_flags_and_their_default_policy():
    cfg = load_config(["--disk-path", "/tmp/x", "--disk-size", "2GiB"], environ={})
    assert cfg.disk_path == "/tmp/x" and cfg.disk_size == 2 << 30 and cfg.eviction_policy == "lru"
    cfg = load_config(["--disk-path", "/tmp/x", "--disk-size", "2GiB", "--eviction-policy", "adaptive-doorkeeper"],
                      environ={})
    assert cfg.eviction_policy == "adaptive-doorkeeper"  # an explicit choice stands
    with pytest.raises(ConfigError, match="--disk-size"):
        load_config(["--disk-path", "/tmp/x"], environ={})
    with pytest.raises(ConfigError, match="--disk-path"):
        load_config(["--disk-size", "1GiB"], environ={})
