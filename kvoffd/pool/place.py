"""Where the pool lives when --pool-path is not given: a directory of the daemon's own under /dev/shm,
named at random, that no other user can take (kvoffd/pool/format.py ``default_pool_path`` says where
and why; this module makes it).

Why a random name: /dev/shm is writable by every local user, so any name the daemon could work out
in advance another user can create first, and a name taken that way would keep the pool in private
memory at every start (one WARNING, no warm restart, ever; docs/security.md). So the daemon
finds its directory again by owner and mode (a directory of this user that no one else can write,
whose name starts with ``kvoffd-<uid>-<address hash>-``), and makes one with ``mkdtemp`` when there is
none. Another user can still create names with that beginning; they are never used, and each is
named in a WARNING. /dev/shm is sticky, so nobody else can rename or remove the daemon's directory.
"""

from __future__ import annotations

import fcntl
import logging
import os
import re
import stat
import tempfile

from kvoffd.pool.format import (
    POOL_NAME,
    SHM_DIR,
    newest_pool_dir,
    pool_beside_socket,
    pool_socket_dir,
    shm_pool_places,
    shm_pool_prefix,
)
from kvoffd.pool.reap import ADDRESS_FILE, record_address
from kvoffd.runtime import ensure_private_dir

log = logging.getLogger(__name__)


def ensure_default_pool_path(address: str) -> str:
    """The default pool file's path for the daemon of ``address``, its directory made if needed. The
    daemon's private directory (the socket's) is checked first (UnsafePath, as at bind) and locked
    meanwhile, so two daemons starting at one address settle on one directory."""
    sock_dir = pool_socket_dir(address)
    ensure_private_dir(sock_dir)
    beside = pool_beside_socket(address)
    if beside:
        return beside
    fd = os.open(sock_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return _shm_pool_path(address)
    finally:
        os.close(fd)


def _shm_pool_path(address: str) -> str:
    places = shm_pool_places(address)
    while places.ours:
        d = newest_pool_dir(places.ours)
        if _still_there(d):
            break
        places = shm_pool_places(address)  # removed meanwhile (kvoffd purge): look again
    if places.ours:
        for other in places.ours:
            if other != d:
                _remove_if_unused(other)
        if stat.S_IMODE(os.lstat(d).st_mode) != 0o700:
            os.chmod(d, 0o700)  # ours, and others may not even look
    else:
        d = tempfile.mkdtemp(prefix=shm_pool_prefix(address) + "-", dir=SHM_DIR)
        log.info("the pool's directory is %s, made now: this user's alone, and named at random so that no "
                 "other user can take its place", d)
        if places.legacy:
            _move_legacy_pool(places.legacy, d)
    record_address(d, address)  # whose pool it is: what a start of another daemon of this user reads
    for path, uid in places.foreign:
        who = f"made by uid {uid}, not by this user" if uid != os.getuid() else "writable by other users"
        log.warning("%s is %s: never used for the pool, which lives in %s (another user may be trying to "
                    "take its place; remove it)", path, who, d)
    return os.path.join(d, POOL_NAME)


def _still_there(d: str) -> bool:
    """Whether the pool directory ``d`` is still there, waiting while a removal holds its lock
    (kvoffd/pool/reap.py): a daemon never opens a pool being removed."""
    try:
        fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        return os.path.isdir(d)
    finally:
        os.close(fd)


def _remove_if_unused(d: str) -> None:
    """An older pool directory of this daemon's (two starts at once, before the lock above existed,
    or a directory an operator copied): its files are RAM, so they go unless a daemon holds its pool."""
    fd = -1
    try:
        try:
            fd = os.open(os.path.join(d, POOL_NAME), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except FileNotFoundError:
            pass
        for name in os.listdir(d):
            if name in (POOL_NAME, ADDRESS_FILE) or name.startswith(POOL_NAME + "."):
                os.unlink(os.path.join(d, name))
        os.rmdir(d)
        log.info("removed %s: an older pool directory of this daemon that no daemon used", d)
    except BlockingIOError:
        log.warning("%s holds a pool in use by another daemon of this address's names; left alone", d)
    except OSError as e:
        log.warning("cannot remove the unused pool directory %s: %s", d, e)
    finally:
        if fd >= 0:
            os.close(fd)


def _move_legacy_pool(legacy: str, d: str) -> None:
    """The pool kept at the old default name moves into the new directory (a rename: its blocks stay
    warm), unless a daemon still holds it."""
    try:
        fd = os.open(legacy, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        os.rename(legacy, os.path.join(d, POOL_NAME))
        base = os.path.basename(legacy)
        seg = re.compile(re.escape(base) + r"\.(?:ino\d+\.)?\d{4}")  # its segments, by either naming
        with os.scandir(os.path.dirname(legacy)) as entries:
            for e in entries:
                if (seg.fullmatch(e.name) and e.is_file(follow_symlinks=False)
                        and e.stat(follow_symlinks=False).st_uid == os.getuid()):
                    os.rename(e.path, os.path.join(d, POOL_NAME + e.name[len(base):]))
        log.info("moved the pool kept at %s into %s", legacy, d)
    except BlockingIOError:
        log.warning("%s is in use by another daemon: left there", legacy)
    except OSError as e:
        log.warning("cannot move the pool kept at %s into %s: %s", legacy, d, e)
    finally:
        os.close(fd)
