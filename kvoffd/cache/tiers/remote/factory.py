"""The cluster tier the configuration asks for (``--remote``, ``--remote-password-file``,
``--remote-key-file``, ``--remote-write-budget``). Parsing and reading the files happen here, at the
start, so that a wrong URL or an unreadable file is one clear line (``RemoteSetupError``) before the
daemon serves; an unreachable cluster is not an error (every block is a miss until it answers)."""

from __future__ import annotations

from kvoffd.cache.tiers.remote.address import AddressError, parse_url
from kvoffd.cache.tiers.remote.store import RemoteConfig, RemoteStore
from kvoffd.cache.tiers.remote.tier import RemoteTier
from kvoffd.cache.tiers.remote.valueformat import KeyFileError, read_key_file


class RemoteSetupError(RuntimeError):
    """A --remote setting that cannot be used (the daemon says "cannot start: ..." and exits 1)."""


def make_remote_tier(url: str, password_file: str = "", key_file: str = "", write_budget: int = 0) -> RemoteTier:
    try:
        address = parse_url(url, password_file or None)
        secret = read_key_file(key_file) if key_file else None
    except (AddressError, KeyFileError) as e:
        raise RemoteSetupError(str(e)) from e
    return RemoteTier(RemoteStore(RemoteConfig(address, secret)), write_budget=write_budget)
