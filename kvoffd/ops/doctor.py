"""``kvoffd doctor``: check this machine for running kvoffd, and say how to fix what is off.

Operators hit the same surprises with every KV offloader: a memlock limit of 8 MiB in a container, a
64 MiB /dev/shm, a GPU the sidecar cannot see, CUDA IPC that fails between containers, a pool larger
than the memory the cgroup allows. Each check here prints one PASS/WARN/FAIL/SKIP line with what it
found and, when it is not a pass, the fix. The exit code is 1 when any check fails (2 with
``--strict`` when any warns), so the doctor can gate a deployment.

It must run anywhere, above all on a machine without a GPU: GPU work happens in a child process
(kvoffd/ops/doctor_gpu.py) with a deadline, and a check that breaks is reported as a result line, never
a traceback.

This module is the entry point: the arguments, the checks in their order, the printing. What the checks
are run against (pool size, pool file, address) is what the daemon uses: the doctor's flags, else the
unit's environment file (``--env-file``), else the running daemon, asked over its socket, else this
shell's ``KVOFFD_*`` (doctor_settings). The checks live by subject: doctor_host (memory, limits, /dev/shm,
huge pages), doctor_pool (the pool file), doctor_daemon (the socket's directory, a daemon answering),
doctor_gpu_checks (the GPU probe's findings).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict

from kvoffd.config import ConfigError, parse_size
from kvoffd.ops.doctor_daemon import check_daemon, check_socket_dir
from kvoffd.ops.doctor_gpu_checks import check_bandwidth, check_gpus, check_ipc
from kvoffd.ops.doctor_host import check_hugepages, check_memlock, check_memory, check_shm
from kvoffd.ops.doctor_numa import check_numa
from kvoffd.ops.doctor_result import FAIL, PASS, SKIP, WARN, Context, Result
from kvoffd.ops.doctor_settings import daemon_view, read_env_file, resolve


def check_pool(ctx: Context) -> Result:
    """The pool file a warm restart needs (kvoffd/ops/doctor_pool.py)."""
    from kvoffd.ops.doctor_pool import check_pool_file

    return Result("pool-file", *check_pool_file(ctx))


CHECKS: list[Callable[[Context], Result]] = [
    check_memlock, check_shm, check_hugepages, check_memory, check_pool, check_socket_dir, check_daemon,
    check_gpus, check_numa, check_ipc, check_bandwidth,
]


def run_checks(ctx: Context, checks: Sequence[Callable[[Context], Result]] = CHECKS) -> list[Result]:
    results = []
    for check in checks:
        try:
            results.append(check(ctx))
        except Exception as e:  # a bug in a check must not hide the others
            name = check.__name__.removeprefix("check_")
            results.append(Result(name, WARN, f"internal error in this check: {type(e).__name__}: {e}",
                                  "please report it with this line"))
    return results


def format_results(results: Sequence[Result]) -> str:
    width = max(len(r.name) for r in results)
    lines = []
    for r in results:
        lines.append(f"{r.status.upper():4}  {r.name:<{width}}  {r.detail}")
        if r.fix and r.status in (WARN, FAIL):
            lines.append(f"{'':4}  {'':<{width}}  fix: {r.fix}")
    counts = {s: sum(r.status == s for r in results) for s in (PASS, WARN, FAIL, SKIP)}
    lines.append(", ".join(f"{n} {s}" for s, n in counts.items()))
    return "\n".join(lines)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvoffd doctor",
        description="Check this machine for running kvoffd; each line says what was found and how to fix it.",
        epilog="Exit codes: 0 no failures, 1 a check failed, 2 a check warned and --strict was given.")
    p.add_argument("--env-file", default=None, metavar="FILE",
                   help="the daemon's environment file (the systemd unit's EnvironmentFile, e.g. "
                        "/etc/kvoffd/kvoffd.env): its KVOFFD_* are what the next start uses, and win over the "
                        "running daemon's and this shell's")
    p.add_argument("--pool-size", default=None,
                   help="pool size to check against (default: --env-file's KVOFFD_POOL_SIZE, else the running "
                        "daemon's, else $KVOFFD_POOL_SIZE, else the daemon's default)")
    p.add_argument("--address", default=None,
                   help="daemon address to ask and whose socket directory to check (default: --env-file's "
                        "KVOFFD_ADDRESS, else $KVOFFD_ADDRESS, else the daemon's default)")
    p.add_argument("--pool-path", default=None,
                   help="pool file to check (default: --env-file's KVOFFD_POOL_PATH, else the running daemon's "
                        "file, else $KVOFFD_POOL_PATH, else the daemon's default)")
    p.add_argument("--numa-map", default=None,
                   help="the daemon's NUMA map to show (default: --env-file's, else $KVOFFD_NUMA_MAP, else auto)")
    p.add_argument("--sysfs-root", default=None,
                   help="where to read the NUMA topology (default: --env-file's, else $KVOFFD_SYSFS_ROOT, else "
                        "/sys)")
    p.add_argument("--bandwidth-size", default="256MiB",
                   help="bytes per copy in the bandwidth check; 0 skips it (default 256MiB)")
    p.add_argument("--no-ipc", action="store_true", help="skip the CUDA IPC check")
    p.add_argument("--gpu-timeout", type=float, default=180.0, help="seconds for all GPU checks (default 180)")
    p.add_argument("--json", action="store_true", help="print the results as JSON")
    p.add_argument("--strict", action="store_true", help="exit 2 when any check warns")
    return p


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        env_file = read_env_file(args.env_file) if args.env_file else {}
        bw = 0 if args.bandwidth_size.strip() in ("0", "off") else parse_size(args.bandwidth_size)
        cfg, view, why = resolve(args, env_file, os.environ, args.env_file or "", daemon_view)
    except ConfigError as e:
        parser.error(str(e))
    ctx = Context(pool_size=cfg.pool_size, pool_size_source=cfg.sources["pool_size"], address=cfg.address,
                  bandwidth_bytes=bw, ipc=not args.no_ipc, gpu_timeout_s=args.gpu_timeout, pool_path=cfg.pool_path,
                  numa_map=cfg.numa_map, sysfs_root=cfg.sysfs_root, env_file=args.env_file or "",
                  sources=cfg.sources, overruled=cfg.overruled,
                  daemon=view, daemon_error=why)
    results = run_checks(ctx)
    if args.json:
        print(json.dumps({"results": [asdict(r) for r in results], "gpu_probe": ctx.gpu_probe}, indent=2))
    else:
        print(f"kvoffd doctor on {platform.node()} ({platform.system()} {platform.release()}, {platform.machine()}, "
              f"Python {platform.python_version()})")
        print(format_results(results))
    if any(r.status == FAIL for r in results):
        return 1
    if args.strict and any(r.status == WARN for r in results):
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
