"""Configuration: embedded defaults, overridden by KVOFFD_<NAME> environment variables, then flags.

Every value is checked at start; a bad one stops the daemon with one clear line (ConfigError).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field, fields
from enum import StrEnum
from typing import Any

from kvoffd.cache.policy import (
    DEFAULT_POLICY,
    LRU,
    POLICIES,
    DiskPolicy,
    RemotePublish,
)
from kvoffd.pool.format import pool_geometry
from kvoffd.pool.topology import NumaMapError, parse_numa_map
from kvoffd.units import format_size
from kvoffd_client.paths import default_address, default_auth_token_file, runtime_dir

_UNITS = {"": 1, "b": 1, "k": 1000, "kb": 1000, "kib": 1 << 10, "m": 1000**2, "mb": 1000**2, "mib": 1 << 20,
          "g": 1000**3, "gb": 1000**3, "gib": 1 << 30, "t": 1000**4, "tb": 1000**4, "tib": 1 << 40}
LOOPBACK = "127.0.0.1"
#: sun_path holds 108 bytes with the terminating NUL; libzmq refuses a longer ipc path at bind
MAX_IPC_PATH = 107


class ConfigError(ValueError):
    pass


def parse_size(text: str) -> int:
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", text)
    if not m or m.group(2).lower() not in _UNITS:
        raise ConfigError(f"not a size: {text!r} (use e.g. 512MiB, 64GiB, 1.5TiB)")
    n = int(float(m.group(1)) * _UNITS[m.group(2).lower()])
    if n <= 0:
        raise ConfigError(f"size must be positive: {text!r}")
    return n


def physical_ram() -> int | None:
    """Bytes of RAM in this host (None where the OS does not say)."""
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError):
        return None


def default_pool_size() -> int:
    """min(4 GiB, a quarter of RAM), in whole 64 MiB chunks (a size the pool serves exactly)."""
    n = min(4 << 30, (physical_ram() or 16 << 30) // 4)
    return max(64 << 20, n - n % (64 << 20))


#: a pool above this share of RAM starts, with a warning: the engines, vLLM and the OS need the rest
POOL_RAM_WARN_FRACTION = 0.9


def check_pool_fits(pool_size: int, ram: int | None = None) -> str:
    """Refuse a pool larger than physical RAM (it can only fail, or swap a pinned pool: one clear
    line instead of the kernel's bare "Cannot allocate memory"); above POOL_RAM_WARN_FRACTION of
    it, return a warning to log. Separate from load_config, which also validates deploy files on
    hosts smaller than the ones they are for."""
    ram = physical_ram() if ram is None else ram
    if ram and pool_size > ram:
        raise ConfigError(f"--pool-size {format_size(pool_size)} is larger than this host's RAM "
                          f"({format_size(ram)}); choose a smaller pool (kvoffd doctor --pool-size SIZE checks one)")
    if not ram:
        return ""
    if pool_size > POOL_RAM_WARN_FRACTION * ram:
        return (f"--pool-size {format_size(pool_size)} is {100 * pool_size / ram:.0f}% of this host's RAM "
                f"({format_size(ram)}): little is left for the engines and the OS")
    return ""


def check_pool_geometry(pool_size: int) -> None:
    """Refuse a size the pool cannot serve exactly (whole 64 MiB chunks, or whole pages below one
    chunk) with one line naming the two nearest that it can: a pool never rounds a size silently."""
    try:
        pool_geometry(pool_size)
    except ValueError as e:
        raise ConfigError(str(e)) from None


def _host_port(text: str, what: str) -> tuple[str, int]:
    host, sep, port = text.rpartition(":")
    if not sep or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ConfigError(f"{what} must be host:port, got {text!r}")
    return host.strip("[]") or LOOPBACK, int(port)


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_address(address: str, allow_remote: bool, notices: list[str] | None = None) -> str:
    """Validate a ZeroMQ endpoint; ``tcp://`` binds loopback unless remote access is allowed. Every
    interface (``*``, 0.0.0.0, ::) without --allow-remote is bound on loopback, and ``notices`` gets a
    line saying so (the daemon logs it: an operator who wrote 0.0.0.0 must not be left thinking other
    hosts can connect); any other non-loopback host is refused."""
    if address.startswith("ipc://"):
        if len(address) <= 6:
            raise ConfigError("ipc:// address needs a path")
        n = len(os.fsencode(address[6:]))
        if n > MAX_IPC_PATH:
            raise ConfigError(f"--address {address}: the socket path is {n} bytes; UNIX sockets take at most "
                              f"{MAX_IPC_PATH} (choose a shorter directory)")
        return address
    if address.startswith("tcp://"):
        host, port = _host_port(address[6:], "--address tcp://")
        if host in ("*", "0.0.0.0", "::"):
            if not allow_remote:
                host = LOOPBACK
                if notices is not None:
                    notices.append(f"{address} is bound on {LOOPBACK}:{port} only (loopback): other hosts "
                                   "cannot connect; pass --allow-remote to listen on every interface")
        elif not _is_loopback(host) and not allow_remote:
            raise ConfigError(f"--address {address} would accept connections from other hosts; "
                              "pass --allow-remote if that is intended")
        return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"
    if address.startswith("inproc://"):
        raise ConfigError(f"--address {address}: inproc:// is reachable only inside the daemon's own process; "
                          "engines need ipc:// or tcp://")
    raise ConfigError(f"--address must be an ipc:// or tcp:// ZeroMQ endpoint, got {address!r}")


def _truthy(v: object) -> bool:
    return v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes", "on")


def _lower(v: object) -> str:
    return str(v).lower()


def _size(v: object) -> int:
    return parse_size(str(v))


def _one_of(kind: type[StrEnum], flag: str) -> Callable[[object], Any]:
    """A parser for a setting that is one of ``kind``'s values (any case); a bad one names them all."""
    def parse(v: object) -> Any:
        try:
            return kind(str(v).lower())
        except ValueError:
            raise ConfigError(f"{flag} must be one of {', '.join(k.value for k in kind)}, "
                              f"got {str(v).lower()!r}") from None
    return parse


_disk_policy = _one_of(DiskPolicy, "--disk-policy")
_remote_publish = _one_of(RemotePublish, "--remote-publish")


def _setting(flag: str, parse: Callable[[object], Any], help: str, **default: Any) -> Any:  # noqa: A002
    """A ``Config`` field that is a daemon setting, as one row: its flag (the field's name, dashed), its
    environment variable (``KVOFFD_`` and the flag's name), the parser of its raw value (a string from
    the command line or the environment; ``_truthy`` makes a switch: a flag without a value) and its
    ``--help`` line. ``build_parser``, ``_raw_settings`` and ``_apply`` read nothing else."""
    env = "KVOFFD_" + flag[2:].replace("-", "_").upper()
    return field(metadata={"flag": flag, "env": env, "parse": parse, "help": help}, **default)


@dataclass
class Config:
    """The daemon's settings: each field with metadata is one (``_setting``); the rest is what
    validation derives."""

    address: str = _setting(
        "--address", str, "ZeroMQ endpoint to serve on (ipc://PATH or tcp://HOST:PORT). Default: a private "
        "UNIX socket, $XDG_RUNTIME_DIR/kvoffd/kvoffd.sock or /tmp/kvoffd-<uid>/kvoffd.sock",
        default_factory=default_address)
    pool_size: int = _setting(
        "--pool-size", _size, "Pinned CPU pool size, with units (512MiB, 64GiB). Default: min(4 GiB, 25%% of RAM)",
        default_factory=default_pool_size)
    metrics_address: str = _setting(
        "--metrics-address", str, "host:port for /metrics, /healthz and /readyz; 'off' disables. "
        "Default: 127.0.0.1:9464", default="127.0.0.1:9464")
    log_level: str = _setting("--log-level", _lower, "debug, info, warning or error. Default: info",
                              default="info")
    backend: str = _setting(
        "--backend", _lower, "Transfer backend: auto (CUDA when available, plus CPU), cpu or cuda. Default: auto",
        default="auto")
    allow_remote: bool = _setting(
        "--allow-remote", _truthy, "Allow a tcp:// address that other hosts can reach (off by default)",
        default=False)
    #: What validation changed that the operator should hear about (logged as WARNINGs at start).
    notices: list[str] = field(default_factory=list, compare=False)
    #: seconds: an engine silent this long (no request, no heartbeat) is gone
    engine_timeout: float = _setting(
        "--engine-timeout", lambda v: float(str(v)), "Seconds without a heartbeat after which an engine counts "
        "as gone. Default: 10", default=10.0)
    copy_threads: int = _setting(
        "--copy-threads", lambda v: int(str(v)), "Threads for CPU copies (0: min(4, cores)). Default: 0", default=0)
    verify: bool = _setting(
        "--verify", _truthy, "Integrity mode: checksum each block on store and verify it on load", default=False)
    auth_token_file: str = _setting(
        "--auth-token-file", str, "With a tcp:// address: the 0600 file holding the token clients must send in "
        "HELLO (created at first start). Default: <runtime dir>/auth-token", default_factory=default_auth_token_file)
    eviction_policy: str = _setting(  # kvoffd/cache/policy.py
        "--eviction-policy", _lower, f"Admission and eviction of the pool's blocks: {', '.join(sorted(POLICIES))}. "
        f"Default: {DEFAULT_POLICY} (docs/benchmarks.md, trace replay); lru with --disk-path", default=DEFAULT_POLICY)
    pool_path: str = _setting(  # kvoffd/pool/place.py, kvoffd/pool/file.py
        "--pool-path", str, "File the pool lives in, on a memory-backed filesystem (tmpfs, hugetlbfs), so that a "
        "restarted daemon adopts its blocks; 'none' keeps the pool in private memory, lost with "
        "the process. Default: kvoffd.pool in a directory of this user's in /dev/shm, named at "
        "random at first start (/dev/shm/kvoffd-<uid>-<address hash>-XXXXXXXX/); a pool kept "
        "beside the socket by an older kvoffd stays there. The pool's files are RAM and stay when "
        "the daemon stops (the warm restart); 'kvoffd purge' gives a stopped daemon's memory back", default="")
    cold: bool = _setting(
        "--cold", _truthy, "Start with an empty pool, even if the previous daemon's could be adopted", default=False)
    kv_events_address: str = _setting(  # docs/vllm.md
        "--kv-events-address", str, "Publish vLLM-format KV events (blocks stored/removed) for routers on this "
        "ZeroMQ endpoint: 'ipc' (a socket beside the daemon's, in its private directory), "
        "ipc://PATH or tcp://HOST:PORT (CURVE clients only, see --kv-events-auth). Default: off", default="")
    kv_events_replay_address: str = _setting(
        "--kv-events-replay-address", str, "The KV events' replay endpoint for late subscribers. Default: the next "
        "tcp port (any free one with port 0), or ipc://PATH.replay", default="")
    kv_events_topic: str = _setting(
        "--kv-events-topic", str, "Topic of every KV-event message (as vLLM's kv-events-config topic). "
        "Default: none", default="")
    kv_events_auth: str = _setting(
        "--kv-events-auth", _lower, "Who may subscribe to a tcp:// KV-event stream: curve (clients whose public key "
        "is in --kv-events-curve-dir/allowed) or none (anyone who can reach the port; no token ids). "
        "Default: curve", default="curve")
    kv_events_curve_dir: str = _setting(
        "--kv-events-curve-dir", str, "The KV-event stream's CURVE keys (0700; server and router key pairs made at "
        "first start, allowed/ the accepted public keys). Default: <runtime dir>/kv-events-curve",
        default_factory=lambda: os.path.join(runtime_dir(), "kv-events-curve"))
    kv_events_token_ids: bool = _setting(
        "--kv-events-token-ids", _truthy, "KV events carry each stored block's token ids (prompt content: whoever "
        "may subscribe reads the prompts). Off by default: block hashes only", default=False)
    disk_path: str = _setting(  # kvoffd/cache/tiers/disk.py
        "--disk-path", str, "Directory of the disk (NVMe) tier under the pool: blocks evicted from the pool are "
        "kept there and found again after a restart. Default: none (no disk tier)", default="")
    disk_size: int = _setting(  # per block size
        "--disk-size", _size, "Bytes of the disk tier, with units (e.g. 2TiB; per block size). Required with "
        "--disk-path", default=0)
    numa_map: str = _setting(  # kvoffd/pool/topology.py
        "--numa-map", str, "NUMA placement of the pool: auto (one shard per node, sized by its GPUs, from sysfs), "
        "off (one shard, no placement), or gpuN=NODE pairs overriding sysfs (gpu0=0,gpu1=0,gpu2=1). "
        "Default: auto", default="auto")
    sysfs_root: str = _setting(
        "--sysfs-root", str, "Where the NUMA topology is read from (a container that mounts the host's /sys "
        "elsewhere). Default: /sys", default="/sys")
    disk_policy: DiskPolicy = _setting(
        "--disk-policy", _disk_policy, "Replacement in the disk tier: clock2-ghost (2-bit CLOCK; a block evicted "
        "from the disk recently starts at count 2 when it comes back) or clock2 (every block starts "
        "at 0). Default: clock2-ghost (docs/benchmarks.md, disk tier)", default=DiskPolicy.CLOCK2_GHOST)
    remote: str = _setting(  # kvoffd/cache/tiers/remote/
        "--remote", str, "A Valkey/Redis cluster (or one server) shared by the nodes' daemons as the tier under "
        "the pool (under the disk tier with --disk-path): redis://[user@]host:port[,host:port...] (seeds), "
        "rediss:// for TLS (--remote-tls-*: a private CA, a client certificate). Default: none",
        default="")
    remote_password_file: str = _setting(
        "--remote-password-file", str, "File whose first line is the --remote password (0600; the user is "
        "the URL's). Default: none (no AUTH)", default="")
    remote_key_file: str = _setting(
        "--remote-key-file", str, "Secret the cluster's daemons share (0600, at least 16 bytes): every value "
        "carries an HMAC-SHA256 with it, and values without a valid one are misses. Default: none "
        "(checksums only)", default="")
    remote_write_budget: int = _setting(
        "--remote-write-budget", _size, "Bytes per second the daemon writes to --remote at most (e.g. "
        "2GiB), so that publishing never fills the NIC. Default: 0 (no limit)", default=0)
    remote_publish: RemotePublish = _setting(
        "--remote-publish", _remote_publish, "When --remote receives a block: admitted (written behind as the "
        "pool admits it: other nodes find it within milliseconds, and the cluster also holds a copy of what "
        "the pools hold) or evicted (as it leaves the pool: more distinct blocks in the same memory, seen "
        "by other nodes only once evicted here). Default: admitted (docs/operations.md)",
        default=RemotePublish.ADMITTED)
    remote_tls_ca: str = _setting(  # kvoffd/cache/tiers/remote/tls.py
        "--remote-tls-ca", str, "With a rediss:// --remote: PEM bundle of the CA(s) the shards' certificates "
        "must chain to (a private cluster CA; it replaces the system's CAs). Default: the system's CAs",
        default="")
    remote_tls_cert: str = _setting(
        "--remote-tls-cert", str, "With rediss://: PEM client certificate for shards that require one "
        "(--tls-auth-clients yes); needs --remote-tls-key. Default: none", default="")
    remote_tls_key: str = _setting(
        "--remote-tls-key", str, "With rediss://: the client certificate's unencrypted PEM private key (0600). "
        "Not --remote-key-file, the values' MAC secret. Default: none", default="")
    remote_tls_server_name: str = _setting(
        "--remote-tls-server-name", str, "With rediss://: the name every shard's certificate must hold (and the "
        "SNI sent), for clusters that announce IPs while their certificates name a DNS name. Default: "
        "each shard's host as the URL or the slot map names it", default="")

    @property
    def metrics_host_port(self) -> tuple[str, int] | None:
        if self.metrics_address in ("", "off", "none"):
            return None
        return _host_port(self.metrics_address, "--metrics-address")


#: every daemon setting, in the order of --help
SETTINGS = tuple(f for f in fields(Config) if "flag" in f.metadata)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvoffd",
        description="kvoffd: a KV-cache offload daemon for vLLM. Every flag can also be set with an "
                    "environment variable KVOFFD_<FLAG> (e.g. KVOFFD_POOL_SIZE=64GiB); flags win.",
        epilog="Subcommands: 'kvoffd doctor' checks this machine for running kvoffd; 'kvoffd purge' removes "
               "a stopped daemon's pool from /dev/shm and gives its memory back (--help for each).")
    for f in SETTINGS:
        m = f.metadata
        if m["parse"] is _truthy:
            p.add_argument(m["flag"], dest=f.name, action="store_true", default=None, help=m["help"])
        else:
            p.add_argument(m["flag"], dest=f.name, default=None, help=m["help"])
    return p


