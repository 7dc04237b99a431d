"""``kvoffd doctor``: check this machine for running kvoffd, and say how to fix what is off.

Operators hit the same surprises with every KV offloader: a memlock limit of 8 MiB in a container, a
64 MiB /dev/shm, a GPU the sidecar cannot see, CUDA IPC that fails between containers, a pool larger
than the memory the cgroup allows. Each check here prints one PASS/WARN/FAIL/SKIP line with what it
found and, when it is not a pass, the fix. The exit code is 1 when any check fails (2 with
``--strict`` when any warns), so the doctor can gate a deployment.

It must run anywhere, above all on a machine without a GPU: GPU work happens in a child process
(kvoffd/ops/doctor_gpu.py) with a deadline, and a check that breaks is reported as a result line, never
a traceback.
"""

from __future__ import annotations

import argparse
import grp
import json
import os
import platform
import pwd
import resource
import signal
import stat
import subprocess
import sys
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from typing import Any

from kvoffd.config import ConfigError, default_address, default_pool_size, format_size, parse_size

PASS, WARN, FAIL, SKIP = "pass", "warn", "fail", "skip"
SHM_MIN = 1 << 30  # below this a CPU engine's KV cache (which lives in /dev/shm) barely fits
BANDWIDTH_RATIO_WARN = 0.6  # achieved / link ceiling below this is worth a look


@dataclass
class Result:
    name: str
    status: str
    detail: str
    fix: str = ""


@dataclass
class Context:
    pool_size: int
    pool_size_source: str
    address: str
    bandwidth_bytes: int
    ipc: bool
    gpu_timeout_s: float
    pool_path: str = ""  # "" : the daemon's default (kvoffd/cache/pool_file.py)
    _gpu: dict[str, Any] | None = None

    def gpu(self) -> dict[str, Any]:
        """The GPU probe's findings, run once in a child process (see doctor_gpu)."""
        if self._gpu is None:
            self._gpu = _run_gpu_probe(self)
        return self._gpu


def _meminfo() -> dict[str, int]:
    """/proc/meminfo in bytes (the 'kB' there are KiB); page counts (HugePages_*) as they are."""
    out = {}
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                key, _, rest = line.partition(":")
                parts = rest.split()
                if parts and parts[0].isdigit():
                    out[key] = int(parts[0]) * (1024 if parts[1:] == ["kB"] else 1)
    except OSError:
        pass  # no /proc/meminfo (not Linux, or a locked-down container): the checks say "unknown"
    return out


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return ""


# --------------------------------------------------------------------------------------------------
# Host checks


def check_memlock(ctx: Context) -> Result:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if not _gpu_nodes():
        # Only the CUDA backend page-locks the pool; a warning here would send a CPU-only operator
        # after a limit that changes nothing for them.
        return Result("memlock", SKIP, "no GPU on this host: the pool is not page-locked, so RLIMIT_MEMLOCK "
                      "does not apply")
    if soft == resource.RLIM_INFINITY:
        return Result("memlock", PASS, "RLIMIT_MEMLOCK is unlimited")
    shown = f"RLIMIT_MEMLOCK is {format_size(soft)} (hard {'unlimited' if hard == resource.RLIM_INFINITY else format_size(hard)})"
    if soft >= ctx.pool_size:
        return Result("memlock", PASS, f"{shown}, at least the pool ({format_size(ctx.pool_size)})")
    return Result(
        "memlock", WARN,
        f"{shown}, below the pool ({format_size(ctx.pool_size)}). CUDA's own pinning is reported not to count "
        "against it, but mlock() and any RDMA registration do, and the failure then looks like an out-of-memory",
        "systemd: LimitMEMLOCK=infinity (the shipped unit sets it); docker: --ulimit memlock=-1 (compose: "
        "ulimits: memlock: -1); Kubernetes has no per-pod field: set LimitMEMLOCK=infinity in containerd's or "
        "CRI-O's systemd unit and restart it; a shell: ulimit -l unlimited (hard limit permitting, see limits.conf)")


