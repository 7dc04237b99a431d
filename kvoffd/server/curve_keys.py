"""The CURVE keys of a tcp:// KV-event stream: who may subscribe, as files in one private directory.

Why CURVE and not the control socket's token: a tcp:// stream is for routers on other hosts, and the
token would travel in clear (ZeroMQ PLAIN); CURVE authenticates both ends and encrypts the stream, and
the daemon's secret never leaves its host. The directory (``--kv-events-curve-dir``, 0700, made at
first start) holds, in ZeroMQ's certificate format (what ``zmq.auth.load_certificate`` and czmq read):

* ``server.key`` / ``server.key_secret``: the outlet's key pair; a subscriber needs ``server.key``;
* ``router.key`` / ``router.key_secret``: a client key pair made for the operator's routers (hand
  ``router.key_secret`` to them, as one would the token file);
* ``allowed/``: the public keys (``*.key``) accepted at the handshake, ``router.key`` to begin with. A
  router with a key pair of its own is allowed by putting its public ``.key`` file here (read again
  when the directory changes, at the next handshake).

Secret files are 0600 and must stay so; none is ever followed through a symlink.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from dataclasses import dataclass

import zmq

from kvoffd.runtime import UnsafePath, ensure_private_dir

log = logging.getLogger(__name__)

SERVER = "server"
ROUTER = "router"
ALLOWED = "allowed"
MAX_KEY_FILE = 4096
RELOAD_EVERY_S = 1.0  # the allowed directory is looked at (one stat) at most this often


@dataclass(frozen=True)
class KeyPair:
    public: bytes  # Z85, 40 characters
    secret: bytes


def load_or_create(directory: str) -> KeyPair:
    """The server's key pair in ``directory``, made with a router key pair (allowed) at first start."""
    try:  # the parent too: whoever could write it could swap the directory for one of theirs
        ensure_private_dir(os.path.dirname(os.path.abspath(directory)))
        ensure_private_dir(directory)
        ensure_private_dir(os.path.join(directory, ALLOWED))
    except UnsafePath as e:
        raise UnsafePath(f"--kv-events-curve-dir: {e}") from None
    server = _load_or_make(directory, SERVER)
    if not os.path.lexists(os.path.join(directory, f"{ROUTER}.key_secret")):
        router = _load_or_make(directory, ROUTER)
        _write(os.path.join(directory, ALLOWED, f"{ROUTER}.key"), _cert(router.public, None), 0o644)
    return server


def read_pair(path: str) -> KeyPair:
    """A certificate file with both keys (``*.key_secret``): a regular file of this user, mode 0600."""
    public, secret = _parse(_read(path, secret=True), path)
    if secret is None:
        raise UnsafePath(f"{path} holds no secret-key")
    return KeyPair(public, secret)


def read_public(path: str) -> bytes:
    return _parse(_read(path, secret=False), path)[0]


class AllowedKeys:
    """The public keys in ``<directory>/allowed``, read again when that directory changes."""

    def __init__(self, directory: str) -> None:
        self.path = os.path.join(directory, ALLOWED)
        self.keys: frozenset[bytes] = frozenset()
        self._mtime = -1
        self._checked = 0.0
        self.refresh(force=True)

    def __contains__(self, public: bytes) -> bool:
        self.refresh()
        return public in self.keys

    def refresh(self, force: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._checked < RELOAD_EVERY_S:
            return
        self._checked = now
        try:
            mtime = os.stat(self.path).st_mtime_ns
        except OSError:
            self.keys, self._mtime = frozenset(), -1
            return
        if mtime == self._mtime:
            return
        keys = set()
        for name in sorted(os.listdir(self.path)):
            if name.endswith(".key"):
                try:
                    keys.add(read_public(os.path.join(self.path, name)))
                except (OSError, UnsafePath, ValueError) as e:
                    log.warning("KV events: ignoring allowed key %s: %s", name, e)
        self.keys, self._mtime = frozenset(keys), mtime
        log.info("KV events: %d CURVE client key(s) allowed (%s)", len(keys), self.path)


def _load_or_make(directory: str, name: str) -> KeyPair:
    path = os.path.join(directory, f"{name}.key_secret")
    if os.path.lexists(path):
        return read_pair(path)
    public, secret = zmq.curve_keypair()
    _write(path, _cert(public, secret), 0o600)
    _write(os.path.join(directory, f"{name}.key"), _cert(public, None), 0o644)
    return KeyPair(public, secret)


def _cert(public: bytes, secret: bytes | None) -> bytes:
    kind = "Secret" if secret else "Public"
    lines = [f"#   ZeroMQ CURVE {kind} Certificate, made by kvoffd", "", "metadata", "curve",
             f'    public-key = "{public.decode()}"']
    if secret:
        lines.append(f'    secret-key = "{secret.decode()}"')
    return ("\n".join(lines) + "\n").encode()


def _write(path: str, data: bytes, mode: int) -> None:
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
    with os.fdopen(fd, "wb") as f:
        f.write(data)


def _read(path: str, secret: bool) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid not in (os.getuid(), 0):
            raise UnsafePath(f"{path} must be a regular file of this user")
        if secret and stat.S_IMODE(st.st_mode) & 0o077:
            raise UnsafePath(f"{path} holds a secret key and must have mode 0600")
        return f.read(MAX_KEY_FILE)


def _parse(data: bytes, path: str) -> tuple[bytes, bytes | None]:
    public = secret = None
    for line in data.splitlines():
        line = line.strip()
        if line.startswith(b"public-key") or line.startswith(b"secret-key"):
            value = line.split(b"=", 1)[1].strip(b" \t'\"") if b"=" in line else b""
            if len(value) != 40:
                raise ValueError(f"{path}: a CURVE key is 40 Z85 characters")
            if line.startswith(b"public-key"):
                public = value
            else:
                secret = value
    if public is None:
        raise ValueError(f"{path} holds no public-key")
    return public, secret
