"""The disk tier against what its directory and file system can do to it (issue 28, items 4, 5, 8, 9 and
13), through real daemons: a full file system (a real small tmpfs, mounted here), an index truncated
under the daemon, damaged or malformed files at start, a directory another user controls (uid 65534),
planted symlinks, corrupt adopted pool blocks on their way to the disk, and a tier that raises inside
an eviction. What must hold: the daemon never dies and never serves a wrong byte, a bad file costs the
blocks it describes (a colder tier, one log line) and never the start, and every STORE is answered.

Tests that mount a file system or play another user need root; they skip cleanly without it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess

import numpy as np
import pytest
from disktier import LRU, POOL, SLOT, Rig, disk_flags, fill_and_spill
from kvtest import chain_keys, start_daemon, wait_until
from pools import flip_block

ROOT_ONLY = pytest.mark.skipif(os.getuid() != 0, reason="mounts a file system / plays another user (needs root)")


def _log(d) -> str:
    with open(d.log_path) as f:
        return f.read()


def _alive_and_serving(rig: Rig, salt: bytes) -> None:
    """The daemon still runs and the pool still serves a fresh chain byte-exact."""
    assert rig.d.proc.poll() is None, f"the daemon died (exit {rig.d.proc.returncode}):\n{rig.d.log()}"
    keys = chain_keys(20, salt)
    rig.store(keys, base=400)
    hits, notice = rig.lookup_load(keys, 450)
    assert hits == 20 and notice.ok and rig.exact(keys, 450, notice) == 20


@contextlib.contextmanager
def _mounted(path, fs: str, size: str):
    """A real small file system at ``path``: a tmpfs of ``size``, or an ext4 image of ``size`` on a loop
    device (blocks allocated on write, as on a disk); unmounted (lazily, if a daemon still holds it) on
    the way out, the image removed."""
    path.mkdir(mode=0o700)
    image = path.parent / (path.name + ".img")
    if fs == "tmpfs":
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size},mode=0700", "tmpfs", str(path)], check=True)
    else:
        subprocess.run(["truncate", "-s", size, str(image)], check=True)
        subprocess.run(["mkfs.ext4", "-q", "-F", "-m", "0", str(image)], check=True)
        subprocess.run(["mount", "-o", "loop", str(image), str(path)], check=True)
    try:
        yield path
    finally:
        if subprocess.run(["umount", str(path)], capture_output=True).returncode:
            subprocess.run(["umount", "-l", str(path)], check=False)
        with contextlib.suppress(FileNotFoundError):
            image.unlink()


def _fill_up(path) -> None:
    """Take every free block of the file system under ``path`` (a file written until ENOSPC)."""
    with open(path / "filler", "wb") as f, contextlib.suppress(OSError):
        while True:
            f.write(b"\xee" * (1 << 16))
            f.flush()


# --- item 4: a full or truncated file system ------------------------------------------------------------
@ROOT_ONLY
def test_a_full_file_system_drops_spills_and_never_kills_the_daemon(tmp_path):
    """On ext4 (a loop image: blocks are allocated when written, as on the NVMe), the index of 16,384 slots
    (1.2 MB) is made while there is room; then the file system is filled to the last block. The next
    daemon's spills reuse the first one's data slots (allocated already, so the data writes land) and
    insert records all over the index: in its sparse shared mapping each first store into a page was a
    SIGBUS on the full file system. Now the daemon serves on, drops what does not fit (counted), reuses
    the slots already on disk once it found the disk full, and a restart finds the tier again."""
    with _mounted(tmp_path / "mnt", "ext4", "32M") as mnt:
        args = ("--disk-path", str(mnt / "disk"), "--disk-size", "1GiB", *LRU)
        d = start_daemon(f"ipc://{tmp_path}/a.sock", POOL, *args)
        try:
            rig = Rig(d)
            fill_and_spill(rig, n_old=40, rounds=2)  # ~100 blocks spilled: 7 MB of the 26 MB
            rig.close()
        finally:
            d.stop()
        _fill_up(mnt)
        d = start_daemon(f"ipc://{tmp_path}/b.sock", POOL, *args)
        try:
            rig = Rig(d)
            # evictions: the first spills go to free slots, holes the full disk has no room for (ENOSPC,
            # dropped); from then on the tier reuses slots already on disk and spills land. Each round's
            # spills land before the next round is stored, so the order is the same on any machine.
            for r in range(8):
                rig.store(chain_keys(100, b"full%d" % r), base=100)
                assert wait_until(lambda: rig.tier()["spills_in_flight"] == 0, 30), rig.tier()
                if rig.tier()["spills"] >= 50:
                    break
            assert rig.tier()["spills"] >= 50, rig.tier()
            assert wait_until(lambda: rig.tier()["spills_dropped"].get("full", 0) > 0, 30), rig.tier()
            _alive_and_serving(rig, b"full-after")
            hits, notice = rig.lookup_load(chain_keys(100, b"full0"), 200)  # from the disk: exact or failed
            if hits:
                rig.exact(chain_keys(100, b"full0")[:hits], 200, notice)
            rig.close()
        finally:
            d.stop()
        d = start_daemon(f"ipc://{tmp_path}/c.sock", POOL, *args)  # and again: it starts and serves
        try:
            rig = Rig(d)
            assert rig.tier()["resident_blocks"] > 0, rig.tier()
            _alive_and_serving(rig, b"full-restart")
            rig.close()
        finally:
            d.stop()


@ROOT_ONLY
def test_an_index_that_cannot_be_reserved_refuses_its_block_size_with_one_line(tmp_path):
    """The index of 1 GiB of 64 KiB slots needs 1.2 MB; the file system has 1 MB: the block size is refused
    at once with one clear line (no sparse file to fault on later), and the pool serves."""
    with _mounted(tmp_path / "mnt", "tmpfs", "1m") as mnt:
        d = start_daemon(f"ipc://{tmp_path}/a.sock", POOL, "--disk-path", str(mnt / "disk"), "--disk-size", "1GiB",
                         *LRU)
        try:
            rig = Rig(d)
            for r in range(3):
                rig.store(chain_keys(100, b"nospace%d" % r), base=100)
            assert wait_until(lambda: f"broken_{SLOT}" in rig.tier()["notes"], 10), rig.tier()
            assert "cannot reserve" in rig.tier()["notes"][f"broken_{SLOT}"]
            assert _log(d).count("cannot reserve") == 1, _log(d)
            assert not os.path.exists(mnt / "disk" / f"index-{SLOT}.kvx")
            _alive_and_serving(rig, b"nospace-after")
            rig.close()
        finally:
            d.stop()


def test_truncating_the_index_under_the_daemon_costs_nothing(tmp_path):
    """The index file truncated to nothing while the daemon runs (the old shared mapping: SIGBUS at the
    next LOOKUP). The daemon goes on serving from memory, byte-exact; at its next write it finds the file
    short and writes it whole again (one line), so a restart finds every block."""
    args = disk_flags(tmp_path)
    d = start_daemon(f"ipc://{tmp_path}/a.sock", POOL, *args)
    index = tmp_path / "disk" / f"index-{SLOT}.kvx"
    try:
        rig = Rig(d)
        old = fill_and_spill(rig)
        size = os.path.getsize(index)
        os.truncate(index, 0)
        hits, notice = rig.lookup_load(old, 200)  # the records are in memory: served, and exact
        assert hits == len(old) and notice.ok and rig.exact(old, 200, notice) == len(old)
        newer = chain_keys(100, b"after-trunc")
        rig.store(newer, base=100)  # more evictions: the index is written again
        assert wait_until(lambda: os.path.getsize(index) == size, 10), os.path.getsize(index)
        # the writer thread logs once it has written the file whole again: the line may follow the size
        assert wait_until(lambda: "was truncated under the daemon" in _log(d), 10), _log(d)
        assert _log(d).count("was truncated under the daemon") == 1, _log(d)
        _alive_and_serving(rig, b"trunc")
        rig.close()
    finally:
        d.stop()
    d = start_daemon(f"ipc://{tmp_path}/b.sock", POOL, *args)
    try:
        rig = Rig(d)
        assert "started over" not in _log(d), _log(d)
        hits, notice = rig.lookup_load(old, 200)
        assert hits == len(old) and notice.ok and rig.exact(old, 200, notice) == len(old)
        rig.close()
    finally:
        d.stop()


@pytest.mark.parametrize("damage", ["garbage", "short", "header"])
def test_a_damaged_index_at_start_is_a_cold_tier_and_one_line(tmp_path, damage):
    args = disk_flags(tmp_path)
    d = start_daemon(f"ipc://{tmp_path}/a.sock", POOL, *args)
    try:
        rig = Rig(d)
        fill_and_spill(rig)
        rig.close()
    finally:
        d.stop()
    index = tmp_path / "disk" / f"index-{SLOT}.kvx"
    with open(index, "r+b") as f:
        if damage == "garbage":
            f.write(os.urandom(4096))
        elif damage == "short":
            f.truncate(os.path.getsize(index) // 2)
        else:  # a header that claims another capacity than the file's size holds
            f.seek(8)
            f.write((12345).to_bytes(8, "little"))
    d = start_daemon(f"ipc://{tmp_path}/b.sock", POOL, *args)
    try:
        rig = Rig(d)
        assert _log(d).count("started over") == 1, _log(d)
        assert rig.tier()["resident_blocks"] == 0 and f"broken_{SLOT}" not in rig.tier()["notes"], rig.tier()
        assert rig.c.lookup("disk", chain_keys(100, b"old")).hits == 0
        fill_and_spill(rig)  # the block size works: spills land and come back exact
        hits, notice = rig.lookup_load(chain_keys(100, b"old"), 200)
        assert hits == 100 and notice.ok and rig.exact(chain_keys(100, b"old"), 200, notice) == 100
        rig.close()
    finally:
        d.stop()


# --- item 9: malformed files stop nothing ---------------------------------------------------------------
_GOOD_ROW = {"tid": 1, "namespace": "disk", "rank": 0, "world_size": 1, "layout": [SLOT // 2, SLOT // 2]}
_BAD_TABLES = {
    "not_an_object": [],
    "tables_not_a_list": {"tables": 5},
    "row_not_an_object": {"tables": [1]},
    "row_missing_fields": {"tables": [{"tid": 1}]},
    "tid_not_an_int": {"tables": [dict(_GOOD_ROW, tid="x")]},
    "tid_past_32_bits": {"tables": [dict(_GOOD_ROW, tid=2**32)]},
    "layout_not_a_list": {"tables": [dict(_GOOD_ROW, layout=5)]},
    "rank_past_world": {"tables": [dict(_GOOD_ROW, rank=3)]},
    "tid_twice": {"tables": [_GOOD_ROW, dict(_GOOD_ROW, namespace="other")]},
}


@pytest.mark.parametrize("doc", list(_BAD_TABLES), ids=list(_BAD_TABLES))
def test_a_malformed_tables_json_is_logged_and_its_blocks_skipped(make_daemon, tmp_path, doc):
    (tmp_path / "disk").mkdir(mode=0o700)
    (tmp_path / "disk" / "tables.json").write_text(json.dumps(_BAD_TABLES[doc]))
    d = make_daemon(POOL, *disk_flags(tmp_path))
    rig = Rig(d)
    assert not any(t.get("disabled") for t in rig.c.stats()["tiers"]), rig.c.stats()["tiers"]
    assert _log(d).count("tables.json") >= 1 and "Traceback" not in _log(d), _log(d)
    old = fill_and_spill(rig)  # the tier works: spills land and come back exact
    hits, notice = rig.lookup_load(old, 200)
    assert hits == len(old) and notice.ok and rig.exact(old, 200, notice) == len(old)
    saved = json.loads((tmp_path / "disk" / "tables.json").read_text())["tables"]
    assert any(r["namespace"] == "disk" for r in saved)
    rig.close()


@pytest.mark.parametrize("old", ["garbage", "empty", "directory"])
def test_a_bogus_old_index_never_disables_its_block_size(make_daemon, tmp_path, old):
    """``index-<size>.kvx.old`` is what a daemon killed while importing an index of another capacity leaves;
    one that is not a table is removed with one line, and the block size works."""
    (tmp_path / "disk").mkdir(mode=0o700)
    bogus = tmp_path / "disk" / f"index-{SLOT}.kvx.old"
    if old == "directory":
        bogus.mkdir()
    else:
        bogus.write_bytes(os.urandom(1000) if old == "garbage" else b"")
    (tmp_path / "disk" / "index-0.kvx").write_bytes(b"")  # and a name no block size has (was a ZeroDivisionError)
    d = make_daemon(POOL, *disk_flags(tmp_path))
    rig = Rig(d)
    old_keys = fill_and_spill(rig)
    assert f"broken_{SLOT}" not in rig.tier()["notes"], rig.tier()
    hits, notice = rig.lookup_load(old_keys, 200)
    assert hits == len(old_keys) and notice.ok and rig.exact(old_keys, 200, notice) == len(old_keys)
    if old != "directory":
        assert not bogus.exists()
    assert "Traceback" not in _log(d), _log(d)
    rig.close()


# --- item 5: the directory and its files ----------------------------------------------------------------
def _plant(tmp_path, keys: list[bytes]) -> str:
    """A disk tier directory holding the blocks of ``keys`` with an attacker's bytes (0x66), consistent
    (index, tables, checksums): what a user who controls the directory can leave there."""
    d = start_daemon(f"ipc://{tmp_path}/plant.sock", POOL, *disk_flags(tmp_path))
    try:
        rig = Rig(d)
        rig.eng.poison(range(len(keys)), 0x66)
        rig.job += 1
        rig.c.submit_store("disk-0", rig.job, keys, range(len(keys)))
        assert rig.c.wait_notices({rig.job}, 30)[0].ok
        for r in range(3):
            rig.store(chain_keys(100, b"push%d" % r), base=100)
        assert wait_until(lambda: rig.tier()["spills"] >= len(keys), 30), rig.tier()
        rig.close()
    finally:
        d.stop()
    return str(tmp_path / "disk")


@ROOT_ONLY
@pytest.mark.parametrize("how", ["owned_by_another_user", "writable_by_others", "a_symlink"])
def test_a_disk_path_another_user_controls_is_refused(tmp_path, how):
    """Blocks planted under the victim's keys, in a directory uid 65534 owns (or any user can write, or
    reached through a symlink): before, LOOKUP hit them and LOAD put the attacker's bytes in the engine.
    Now the tier is disabled with the reason, the daemon serves from the pool, and nothing is read."""
    victim = chain_keys(50, b"victim")
    planted = _plant(tmp_path, victim)
    path = planted
    if how == "owned_by_another_user":
        subprocess.run(["chown", "-R", "65534:65534", planted], check=True)
        os.chmod(planted, 0o755)
    elif how == "writable_by_others":
        os.chmod(planted, 0o777)
    else:
        path = str(tmp_path / "link")
        os.symlink(planted, path)
    before = sorted(os.listdir(planted))
    d = start_daemon(f"ipc://{tmp_path}/victim.sock", POOL, "--disk-path", path, "--disk-size", "64MiB", *LRU)
    try:
        rig = Rig(d)
        disabled = [t.get("disabled") for t in rig.c.stats()["tiers"] if t.get("disabled")]
        assert disabled, rig.c.stats()["tiers"]
        word = {"owned_by_another_user": "belongs to uid 65534", "writable_by_others": "writable by other users",
                "a_symlink": "is a symlink"}[how]
        assert word in disabled[0], disabled
        assert rig.c.lookup("disk", victim).hits == 0
        _alive_and_serving(rig, b"victim-pool")
        rig.close()
    finally:
        d.stop()
    assert sorted(os.listdir(planted)) == before  # nothing made or changed there


def test_symlinks_in_the_directory_are_never_followed_and_files_are_private(tmp_path):
    """Temporary names that are symlinks to files elsewhere (tables.json.tmp, the index's .tmp): the
    daemon replaces them, never writes through them; then a data file that is a symlink: that block size
    is refused with its reason, the file it points to untouched. Every file the tier makes is 0600."""
    disk = tmp_path / "disk"
    disk.mkdir(mode=0o700)
    victims = {}
    for name in ("tables.json.tmp", f"index-{SLOT}.kvx.tmp"):
        v = tmp_path / f"victim-{name}"
        v.write_bytes(b"precious " + name.encode())
        os.symlink(v, disk / name)
        victims[v] = v.read_bytes()
    d = start_daemon(f"ipc://{tmp_path}/a.sock", POOL, *disk_flags(tmp_path))
    try:
        rig = Rig(d)
        fill_and_spill(rig)
        rig.close()
    finally:
        d.stop()
    for v, data in victims.items():
        assert v.read_bytes() == data, f"{v} was written through a symlink"
    for name in os.listdir(disk):
        mode = os.lstat(disk / name).st_mode & 0o777
        assert mode == 0o600, f"{name} has mode {mode:o}"
    # a data file that is a symlink: refused, never followed
    data = disk / f"blocks-{SLOT}.dat"
    target = tmp_path / "victim-blocks"
    shutil.move(data, target)
    os.symlink(target, data)
    target.chmod(0o600)
    before = target.read_bytes()
    d = start_daemon(f"ipc://{tmp_path}/b.sock", POOL, *disk_flags(tmp_path))
    try:
        rig = Rig(d)
        for r in range(3):
            rig.store(chain_keys(100, b"link%d" % r), base=100)
        assert f"broken_{SLOT}" in rig.tier()["notes"], rig.tier()
        _alive_and_serving(rig, b"link-after")
        rig.close()
    finally:
        d.stop()
    assert target.read_bytes() == before


# --- item 8: adopted blocks that fail their checksum never reach the disk -------------------------------
def test_corrupt_adopted_blocks_are_not_laundered_through_the_disk(tmp_path, pool_path, monkeypatch):
    """A warm restart adopts 60 blocks whose bytes were flipped in the pool file; the background check is
    held back (KVOFFD_TEST_NO_VERIFY_PASS, as on a big host where it takes seconds), and new stores evict
    them to the disk. Before, the disk gave them a fresh checksum of its own and served them (LOAD ok,
    flipped bytes in the engine). Now each is checked against its adopted checksum as it is spilled: not
    kept (counted ``corrupt``), a miss; the intact ones among them are spilled and come back exact."""
    args = ("--pool-path", pool_path, *disk_flags(tmp_path))
    d = start_daemon(f"ipc://{tmp_path}/a.sock", POOL, *args)
    keys = chain_keys(64, b"adopted")
    try:
        rig = Rig(d)
        rig.store(keys)
        slots = [int(e["slots"]["0"]) for e in rig.c.explain("disk", keys)]
        assert wait_until(lambda: rig.c.stats()["persistence"]["sealed_blocks"] >= len(keys), 10)
        rig.close()
    finally:
        assert d.stop() == 0
    for s in slots[:60]:
        flip_block(pool_path, POOL, s)
    monkeypatch.setenv("KVOFFD_TEST_NO_VERIFY_PASS", "1")
    d = start_daemon(f"ipc://{tmp_path}/b.sock", POOL, *args)
    try:
        rig = Rig(d)
        assert wait_until(lambda: rig.c.stats()["persistence"]["adopted_blocks"] == len(keys), 10)
        for r in range(3):  # evict every adopted block from the pool
            rig.store(chain_keys(100, b"evict%d" % r), base=100)
        t = lambda: rig.tier()  # noqa: E731
        assert wait_until(lambda: t()["spills_dropped"].get("corrupt", 0) + t()["spills"] >= len(keys), 30), t()
        assert rig.c.explain("disk", keys[:1])[0]["state"] != "resident"
        for i in range(0, len(keys), 8):  # from each eighth block on: misses, or their own bytes
            hits, notice = rig.lookup_load(keys[i:], 200)
            if hits:
                assert rig.exact(keys[i:i + hits], 200, notice) == hits
        assert t()["spills_dropped"].get("corrupt", 0) == 60, t()
        hits, notice = rig.lookup_load(keys[60:], 200)  # the intact ones came through the disk
        assert hits == 4 and notice.ok and rig.exact(keys[60:], 200, notice) == 4
        rig.close()
    finally:
        d.stop()


# --- item 13: every STORE is answered, whatever fails inside --------------------------------------------
def test_every_store_gets_its_notice_when_the_tier_fails_inside(tmp_path):
    """A tables.json of the right shape whose table id does not fit the index's 32 bits: before, the first
    eviction raised inside the STORE's planning (the tier opened its index then), the daemon answered an
    ``internal`` ERROR without the job id, and that STORE and every later one that evicted waited for a
    notice for ever (and their slots were lost). Now every STORE gets its notice, the eviction stays
    whole, and the pool serves."""
    (tmp_path / "disk").mkdir(mode=0o700)
    row = dict(_GOOD_ROW, tid=2**32, namespace="zz")
    (tmp_path / "disk" / "tables.json").write_text(json.dumps({"tables": [row]}))
    d = start_daemon(f"ipc://{tmp_path}/a.sock", POOL, *disk_flags(tmp_path))
    try:
        rig = Rig(d)
        for r in range(5):
            keys = chain_keys(100, b"ans%d" % r)
            rig.eng.fill(range(100), keys)
            rig.job += 1
            rig.c.submit_store("disk-0", rig.job, keys, range(100))
            n = rig.c.wait_notices({rig.job}, 15)
            assert n, f"STORE {rig.job} got no notice:\n{d.log()}"
            assert n[0].ok, n  # the pool had the room: the evictions went through
        assert rig.c.lookup("disk", keys).hits == 100
        _alive_and_serving(rig, b"ans-after")
        rig.close()
    finally:
        d.stop()


def _records_in_file(path) -> int:
    """Live records in an index file, read as the next daemon would."""
    from kvoffd.cache.tiers.indexfile import HEADER, RECORD

    with open(path, "rb") as f:
        f.seek(HEADER)
        recs = np.frombuffer(f.read(), dtype=RECORD)
    return int((recs["tid"] != 0).sum())


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGKILL], ids=["sigterm", "sigkill"])
def test_the_index_file_catches_up_and_survives_a_stop_or_a_kill(tmp_path, sig):
    """The index is written behind the spills by its own thread, as soon as told: once the file holds
    what the tier holds (the gate: read from the file itself), a SIGKILL loses none of it; a SIGTERM
    writes what is pending before the daemon exits."""
    args = disk_flags(tmp_path)
    index = tmp_path / "disk" / f"index-{SLOT}.kvx"
    d = start_daemon(f"ipc://{tmp_path}/a.sock", POOL, *args)
    try:
        rig = Rig(d)
        old = fill_and_spill(rig)
        if sig == signal.SIGKILL:
            assert wait_until(lambda: rig.tier()["spills_in_flight"] == 0, 10), rig.tier()
            held = rig.tier()["resident_blocks"]
            assert wait_until(lambda: _records_in_file(index) == held, 10), (_records_in_file(index), held)
        rig.close()
    finally:
        d.stop(sig)
    d = start_daemon(f"ipc://{tmp_path}/b.sock", POOL, *args)
    try:
        rig = Rig(d)
        hits, notice = rig.lookup_load(old, 200)
        assert hits == len(old) and notice.ok and rig.exact(old, 200, notice) == len(old), rig.tier()
        rig.close()
    finally:
        d.stop()
