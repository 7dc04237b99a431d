"""``--remote URL``: ``redis://[user[:password]@]host:port[,host:port...]`` (seeds of a cluster, or one
plain server) and ``rediss://`` for TLS; ``--remote-password-file``: the password on the file's first
line, so that it is in no command line (the user, for an ACL user, comes from the URL). A password in
the URL works too (tests); the file wins when both are given."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from urllib.parse import unquote


class AddressError(ValueError):
    pass


@dataclass(frozen=True)
class Address:
    seeds: tuple[tuple[str, int], ...]
    tls: bool = False
    user: str | None = None
    password: str | None = field(default=None, repr=False)


def parse_url(url: str, password_file: str | None = None) -> Address:
    if "://" not in url:
        raise AddressError(f"--remote {url!r}: expected redis://host:port[,host:port...] or rediss://...")
    scheme, rest = url.split("://", 1)
    if scheme not in ("redis", "rediss", "valkey", "valkeys"):
        raise AddressError(f"--remote {url!r}: unknown scheme {scheme!r} (redis:// or rediss://)")
    rest = rest.split("/", 1)[0]
    user = password = None
    if "@" in rest:
        cred, rest = rest.rsplit("@", 1)
        if ":" in cred:
            u, p = cred.split(":", 1)
            user, password = unquote(u) or None, unquote(p)
        else:
            user = unquote(cred) or None
    seeds = []
    for part in rest.split(","):
        part = part.strip()
        if not part:
            continue
        if part.startswith("["):  # [v6]:port
            host, _, port = part[1:].partition("]:")
        else:
            host, _, port = part.rpartition(":")
        if not host or not port.isdigit() or not 0 < int(port) < 65536:
            raise AddressError(f"--remote {url!r}: {part!r} is not host:port")
        seeds.append((host, int(port)))
    if not seeds:
        raise AddressError(f"--remote {url!r}: no host:port")
    if password_file:
        password = read_password(password_file)
    return Address(tuple(seeds), scheme in ("rediss", "valkeys"), user, password)


def read_password(path: str) -> str:
    """The first line of ``path``, without its newline; the file must not be readable by others."""
    try:
        st = os.stat(path)
        with open(path, encoding="utf-8") as f:
            pw = f.readline().rstrip("\r\n")
    except OSError as e:
        raise AddressError(f"--remote-password-file {path}: {e.strerror}") from e
    if st.st_mode & 0o004:
        raise AddressError(f"--remote-password-file {path}: readable by every user (chmod 600 it)")
    if not pw:
        raise AddressError(f"--remote-password-file {path}: empty")
    return pw