def load_config(argv: list[str] | None = None, environ: dict[str, str] | None = None) -> Config:
    env = os.environ if environ is None else environ
    raw = _raw_settings(build_parser().parse_args(argv), env)
    cfg = Config()
    try:
        _apply(cfg, raw)
    except ValueError as e:
        raise ConfigError(str(e) if isinstance(e, ConfigError) else f"bad value: {e}") from None
    _check(cfg, raw)
    return cfg


def _raw_settings(args: argparse.Namespace, env: Mapping[str, str]) -> dict[str, object]:
    """Each setting given, flag over ``KVOFFD_*`` environment variable, still unparsed."""
    raw: dict[str, object] = {}
    for f in SETTINGS:
        v = getattr(args, f.name)
        if v is None:
            v = env.get(f.metadata["env"])
        if v is not None:
            raw[f.name] = v
    return raw


def _apply(cfg: Config, raw: dict[str, object]) -> None:
    """Parse the settings given into ``cfg`` (ValueError for one that does not parse)."""
    for f in SETTINGS:
        if f.name in raw:
            setattr(cfg, f.name, f.metadata["parse"](raw[f.name]))


def _check(cfg: Config, raw: dict[str, object]) -> None:
    """Refuse values out of range or contradicting each other, with one line naming the flag (and give
    a disk tier lru unless a policy was asked for)."""
    if cfg.log_level not in ("debug", "info", "warning", "error"):
        raise ConfigError(f"--log-level must be debug, info, warning or error, got {cfg.log_level!r}")
    if cfg.backend not in ("auto", "cpu", "cuda"):
        raise ConfigError(f"--backend must be auto, cpu or cuda, got {cfg.backend!r}")
    if cfg.eviction_policy not in POLICIES:
        raise ConfigError(f"--eviction-policy must be one of {', '.join(sorted(POLICIES))}, "
                          f"got {cfg.eviction_policy!r}")
    if not 0.5 <= cfg.engine_timeout <= 3600:
        raise ConfigError("--engine-timeout must be between 0.5 and 3600 seconds")
    if not 0 <= cfg.copy_threads <= 256:
        raise ConfigError("--copy-threads must be between 0 and 256")
    if cfg.disk_path and "eviction_policy" not in raw:
        # Under a disk tier, admission at the pool keeps refused blocks out of the disk too (they never
        # reach it): measured on the conversation trace (docs/benchmarks.md, disk tier), pool + disk
        # hit 73.2% of the unbounded ratio with lru and 50.5% with the doorkeeper.
        cfg.eviction_policy = LRU.name
    if cfg.disk_path and cfg.disk_size < (1 << 20):
        raise ConfigError("--disk-path needs --disk-size of at least 1MiB (e.g. --disk-size 512GiB)")
    if cfg.disk_size and not cfg.disk_path:
        raise ConfigError("--disk-size needs --disk-path (the directory of the disk tier)")
    if cfg.remote and not cfg.remote.startswith(("redis://", "rediss://", "valkey://", "valkeys://")):
        raise ConfigError(f"--remote must be redis://host:port[,host:port...] or rediss://..., got {cfg.remote!r}")
    if not cfg.remote and (cfg.remote_password_file or cfg.remote_key_file or cfg.remote_write_budget):
        raise ConfigError("--remote-password-file, --remote-key-file and --remote-write-budget need --remote")
    if not cfg.remote and cfg.remote_publish != RemotePublish.ADMITTED:
        raise ConfigError("--remote-publish needs --remote")
    _check_remote_tls(cfg)
    if cfg.pool_size < (1 << 20):
        raise ConfigError("--pool-size must be at least 1MiB")
    if cfg.pool_path and cfg.pool_path != "none" and not os.path.isabs(cfg.pool_path):
        raise ConfigError(f"--pool-path must be an absolute path or 'none', got {cfg.pool_path!r}")
    cfg.address = check_address(cfg.address, cfg.allow_remote, cfg.notices)
    cfg.metrics_host_port  # noqa: B018 - validates
    _check_kv_events(cfg)
    try:
        parse_numa_map(cfg.numa_map)
    except NumaMapError as e:
        raise ConfigError(str(e)) from None


