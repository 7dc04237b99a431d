"""The cluster tier the configuration asks for (``--remote``, ``--remote-password-file``,
``--remote-key-file``, ``--remote-write-budget``, ``--remote-publish``, ``--remote-tls-*``). Parsing
and reading the files happen here, at the start, so that a wrong URL or an unreadable file is one clear line
(``RemoteSetupError``) before the daemon serves; an unreachable cluster is not an error (every block is
a miss until it answers), and neither is one whose TLS handshake fails (a connection error of each
shard, counted and logged once: the shard may be fixed while the daemon runs)."""

from __future__ import annotations

from kvoffd.cache.tiers.remote.address import AddressError, parse_url
from kvoffd.cache.tiers.remote.store import RemoteConfig, RemoteStore
from kvoffd.cache.tiers.remote.tier import RemoteTier
from kvoffd.cache.tiers.remote.tls import Tls, TlsError, client_tls
from kvoffd.cache.tiers.remote.valueformat import KeyFileError, read_key_file


class RemoteSetupError(RuntimeError):
    """A --remote setting that cannot be used (the daemon says "cannot start: ..." and exits 1)."""


def make_remote_tier(url: str, password_file: str = "", key_file: str = "", write_budget: int = 0, *,
                     tls_ca: str = "", tls_cert: str = "", tls_key: str = "",
                     tls_server_name: str = "", publish_on: str = "admitted") -> RemoteTier:
    return RemoteTier(RemoteStore(remote_config(url, password_file, key_file, tls_ca=tls_ca, tls_cert=tls_cert,
                                                tls_key=tls_key, tls_server_name=tls_server_name)),
                      write_budget=write_budget, publish_on=publish_on)


def remote_config(url: str, password_file: str = "", key_file: str = "", *, tls_ca: str = "", tls_cert: str = "",
                  tls_key: str = "", tls_server_name: str = "") -> RemoteConfig:
    """The store's configuration, every file read and checked (``RemoteSetupError``: one line)."""
    try:
        address = parse_url(url, password_file or None)
        secret = read_key_file(key_file) if key_file else None
        tls: Tls | None = None
        if tls_ca or tls_cert or tls_key or tls_server_name:
            if not address.tls:
                raise TlsError("--remote-tls-ca, --remote-tls-cert, --remote-tls-key and --remote-tls-server-name "
                               f"need a rediss:// --remote (TLS); {url.split('://', 1)[0]}:// is plain TCP")
            tls = client_tls(tls_ca, tls_cert, tls_key, tls_server_name)
    except (AddressError, KeyFileError, TlsError) as e:
        raise RemoteSetupError(str(e)) from e
    return RemoteConfig(address, secret, tls=tls)
