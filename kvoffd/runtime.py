"""The daemon's runtime directory and TCP auth token: refuse anything another user could control.

A socket directory another user created (or can write) lets that user serve a fake daemon to the
engines, or keep the real one from starting; a token file others can read is no
secret. So the daemon starts only when both are its own: it creates them private, and refuses (a clear
error, exit 1) a directory or file that belongs to someone else or that others can write or read.
"""

from __future__ import annotations

import os
import secrets
import stat

from kvoffd_client.paths import runtime_dir


class UnsafePath(RuntimeError):
    """A path the daemon must not use: another user could read or replace what it puts there."""


def _trusted(uid: int) -> bool:
    return uid in (os.getuid(), 0)


def ensure_private_dir(d: str, create_mode: int = 0o700) -> None:
    """Create ``d`` (0700) if missing; refuse it unless this user or root owns it and only the owner
    can write it. A directory of this user named kvoffd* that others can only read is made 0700."""
    if not os.path.isdir(d):
        os.makedirs(d, mode=create_mode, exist_ok=True)
    st = os.stat(d)
    mode = stat.S_IMODE(st.st_mode)
    if not _trusted(st.st_uid):
        raise UnsafePath(f"socket directory {d} belongs to uid {st.st_uid}, not to this user ({os.getuid()}): "
                         "another user may have created it to serve a fake daemon. Remove it, or choose "
                         "another --address")
    if mode & 0o022:
        raise UnsafePath(f"socket directory {d} is writable by other users (mode {mode:o}); "
                         + shared_dir_advice(d, st, "--address", _private_addresses()))
    if mode & 0o077 and st.st_uid == os.getuid() and os.path.basename(d.rstrip("/")).startswith("kvoffd"):
        os.chmod(d, 0o700)  # our own directory: keep it private


def shared_dir_advice(d: str, st: os.stat_result, flag: str, private: list[str]) -> str:
    """What to do about a directory others can write. Changing the mode of a directory this user does
    not own alone (/tmp, /dev/shm, /var/tmp: shared, sticky, every user's files in it) would break
    the machine, so then the advice is one of the ``private`` values of ``flag`` instead, or a
    directory made private from the start."""
    if st.st_uid == os.getuid() and not st.st_mode & stat.S_ISVTX:
        return f"make it private (chmod 700 {d}, it is yours) or choose another {flag}"
    choices = [f"{flag} {p}" for p in private] + ["a directory of your own made with 'mkdir -m 700 DIR'"]
    return "it is a shared directory: leave its mode alone and use a private one: " + ", or ".join(choices)


def _private_addresses() -> list[str]:
    out = [f"ipc://{runtime_dir()}/kvoffd.sock (the default, private to this user)"]
    if os.getuid() == 0:
        out.append("ipc:///run/kvoffd/kvoffd.sock (systemd's RuntimeDirectory=kvoffd makes it)")
    return out


def load_or_create_token(path: str) -> bytes:
    """The TCP auth token, made at first use: 32 random bytes, hex, in a 0600 file of this user."""
    ensure_private_dir(os.path.dirname(path) or ".")
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    except FileExistsError:
        pass
    else:
        with os.fdopen(fd, "w") as f:
            f.write(secrets.token_hex(32) + "\n")
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid() or stat.S_IMODE(st.st_mode) & 0o077:
            raise UnsafePath(f"auth token file {path} must be a regular file of this user with mode 0600")
        token = f.read(4096).strip()
    if len(token) < 32:
        raise UnsafePath(f"auth token file {path} holds fewer than 32 characters")
    return token


def open_private_dir(d: str, what: str) -> int:
    """A descriptor (O_DIRECTORY) of the directory ``d``, made 0700 if missing, for files the daemon
    keeps there (the disk tier): refused (UnsafePath) unless this user or root owns it and no one else
    can write it, and when ``d`` itself is a symlink. The caller opens everything under the descriptor
    (``dir_fd``, O_NOFOLLOW), so a directory renamed or replaced after this check is never followed.
    ``what`` names the directory in the error (e.g. "--disk-path")."""
    os.makedirs(d, mode=0o700, exist_ok=True)
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        if os.path.islink(d):
            raise UnsafePath(f"{what} {d} is a symlink: name the directory itself") from None
        raise e
    st = os.fstat(fd)
    mode = stat.S_IMODE(st.st_mode)
    why = ""
    if not _trusted(st.st_uid):
        why = (f"{what} {d} belongs to uid {st.st_uid}, not to this user ({os.getuid()}): another user could "
               "plant or read what the daemon keeps there")
    elif mode & 0o022:
        why = f"{what} {d} is writable by other users (mode {mode:o}); " + shared_dir_advice(d, st, what, [])
    if why:
        os.close(fd)
        raise UnsafePath(why)
    return fd