def _check_remote_tls(cfg: Config) -> None:
    """The TLS flags need a rediss:// --remote (a plain connection would ignore them: the operator meant
    TLS), and the client certificate its key; the files are read when the tier is made (factory.py)."""
    given = [f for f in ("remote_tls_ca", "remote_tls_cert", "remote_tls_key", "remote_tls_server_name")
             if getattr(cfg, f)]
    if not given:
        return
    flags = ", ".join("--" + f.replace("_", "-") for f in given)
    if not cfg.remote:
        raise ConfigError(f"{flags} need --remote rediss://... (TLS to the cluster)")
    if not cfg.remote.startswith(("rediss://", "valkeys://")):
        raise ConfigError(f"{flags} need a rediss:// --remote (TLS); {cfg.remote.split('://', 1)[0]}:// is "
                          "plain TCP: write rediss://host:port[,host:port...]")
    if bool(cfg.remote_tls_cert) != bool(cfg.remote_tls_key):
        raise ConfigError("--remote-tls-cert and --remote-tls-key go together (the client certificate and its key)")


def _check_kv_events(cfg: Config) -> None:
    """The event endpoints follow --address's rules (tcp:// binds loopback unless --allow-remote: the
    stream tells which prompts are cached); the replay endpoint needs the stream's. 'ipc' is the
    private default: beside the daemon's ipc socket, else in the runtime directory. Both endpoints use
    one transport (kvoffd/server/outlet.py says why), and token ids never go to anyone who can reach
    a port."""
    if cfg.kv_events_replay_address and not cfg.kv_events_address:
        raise ConfigError("--kv-events-replay-address needs --kv-events-address")
    if cfg.kv_events_auth not in ("curve", "none"):
        raise ConfigError(f"--kv-events-auth must be curve or none, got {cfg.kv_events_auth!r}")
    if cfg.kv_events_address == "ipc":
        base = cfg.address[6:] if cfg.address.startswith("ipc://") else os.path.join(
            os.path.dirname(cfg.auth_token_file) or ".", "kvoffd.sock")
        cfg.kv_events_address = f"ipc://{base}.events"
    if len(cfg.kv_events_topic.encode()) > 256:
        raise ConfigError("--kv-events-topic must be at most 256 bytes")
    for name in ("kv_events_address", "kv_events_replay_address"):
        flag = "--" + name.replace("_", "-")
        value = getattr(cfg, name)
        if value:
            try:
                setattr(cfg, name, check_address(value, cfg.allow_remote, cfg.notices))
            except ConfigError as e:
                raise ConfigError(str(e).replace("--address", flag)) from None
    if cfg.kv_events_address and cfg.kv_events_address == cfg.kv_events_replay_address:
        raise ConfigError("--kv-events-replay-address must differ from --kv-events-address")
    replay = cfg.kv_events_replay_address or cfg.kv_events_address
    if replay.startswith("ipc://") and not cfg.kv_events_replay_address:  # the default: <path>.replay
        try:
            check_address(replay + ".replay", cfg.allow_remote)
        except ConfigError as e:
            raise ConfigError(str(e).replace("--address", "--kv-events-address (its replay socket)")) from None
    if replay[:6] != cfg.kv_events_address[:6]:
        raise ConfigError("--kv-events-replay-address must use the transport of --kv-events-address (both "
                          "ipc:// or both tcp://)")
    if cfg.kv_events_token_ids and cfg.kv_events_address.startswith("tcp://") and cfg.kv_events_auth == "none":
        raise ConfigError("--kv-events-token-ids with --kv-events-auth none would show every prompt to anyone "
                          "who can reach the port: use --kv-events-auth curve, or an ipc:// stream")
