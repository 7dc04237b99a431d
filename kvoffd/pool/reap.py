"""Giving a pool's memory back: at each start the daemon removes this user's pools that no daemon can
come back for (``reap_stale``), and ``kvoffd purge`` (kvoffd/purge.py) removes the ones an operator
names (``remove_pool``).

Why: a pool's files are on tmpfs, RAM until someone removes them, and that is the warm-restart
promise: a daemon that stops leaves its pool for the next daemon of its address. But a daemon whose
address will never be served again (a test's, a bench's or a script's socket in a temporary directory
that is gone) leaves RAM that nobody gets back: a test run and a few scripted checks would hold
gigabytes of /dev/shm (docs/operations.md says how to give a pool back).

What decides, from evidence only, never from age:

- the lock: a pool whose metadata file a process holds (flock) is a live daemon's, never touched;
  a removal takes that lock itself (non-blocking) and keeps it while it unlinks;
- the address: each pool directory in /dev/shm records the address of the daemon it is for (the file
  ``address``, written by kvoffd/pool/place.py), and the directory's name carries that
  address's hash, which must match. No record (a directory an older kvoffd made, a file at the old
  name ``kvoffd-<uid>-<hash>.pool``): kvoffd cannot tell whose it is, so a start keeps it and says
  so; only ``kvoffd purge --all`` removes it;
- the socket directory: an ipc:// daemon comes back only through its socket's directory. Gone means
  whoever made it (pytest's tmp_path, a bench's mkdtemp, a script) is done with that address; except
  a directory a service manager removes while its daemon is stopped and makes again at its start:
  anything under /run (systemd's RuntimeDirectory= is removed at ``systemctl stop``, logind's
  /run/user/<uid> at logout) and the default one, /tmp/kvoffd-<uid>, which are kept. A tcp:// daemon
  may come back on its port at any time: kept.

A daemon choosing its pool directory locks that directory (pool_place.py), and a removal locks it
first too, then looks at the socket directory again: a daemon starting at that address meanwhile has
made its socket directory before it looks for its pool, so it either sees the pool kept or finds the
directory gone and makes a new one; it never opens a pool being removed.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import logging
import os
import re
import stat
from collections.abc import Callable
from dataclasses import dataclass

from kvoffd.pool.format import HEADER_BYTES, MAGIC, POOL_NAME, SHM_DIR, shm_pool_prefix
from kvoffd.units import format_size

log = logging.getLogger(__name__)

ADDRESS_FILE = "address"  # in a pool directory: the address of the daemon the pool is for
_NAME_DIR = re.compile(r"kvoffd-(\d+)-([0-9a-f]{12})-.+")  # kvoffd-<uid>-<address hash>-<random>
_NAME_LEGACY = re.compile(r"kvoffd-(\d+)-([0-9a-f]{12})\.pool")  # the pool file's name before its directory


class PoolHeld(RuntimeError):
    """A running daemon holds the pool (the lock of its metadata file): nothing was removed."""


@dataclass(frozen=True)
class ShmPool:
    """One pool of this user in /dev/shm: ``path`` its metadata file (which may be missing: a
    directory a failed start left), ``directory`` its own directory ("" for a file at the old name,
    at the top of /dev/shm), ``address`` the address it is for ("" when not recorded), ``nbytes`` the
    memory its files hold."""

    path: str
    directory: str
    address: str
    nbytes: int


def address_hash(address: str) -> str:
    return hashlib.sha256(address.encode()).hexdigest()[:12]


def record_address(d: str, address: str) -> None:
    """Write ``address`` into the pool directory ``d`` (0600, replaced whole), unless it is there."""
    path = os.path.join(d, ADDRESS_FILE)
    if _read_small(path) == address:
        return
    tmp = path + ".tmp"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, address.encode() + b"\n")
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as e:
        log.warning("cannot record the address in %s (%s): a start of another daemon of this user cannot "
                    "tell whose pool it is, and keeps it", d, e.strerror)


def recorded_address(d: str) -> str:
    """The address the pool directory ``d`` records, if its name's hash is that address's ("" else)."""
    m = _NAME_DIR.fullmatch(os.path.basename(d))
    address = _read_small(os.path.join(d, ADDRESS_FILE))
    return address if m and address and address_hash(address) == m.group(2) else ""


def _read_small(path: str) -> str:
    """The text of a small regular file of this user ("" when missing, or anything else)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return ""
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return ""
        return os.read(fd, 4096).decode(errors="replace").strip()
    except OSError:
        return ""
    finally:
        os.close(fd)