def check_shm(ctx: Context) -> Result:
    try:
        st = os.statvfs("/dev/shm")
    except OSError as e:
        return Result("shm", WARN, f"/dev/shm is not available ({e.strerror}); engines on the CPU backend share "
                      "their KV cache with kvoffd through files there",
                      "mount a tmpfs at /dev/shm (docker: --shm-size=16g or --ipc=host; Kubernetes: an emptyDir "
                      "with medium: Memory mounted at /dev/shm)")
    size, free = st.f_blocks * st.f_frsize, st.f_bavail * st.f_frsize
    writable = os.access("/dev/shm", os.W_OK | os.X_OK)
    detail = f"/dev/shm is {format_size(size)} with {format_size(free)} free"
    fix = ("give /dev/shm at least the CPU engines' KV cache size: docker --shm-size=16g (compose: shm_size), "
           "Kubernetes: emptyDir {medium: Memory, sizeLimit: 16Gi} mounted at /dev/shm; on a host it is "
           "half of RAM by default (mount -o remount,size=... /dev/shm)")
    if not writable:
        return Result("shm", WARN, detail + ", and this user cannot create files in it", fix)
    if size < SHM_MIN:
        return Result("shm", WARN, detail + f"; under {format_size(SHM_MIN)}, which CPU engines' KV cache (kept "
                      "there to share with kvoffd) outgrows quickly (Docker's default is 64 MiB)", fix)
    return Result("shm", PASS, detail)


def check_hugepages(ctx: Context) -> Result:
    mi = _meminfo()
    thp = _read("/sys/kernel/mm/transparent_hugepage/enabled")
    mode = thp[thp.find("[") + 1:thp.find("]")] if "[" in thp else (thp or "unknown")
    total, free, size = mi.get("HugePages_Total", 0), mi.get("HugePages_Free", 0), mi.get("Hugepagesize", 0)
    detail = (f"transparent huge pages: {mode}; reserved huge pages: {total} of {format_size(size)} "
              f"({free} free)")
    if mode == "never":
        return Result("hugepages", WARN, detail + "; with THP off the pool is 4 KiB pages, which take longer to "
                      "touch and pin (about a minute per 100 GiB at best)",
                      "echo madvise > /sys/kernel/mm/transparent_hugepage/enabled (or transparent_hugepage=madvise "
                      "on the kernel command line)")
    return Result("hugepages", PASS, detail + " (kvoffd needs no reserved pages)")


def _cgroup_memory() -> tuple[int | None, int | None]:
    """(limit, usage) of this process's memory cgroup, v2 or v1; None where unlimited or unknown."""
    rel = ""
    for line in _read("/proc/self/cgroup").splitlines():
        if line.startswith("0::"):
            rel = line[3:]
    for base in (f"/sys/fs/cgroup{rel}", "/sys/fs/cgroup"):
        lim = _read(f"{base}/memory.max")
        if lim:
            use = _read(f"{base}/memory.current")
            return (None if lim == "max" else int(lim)), (int(use) if use.isdigit() else None)
    lim = _read("/sys/fs/cgroup/memory/memory.limit_in_bytes")
    use = _read("/sys/fs/cgroup/memory/memory.usage_in_bytes")
    if lim.isdigit() and int(lim) < (1 << 60):
        return int(lim), (int(use) if use.isdigit() else None)
    return None, None


def check_memory(ctx: Context) -> Result:
    mi = _meminfo()
    avail = mi.get("MemAvailable")
    if avail is None:
        return Result("memory", SKIP, "cannot read /proc/meminfo")
    limit, usage = _cgroup_memory()
    room, where = avail, "available RAM"
    if limit is not None and limit - (usage or 0) < room:
        room, where = limit - (usage or 0), f"room left in this cgroup's memory limit ({format_size(limit)})"
    detail = (f"pool {format_size(ctx.pool_size)} ({ctx.pool_size_source}) vs {format_size(room)} {where}; "
              f"MemTotal {format_size(mi.get('MemTotal', 0))}")
    fix = ("lower --pool-size (KVOFFD_POOL_SIZE), or raise the container's memory limit to pool + 1 GiB; "
           "leave room for the engines: a pinned pool cannot be swapped or reclaimed")
    if ctx.pool_size > room:
        return Result("memory", FAIL, detail + "; the pool cannot be fully backed, so pinning or first touch will "
                      "be killed by the OOM killer", fix)
    if ctx.pool_size > 0.8 * room:
        return Result("memory", WARN, detail + "; the pool takes over 80% of it", fix)
    return Result("memory", PASS, detail)


def _owner(uid: int) -> str:
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


def _group(gid: int) -> str:
    try:
        return grp.getgrgid(gid).gr_name
    except KeyError:
        return str(gid)


