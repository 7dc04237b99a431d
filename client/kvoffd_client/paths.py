"""Where a node's kvoffd lives by default: shared by the daemon (its defaults) and its clients (the
auth token file they read), so that both sides agree without the client importing the daemon."""

from __future__ import annotations

import os


def runtime_dir() -> str:
    """$XDG_RUNTIME_DIR/kvoffd when that directory exists, else /tmp/kvoffd-<uid>."""
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return os.path.join(xdg, "kvoffd")
    return f"/tmp/kvoffd-{os.getuid()}"


def default_address() -> str:
    """The daemon's socket when ``--address`` is not given: a UNIX socket in ``runtime_dir()``."""
    return f"ipc://{os.path.join(runtime_dir(), 'kvoffd.sock')}"


def default_auth_token_file() -> str:
    """The 0600 file a tcp:// daemon keeps its client token in (and its clients read)."""
    return os.path.join(runtime_dir(), "auth-token")