def stale_reason(address: str) -> str:
    """Why no daemon can come back for the pool of ``address`` ("" when one may)."""
    if not address.startswith("ipc://"):
        return ""  # tcp://: a daemon may come back on its port at any time
    d = os.path.dirname(address[6:])
    if not os.path.isabs(d) or os.path.lexists(d) or restored_at_start(d):
        return ""
    return f"its socket directory {d} is gone"


def restored_at_start(d: str) -> bool:
    """Whether a service manager removes the socket directory ``d`` while its daemon is stopped and
    makes it again at its start (so that its absence says nothing): under /run, or the default
    directory (the runtime directory's kvoffd, /tmp/kvoffd-<uid>)."""
    d = os.path.normpath(d)
    if d.startswith(("/run/", "/var/run/")):
        return True
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    return d == f"/tmp/kvoffd-{os.getuid()}" or bool(xdg) and d == os.path.join(os.path.normpath(xdg), "kvoffd")


def shm_pools() -> list[ShmPool]:
    """Every pool of this user in /dev/shm: its directories ``kvoffd-<uid>-<hash>-*`` that no one else
    can write, and its files at the old name ``kvoffd-<uid>-<hash>.pool``."""
    uid = os.getuid()
    out: list[ShmPool] = []
    try:
        entries = list(os.scandir(SHM_DIR))
    except OSError:
        return out
    for e in entries:
        m = _NAME_DIR.fullmatch(e.name) or _NAME_LEGACY.fullmatch(e.name)
        if m is None or int(m.group(1)) != uid:
            continue
        try:
            st = e.stat(follow_symlinks=False)
        except OSError:
            continue
        if st.st_uid != uid:
            continue
        if m.re is _NAME_DIR and stat.S_ISDIR(st.st_mode) and not st.st_mode & 0o022:
            out.append(ShmPool(os.path.join(e.path, POOL_NAME), e.path, recorded_address(e.path), _dir_bytes(e.path)))
        elif m.re is _NAME_LEGACY and stat.S_ISREG(st.st_mode):
            out.append(ShmPool(e.path, "", "", sum(_blocks(p) for p in [e.path, *_segments(e.path)])))
    return sorted(out, key=lambda p: p.path)


def pools_of(address: str) -> list[ShmPool]:
    """This user's pools in /dev/shm that are the daemon of ``address``'s (by their names' hash)."""
    prefix = shm_pool_prefix(address)
    return [p for p in shm_pools()
            if os.path.basename(p.directory or p.path).startswith((prefix + "-", prefix + "."))]


def _blocks(path: str) -> int:
    try:
        return os.lstat(path).st_blocks * 512
    except OSError:
        return 0


def _dir_bytes(d: str) -> int:
    try:
        with os.scandir(d) as entries:
            return sum(e.stat(follow_symlinks=False).st_blocks * 512 for e in entries)
    except OSError:
        return 0


def _segments(path: str) -> list[str]:
    """The data segment files beside the metadata file ``path``, by either naming (pool_format.py)."""
    d, base = os.path.split(path)
    name = re.compile(re.escape(base) + r"\.(?:ino\d+\.)?\d{4}")
    try:
        with os.scandir(d or ".") as entries:
            return [e.path for e in entries if name.fullmatch(e.name)]
    except OSError:
        return []


def held_by(path: str) -> int:
    """The pid holding a lock on the file ``path`` per /proc/locks (0: none seen). Only looks: taking
    the lock to find out, even for an instant, could make a daemon starting on that pool find it
    taken. /proc/locks shows the locks of this pid namespace; a removal takes the lock itself."""
    try:
        st = os.lstat(path)
        with open("/proc/locks") as f:
            lines = f.read().splitlines()
    except OSError:
        return 0
    want = f"{os.major(st.st_dev):02x}:{os.minor(st.st_dev):02x}:{st.st_ino}"
    for line in lines:
        parts = line.split()
        if len(parts) >= 6 and parts[1] == "FLOCK" and parts[5] == want:
            try:
                return int(parts[4])
            except ValueError:
                return -1
    return 0