def check_socket_dir(ctx: Context) -> Result:
    addr = ctx.address
    if not addr.startswith("ipc://"):
        if addr.startswith("tcp://") and not any(h in addr for h in ("127.", "localhost", "[::1]")):
            return Result("socket", WARN, f"address {addr} is reachable from the network: anyone who connects can "
                          "read cached KV blocks and clear the cache",
                          "use an ipc:// address (the default), or bind tcp:// to 127.0.0.1")
        return Result("socket", SKIP, f"address {addr} is not a UNIX socket; no directory to check")
    path = addr[len("ipc://"):]
    d = os.path.dirname(os.path.abspath(path))
    fix_mode = (f"chmod 0700 {d} (or 0750 with a group the engines' user is in; the systemd unit's "
                "RuntimeDirectory does this); chown it to the daemon's user")
    try:
        st = os.stat(d)
    except FileNotFoundError:
        parent = os.path.dirname(d)
        if os.access(parent, os.W_OK | os.X_OK):
            return Result("socket", PASS, f"{d} does not exist yet; the daemon creates it (0700) on start")
        return Result("socket", FAIL, f"{d} does not exist and this user cannot create it in {parent}",
                      f"create it: install -d -m 0700 -o <daemon user> {d}, or set --address/KVOFFD_ADDRESS to a "
                      "directory the daemon's user owns")
    except PermissionError:
        return Result("socket", FAIL, f"cannot look into {os.path.dirname(d)} to reach {d}",
                      "run the doctor (and the engines) as the daemon's user or a member of its group")
    mode = stat.S_IMODE(st.st_mode)
    who = f"{d} is {mode:04o}, owner {_owner(st.st_uid)}, group {_group(st.st_gid)}"
    if not stat.S_ISDIR(st.st_mode):
        return Result("socket", FAIL, f"{d} is not a directory", fix_mode)
    if mode & 0o002 and not mode & stat.S_ISVTX:
        return Result("socket", FAIL, who + "; anyone can replace the socket and pose as the daemon", fix_mode)
    if mode & 0o007:
        return Result("socket", FAIL, who + "; every user on this host can reach the socket (and read cached KV "
                      "blocks or clear them)", fix_mode)
    if mode & 0o020:
        return Result("socket", WARN, who + f"; members of group {_group(st.st_gid)} can replace the socket",
                      fix_mode)
    if st.st_uid != os.geteuid():
        return Result("socket", WARN, who + f"; you are {_owner(os.geteuid())}: the daemon must run as "
                      f"{_owner(st.st_uid)}, and engines need group access to connect", fix_mode)
    note = f"; group {_group(st.st_gid)} may connect" if mode & 0o050 else ""
    return Result("socket", PASS, who + note)


def check_daemon(ctx: Context) -> Result:
    """Whether a daemon answers at the address (informative: the doctor usually runs before one starts)."""
    if ctx.address.startswith("ipc://") and not os.path.exists(ctx.address[len("ipc://"):]):
        return Result("daemon", SKIP, f"no daemon socket at {ctx.address} (not started yet)")
    try:
        from kvoffd.ops import ctl
    except ImportError as e:
        return Result("daemon", SKIP, f"cannot load the client library to ask the daemon ({e})")
    try:
        client = ctl.connect(ctx.address, 1.0)
    except ctl.Unreachable as e:
        return Result("daemon", WARN, str(e), "start kvoffd, or remove a stale socket left by a daemon that died")
    try:
        st = client.stats(detail=False)
        d = st.get("daemon", {})
        return Result("daemon", PASS, f"kvoffd {d.get('version', '?')} (pid {d.get('pid', '?')}) answers at "
                      f"{ctx.address}; {len(st.get('engines', []) or [])} engines registered")
    finally:
        client.close()


# --------------------------------------------------------------------------------------------------
# GPU checks (findings from the child process)


def _run_gpu_probe(ctx: Context) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "kvoffd.ops.doctor_gpu", "probe", str(ctx.bandwidth_bytes), "1" if ctx.ipc else "0",
           str(ctx.gpu_timeout_s / 2)]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=ctx.gpu_timeout_s)
    except subprocess.TimeoutExpired:
        return {"probe_error": f"the GPU probe did not finish in {ctx.gpu_timeout_s:g}s (a hung driver?)"}
    except OSError as e:
        return {"probe_error": f"cannot start the GPU probe: {e}"}
    for line in reversed(p.stdout.splitlines()):  # drivers may print to stdout; the JSON is our last line
        if line.startswith("{"):
            try:
                return json.loads(line)
            except ValueError:
                break
    err = p.stderr.strip().splitlines()
    return {"probe_error": f"the GPU probe {_exit_words(p.returncode)}: {err[-1] if err else 'no output'}"}


def _exit_words(returncode: int) -> str:
    """'was killed by SIGBUS (signal 7)' rather than 'exited with -7'."""
    if returncode >= 0:
        return f"exited with status {returncode}"
    try:
        name = signal.Signals(-returncode).name
    except ValueError:
        name = "an unknown signal"
    return f"was killed by {name} (signal {-returncode})"


