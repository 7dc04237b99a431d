"""Configuration: embedded defaults, overridden by KVOFFD_<NAME> environment variables, then flags.

Every value is checked at start; a bad one stops the daemon with one clear line (ConfigError).
"""

from __future__ import annotations

import argparse
import ipaddress
import os
import re
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field

from kvoffd.cache.policy import DEFAULT_POLICY, DISK_POLICIES, LRU, POLICIES
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
    chunk) with one line naming the two nearest that it can (issue 13: 100 MiB used to give 64)."""
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


@dataclass
class Config:
    address: str = field(default_factory=default_address)
    pool_size: int = field(default_factory=default_pool_size)
    metrics_address: str = "127.0.0.1:9464"
    log_level: str = "info"
    backend: str = "auto"  # auto | cpu | cuda
    allow_remote: bool = False
    #: What validation changed that the operator should hear about (logged as WARNINGs at start).
    notices: list[str] = field(default_factory=list, compare=False)
    engine_timeout_s: float = 10.0  # an engine silent this long (no request, no heartbeat) is gone
    copy_threads: int = 0  # CPU copy threads (0: min(4, cores))
    verify: bool = False  # per-block checksums (integrity mode)
    auth_token_file: str = field(default_factory=default_auth_token_file)  # tcp:// clients must send it
    eviction_policy: str = DEFAULT_POLICY  # admission/eviction of the pool (kvoffd/cache/policy.py)
    pool_path: str = ""  # the persistent pool's file ("": a private directory in /dev/shm, kvoffd/pool/place.py;
    #                      "none": private memory, lost with the process) (kvoffd/pool/file.py)
    cold: bool = False  # start with an empty pool even if the previous daemon's can be adopted
    kv_events_address: str = ""  # ZeroMQ PUB endpoint of the KV-event stream ("": off; docs/vllm.md)
    kv_events_replay_address: str = ""  # its ROUTER replay endpoint ("": the next tcp port, or <path>.replay)
    kv_events_topic: str = ""  # the topic frame of every event message (vLLM's KVEventsConfig.topic)
    kv_events_auth: str = "curve"  # who may subscribe on tcp:// (curve: allowed keys; none: anyone who reaches it)
    kv_events_curve_dir: str = field(default_factory=lambda: os.path.join(runtime_dir(), "kv-events-curve"))
    kv_events_token_ids: bool = False  # BlockStored events carry the blocks' token ids (prompt content)
    disk_path: str = ""  # the disk tier's directory (kvoffd/cache/tiers/disk.py); "" = no disk tier
    disk_size: int = 0  # bytes of disk tier per block size
    numa_map: str = "auto"  # auto | off | gpu0=0,gpu1=1,... (kvoffd/pool/topology.py): the pool's NUMA shards
    sysfs_root: str = "/sys"  # where the topology is read (a test's fake host; a container's host /sys)
    disk_policy: str = "clock2-ghost"  # the disk tier's replacement (kvoffd/cache/policy.py DISK_POLICIES)

    @property
    def metrics_host_port(self) -> tuple[str, int] | None:
        if self.metrics_address in ("", "off", "none"):
            return None
        return _host_port(self.metrics_address, "--metrics-address")


_FLAGS = [
    # name, type, help
    ("address", str, "ZeroMQ endpoint to serve on (ipc://PATH or tcp://HOST:PORT). Default: a private "
                     "UNIX socket, $XDG_RUNTIME_DIR/kvoffd/kvoffd.sock or /tmp/kvoffd-<uid>/kvoffd.sock"),
    ("pool_size", str, "Pinned CPU pool size, with units (512MiB, 64GiB). Default: min(4 GiB, 25%% of RAM)"),
    ("metrics_address", str, "host:port for /metrics, /healthz and /readyz; 'off' disables. "
                             "Default: 127.0.0.1:9464"),
    ("log_level", str, "debug, info, warning or error. Default: info"),
    ("backend", str, "Transfer backend: auto (CUDA when available, plus CPU), cpu or cuda. Default: auto"),
    ("engine_timeout", str, "Seconds without a heartbeat after which an engine counts as gone. Default: 10"),
    ("copy_threads", str, "Threads for CPU copies (0: min(4, cores)). Default: 0"),
    ("auth_token_file", str, "With a tcp:// address: the 0600 file holding the token clients must send in "
                             "HELLO (created at first start). Default: <runtime dir>/auth-token"),
    ("eviction_policy", str, f"Admission and eviction of the pool's blocks: {', '.join(sorted(POLICIES))}. "
                             f"Default: {DEFAULT_POLICY} (docs/benchmarks.md, trace replay); lru with --disk-path"),
    ("pool_path", str, "File the pool lives in, on a memory-backed filesystem (tmpfs, hugetlbfs), so that a "
                       "restarted daemon adopts its blocks; 'none' keeps the pool in private memory, lost with "
                       "the process. Default: kvoffd.pool in a directory of this user's in /dev/shm, named at "
                       "random at first start (/dev/shm/kvoffd-<uid>-<address hash>-XXXXXXXX/); a pool kept "
                       "beside the socket by an older kvoffd stays there. The pool's files are RAM and stay when "
                       "the daemon stops (the warm restart); 'kvoffd purge' gives a stopped daemon's memory back"),
    ("kv_events_address", str, "Publish vLLM-format KV events (blocks stored/removed) for routers on this "
                               "ZeroMQ endpoint: 'ipc' (a socket beside the daemon's, in its private directory), "
                               "ipc://PATH or tcp://HOST:PORT (CURVE clients only, see --kv-events-auth). "
                               "Default: off"),
    ("kv_events_replay_address", str, "The KV events' replay endpoint for late subscribers. Default: the next "
                                      "tcp port (any free one with port 0), or ipc://PATH.replay"),
    ("kv_events_topic", str, "Topic of every KV-event message (as vLLM's kv-events-config topic). Default: none"),
    ("kv_events_auth", str, "Who may subscribe to a tcp:// KV-event stream: curve (clients whose public key is in "
                            "--kv-events-curve-dir/allowed) or none (anyone who can reach the port; no token ids). "
                            "Default: curve"),
    ("kv_events_curve_dir", str, "The KV-event stream's CURVE keys (0700; server and router key pairs made at "
                                 "first start, allowed/ the accepted public keys). Default: "
                                 "<runtime dir>/kv-events-curve"),
    ("disk_path", str, "Directory of the disk (NVMe) tier under the pool: blocks evicted from the pool are "
                       "kept there and found again after a restart. Default: none (no disk tier)"),
    ("disk_size", str, "Bytes of the disk tier, with units (e.g. 2TiB; per block size). Required with "
                       "--disk-path"),
    ("numa_map", str, "NUMA placement of the pool: auto (one shard per node, sized by its GPUs, from sysfs), "
                      "off (one shard, no placement), or gpuN=NODE pairs overriding sysfs (gpu0=0,gpu1=0,gpu2=1). "
                      "Default: auto"),
    ("sysfs_root", str, "Where the NUMA topology is read from (a container that mounts the host's /sys "
                        "elsewhere). Default: /sys"),
    ("disk_policy", str, "Replacement in the disk tier: clock2-ghost (2-bit CLOCK; a block evicted from the "
                         "disk recently starts at count 2 when it comes back) or clock2 (every block starts "
                         "at 0). Default: clock2-ghost (docs/benchmarks.md, disk tier)"),
]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvoffd",
        description="kvoffd: a KV-cache offload daemon for vLLM. Every flag can also be set with an "
                    "environment variable KVOFFD_<FLAG> (e.g. KVOFFD_POOL_SIZE=64GiB); flags win.",
        epilog="Subcommands: 'kvoffd doctor' checks this machine for running kvoffd; 'kvoffd purge' removes "
               "a stopped daemon's pool from /dev/shm and gives its memory back (--help for each).")
    for name, typ, help_ in _FLAGS:
        p.add_argument("--" + name.replace("_", "-"), dest=name, type=typ, default=None, help=help_)
    p.add_argument("--allow-remote", action="store_true", default=None,
                   help="Allow a tcp:// address that other hosts can reach (off by default)")
    p.add_argument("--verify", action="store_true", default=None,
                   help="Integrity mode: checksum each block on store and verify it on load")
    p.add_argument("--cold", action="store_true", default=None,
                   help="Start with an empty pool, even if the previous daemon's could be adopted")
    p.add_argument("--kv-events-token-ids", action="store_true", default=None,
                   help="KV events carry each stored block's token ids (prompt content: whoever may subscribe "
                        "reads the prompts). Off by default: block hashes only")
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
    for name in [f[0] for f in _FLAGS] + ["allow_remote", "verify", "cold", "kv_events_token_ids"]:
        v = getattr(args, name)
        if v is None:
            v = env.get("KVOFFD_" + name.upper())
        if v is not None:
            raw[name] = v
    return raw


def _truthy(v: object) -> bool:
    return v if isinstance(v, bool) else str(v).lower() in ("1", "true", "yes", "on")


def _lower(v: object) -> str:
    return str(v).lower()


#: setting name -> (Config field, parser of the raw value): one row per setting, so a new flag is one line
_PARSERS: dict[str, tuple[str, Callable[[object], object]]] = {
    "address": ("address", str),
    "pool_size": ("pool_size", lambda v: parse_size(str(v))),
    "metrics_address": ("metrics_address", str),
    "log_level": ("log_level", _lower),
    "backend": ("backend", _lower),
    "engine_timeout": ("engine_timeout_s", lambda v: float(str(v))),
    "copy_threads": ("copy_threads", lambda v: int(str(v))),
    "auth_token_file": ("auth_token_file", str),
    "eviction_policy": ("eviction_policy", _lower),
    "pool_path": ("pool_path", str),
    "kv_events_address": ("kv_events_address", str),
    "kv_events_replay_address": ("kv_events_replay_address", str),
    "kv_events_topic": ("kv_events_topic", str),
    "kv_events_auth": ("kv_events_auth", _lower),
    "kv_events_curve_dir": ("kv_events_curve_dir", str),
    "kv_events_token_ids": ("kv_events_token_ids", _truthy),
    "disk_path": ("disk_path", str),
    "disk_size": ("disk_size", lambda v: parse_size(str(v))),
    "disk_policy": ("disk_policy", _lower),
    "allow_remote": ("allow_remote", _truthy),
    "verify": ("verify", _truthy),
    "cold": ("cold", _truthy),
    "numa_map": ("numa_map", str),
    "sysfs_root": ("sysfs_root", str),
}


def _apply(cfg: Config, raw: dict[str, object]) -> None:
    """Parse the settings given into ``cfg`` (ValueError for one that does not parse)."""
    for name, value in raw.items():
        row = _PARSERS.get(name)
        if row is not None:
            setattr(cfg, row[0], row[1](value))


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
    if not 0.5 <= cfg.engine_timeout_s <= 3600:
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
    if cfg.disk_policy not in DISK_POLICIES:
        raise ConfigError(f"--disk-policy must be one of {', '.join(DISK_POLICIES)}, got {cfg.disk_policy!r}")
    if cfg.disk_size and not cfg.disk_path:
        raise ConfigError("--disk-size needs --disk-path (the directory of the disk tier)")
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