def is_pool_file(path: str) -> bool:
    """Whether ``path`` is a kvoffd pool's metadata file (its magic), or an empty file (one a start
    made and gave back): what ``kvoffd purge --pool-path`` may remove."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError:
        return False
    try:
        st = os.fstat(fd)
        return stat.S_ISREG(st.st_mode) and (st.st_size == 0 or os.pread(fd, HEADER_BYTES, 0)[:len(MAGIC)] == MAGIC)
    except OSError:
        return False
    finally:
        os.close(fd)


def remove_pool(pool: ShmPool, still: Callable[[], bool] | None = None) -> int | None:
    """Remove ``pool``'s files, and its directory, unless a daemon holds it (PoolHeld, nothing
    removed). ``still()``, asked once its directory's lock is held, says whether it may still go
    (False: kept). Returns the bytes of memory given back; None when nothing was removed (kept, or
    gone already: another start removed it first)."""
    if not pool.directory:
        if still is not None and not still():
            return None
        return remove_pool_file(pool.path)
    try:
        dfd = os.open(pool.directory, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(dfd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise PoolHeld(f"{pool.directory} is being opened by a daemon starting now") from None
        st = os.fstat(dfd)
        if st.st_uid != os.getuid() or st.st_mode & 0o022:
            raise PoolHeld(f"{pool.directory} is not a directory of this user's alone")
        if still is not None and not still():
            return None
        if not os.path.lexists(pool.directory):
            return None  # removed by another start while this one waited for nothing (its lock was free)
        freed = remove_pool_file(pool.path) or 0
        return freed + _remove_dir(pool.directory)
    finally:
        os.close(dfd)


def remove_pool_file(path: str) -> int | None:
    """Remove the metadata file ``path`` and its data segments, holding the pool's lock (PoolHeld
    when a daemon holds it). Only regular files of this user; the bytes given back (None: no file)."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pid = held_by(path)
            raise PoolHeld(f"{path} is in use by a running kvoffd{f' (pid {pid})' if pid > 0 else ''}") from None
        st = os.fstat(fd)
        if st.st_uid != os.getuid() or not stat.S_ISREG(st.st_mode):
            raise PoolHeld(f"{path} is not a file of this user")
        freed = 0
        for seg in _segments(path):
            freed += _unlink_ours(seg)
        if os.lstat(path).st_ino == st.st_ino:  # still the file locked (an operator may have replaced it)
            freed += _unlink_ours(path)
        return freed
    finally:
        os.close(fd)


def _unlink_ours(path: str) -> int:
    try:
        st = os.lstat(path)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
            return 0
        os.unlink(path)
    except OSError:
        return 0
    return st.st_blocks * 512


def _remove_dir(d: str) -> int:
    """The pool directory ``d``, once its pool's files are gone: its address record, then itself (left,
    with a line, if anything else is in it)."""
    freed = sum(_unlink_ours(os.path.join(d, n)) for n in (ADDRESS_FILE, ADDRESS_FILE + ".tmp"))
    try:
        os.rmdir(d)
    except OSError as e:
        if e.errno != errno.ENOENT:
            log.warning("cannot remove the pool directory %s: %s", d, e.strerror)
    return freed


def remove_place_if_empty(d: str) -> None:
    """A default pool directory that holds no pool (a start that made it failed) goes with its record."""
    if os.path.dirname(d) != SHM_DIR or not _NAME_DIR.fullmatch(os.path.basename(d)):
        return
    try:
        names = set(os.listdir(d))
    except OSError:
        return
    if not names - {ADDRESS_FILE, ADDRESS_FILE + ".tmp"}:
        _remove_dir(d)


def reap_stale(own_address: str) -> None:
    """At a daemon's start: remove this user's pools in /dev/shm that no daemon can come back for, one
    line each, and say (one line) how much is kept that kvoffd cannot place. The pools of
    ``own_address`` are left to pool_place.py."""
    prefix = shm_pool_prefix(own_address)
    unknown: list[ShmPool] = []
    for p in shm_pools():
        if os.path.basename(p.directory or p.path).startswith((prefix + "-", prefix + ".")):
            continue
        if not p.address:
            if not held_by(p.path):
                unknown.append(p)
            continue
        why = stale_reason(p.address)
        if not why:
            continue
        try:
            freed = remove_pool(p, still=lambda a=p.address: bool(stale_reason(a)))
        except PoolHeld:
            continue
        except OSError as e:
            log.warning("cannot remove the pool in %s: %s", p.directory, e.strerror)
            continue
        if freed is not None:
            log.info("removed the pool in %s (%s of memory), the daemon of %s's: %s, so no daemon can come back "
                     "for it, and none held it", p.directory, format_size(freed), p.address, why)
    if unknown:
        log.info("%d pool%s of this user in %s (%s of memory: %s) %s no address recorded (made by an older kvoffd), so "
                 "no start removes %s; if no daemon will come back for %s, 'kvoffd purge --all' gives the memory back",
                 len(unknown), "s" if len(unknown) > 1 else "", SHM_DIR, format_size(sum(p.nbytes for p in unknown)),
                 ", ".join(p.directory or p.path for p in unknown), "have" if len(unknown) > 1 else "has",
                 "them" if len(unknown) > 1 else "it", "them" if len(unknown) > 1 else "it")