def _gpu_nodes() -> list[str]:
    """The GPU device nodes (/dev/nvidia0, ...), not the control nodes (nvidiactl, nvidia-uvm)."""
    return [n for n in _device_nodes() if n[6:].isdigit()]


def _device_nodes() -> list[str]:
    try:
        return sorted(n for n in os.listdir("/dev") if n.startswith("nvidia"))
    except OSError:
        return []


def check_gpus(ctx: Context) -> Result:
    nodes = _device_nodes()
    gpu_nodes = _gpu_nodes()
    g = ctx.gpu()
    vis = [f"{k.upper()}={g[k]}" for k in ("cuda_visible_devices", "nvidia_visible_devices") if g.get(k) is not None]
    vis_s = f" ({', '.join(vis)})" if vis else ""
    if "probe_error" in g:
        return Result("gpus", FAIL if gpu_nodes else SKIP, g["probe_error"],
                      "check the driver with nvidia-smi" if gpu_nodes else "")
    if "torch_error" in g:
        if gpu_nodes:
            return Result("gpus", WARN, f"NVIDIA devices {', '.join(gpu_nodes)} are present but torch cannot be "
                          f"imported ({g['torch_error']}); kvoffd will serve CPU engines only",
                          "pip install 'kvoffd[cuda]' in kvoffd's environment")
        return Result("gpus", SKIP, f"no GPU: no /dev/nvidia[0-9]* device and torch is not installed{vis_s}")
    if not g.get("torch_cuda"):
        if gpu_nodes:
            return Result("gpus", WARN, f"NVIDIA devices are present but torch {g.get('torch')} is a CPU build; "
                          "kvoffd will serve CPU engines only", "install a CUDA build of torch: pip install 'kvoffd[cuda]'")
        return Result("gpus", SKIP, f"no GPU: torch {g.get('torch')} is a CPU build and no /dev/nvidia[0-9]* "
                      f"device exists{vis_s}")
    if not g.get("available"):
        why = g.get("init_error", "torch.cuda.is_available() is False")
        if gpu_nodes:
            return Result("gpus", FAIL, f"devices {', '.join(gpu_nodes)} exist but CUDA does not start: {why}{vis_s}",
                          "check nvidia-smi; the driver must be at least as new as torch's CUDA "
                          f"{g.get('torch_cuda')}; in a container, start it with GPU access (--gpus / the nvidia "
                          "runtime class / a CDI device)")
        return Result("gpus", SKIP, f"no GPU visible: {why}; no /dev/nvidia[0-9]* device{vis_s}",
                      "" if not nodes else "the container sees /dev/nvidiactl but no GPU: give it GPU access")
    gpus = g.get("gpus", [])
    lines = [f"{x['index']}: {x.get('name', '?')} {x.get('uuid') or '(no uuid)'} at {x.get('bus_id') or '?'}"
             for x in gpus]
    broken = [x for x in gpus if "error" in x]
    detail = f"{len(gpus)} visible{vis_s}: " + "; ".join(lines)
    if broken:
        return Result("gpus", FAIL, detail + "; " + "; ".join(f"GPU {x['index']}: {x['error']}" for x in broken),
                      "check nvidia-smi and dmesg for Xid errors")
    return Result("gpus", PASS, detail + ". Engines are matched to these by UUID, so the daemon must see every "
                  "GPU its engines use (ordinals may differ)")


def _gpu_skip(ctx: Context, name: str) -> Result | None:
    g = ctx.gpu()
    if "probe_error" in g:
        return Result(name, SKIP, "the GPU probe did not run: " + g["probe_error"])
    if not g.get("available") or not g.get("gpus"):
        return Result(name, SKIP, "no usable GPU (see the gpus line)")
    return None


def check_ipc(ctx: Context) -> Result:
    if not ctx.ipc:
        return Result("cuda-ipc", SKIP, "--no-ipc given")
    skip = _gpu_skip(ctx, "cuda-ipc")
    if skip:
        return skip
    bad, good = [], []
    for x in ctx.gpu()["gpus"]:
        r = x.get("ipc") or {"ok": False, "error": x.get("error", "not run")}
        (good if r.get("ok") else bad).append((x["index"], r))
    if bad:
        return Result("cuda-ipc", FAIL, "; ".join(f"GPU {i}: {r.get('error')}" for i, r in bad),
                      "in containers the engine and kvoffd must share a PID namespace (docker: --pid=container:<kvoffd>"
                      " or --pid=host; Kubernetes: shareProcessNamespace in one pod, hostPID across pods) and see "
                      "the same GPUs; memory from cuMemCreate/expandable_segments has no legacy IPC handle")
    opened = ", ".join(f"GPU {i} in {r.get('open_s', 0) * 1000:.0f} ms" for i, r in good)
    return Result("cuda-ipc", PASS, f"memory and event handles made by a child process opened and read back: {opened}")


def check_bandwidth(ctx: Context) -> Result:
    if ctx.bandwidth_bytes <= 0:
        return Result("bandwidth", SKIP, "--bandwidth-size 0 given")
    skip = _gpu_skip(ctx, "bandwidth")
    if skip:
        return skip
    parts, slow = [], []
    for x in ctx.gpu()["gpus"]:
        bw, link = x.get("bandwidth"), x.get("link") or {}
        if not bw:
            parts.append(f"GPU {x['index']}: not measured ({x.get('error', '?')})")
            slow.append(x["index"])
            continue
        ceiling = (link.get("max") or {}).get("gbps")
        cur = link.get("current") or {}
        lk = ""
        if ceiling:
            mx = link["max"]
            lk = f" vs PCIe {mx['gts']:g} GT/s x{mx['width']} = {ceiling:g} GB/s"
            if cur and (cur.get("gts"), cur.get("width")) != (mx["gts"], mx["width"]):
                lk += f" (trained now at {cur['gts']:g} GT/s x{cur['width']})"
            if min(bw["h2d"], bw["d2h"]) < BANDWIDTH_RATIO_WARN * ceiling:
                slow.append(x["index"])
        numa = link.get("numa_node")
        numa_s = f", NUMA node {numa}" if numa not in (None, "", "-1") else ""
        parts.append(f"GPU {x['index']}: h2d {bw['h2d']:g} GB/s, d2h {bw['d2h']:g} GB/s{lk}{numa_s}")
    detail = "; ".join(parts) + f" (pinned host memory, {format_size(ctx.bandwidth_bytes)} copies)"
    if slow:
        return Result("bandwidth", WARN, detail + f"; GPU {', '.join(map(str, slow))} below "
                      f"{BANDWIDTH_RATIO_WARN:.0%} of its link",
                      "run kvoffd on the GPU's NUMA node (numactl --cpunodebind=N --membind=N, or CPUAffinity= and "
                      "NUMAPolicy= in the unit); check for a link trained below its maximum (lspci -vv: LnkSta), "
                      "IOMMU in translated mode (iommu=pt), and other traffic on the same switch")
    return Result("bandwidth", PASS, detail)


def check_pool(ctx: Context) -> Result:
    """The pool file a warm restart needs (kvoffd/ops/doctor_pool.py)."""
    from kvoffd.ops.doctor_pool import check_pool_file

    return Result("pool-file", *check_pool_file(ctx))


CHECKS: list[Callable[[Context], Result]] = [
    check_memlock, check_shm, check_hugepages, check_memory, check_pool, check_socket_dir, check_daemon,
    check_gpus, check_ipc, check_bandwidth,
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
    p.add_argument("--pool-size", default=None,
                   help="pool size to check against (default: $KVOFFD_POOL_SIZE, else the daemon's default)")
    p.add_argument("--address", default=None,
                   help="daemon address whose socket directory to check (default: $KVOFFD_ADDRESS, else the "
                        "daemon's default)")
    p.add_argument("--pool-path", default=None,
                   help="pool file to check (default: $KVOFFD_POOL_PATH, else the daemon's default)")
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
        if args.pool_size or os.environ.get("KVOFFD_POOL_SIZE"):
            src = "--pool-size" if args.pool_size else "KVOFFD_POOL_SIZE"
            pool = parse_size(args.pool_size or os.environ["KVOFFD_POOL_SIZE"])
        else:
            src, pool = "the default", default_pool_size()
        bw = 0 if args.bandwidth_size.strip() in ("0", "off") else parse_size(args.bandwidth_size)
    except ConfigError as e:
        parser.error(str(e))
    ctx = Context(pool_size=pool, pool_size_source=src,
                  address=args.address or os.environ.get("KVOFFD_ADDRESS") or default_address(),
                  bandwidth_bytes=bw, ipc=not args.no_ipc, gpu_timeout_s=args.gpu_timeout,
                  pool_path=args.pool_path or os.environ.get("KVOFFD_POOL_PATH", ""))
    results = run_checks(ctx)
    if args.json:
        print(json.dumps({"results": [asdict(r) for r in results], "gpu_probe": ctx._gpu}, indent=2))
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
