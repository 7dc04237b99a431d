"""``kvoffd doctor``'s host checks: the memory the pool needs (RAM, the cgroup's limit, RLIMIT_MEMLOCK),
/dev/shm for CPU engines' KV cache, and huge pages; and which NVIDIA device nodes /dev shows (the
memlock check and the GPU checks both ask).
"""

from __future__ import annotations

import os
import resource

from kvoffd.ops.doctor_result import FAIL, PASS, SKIP, WARN, Context, Result, read_text
from kvoffd.units import format_size

SHM_MIN = 1 << 30  # below this a CPU engine's KV cache (which lives in /dev/shm) barely fits


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


def gpu_nodes() -> list[str]:
    """The GPU device nodes (/dev/nvidia0, ...), not the control nodes (nvidiactl, nvidia-uvm)."""
    return [n for n in device_nodes() if n[6:].isdigit()]


def device_nodes() -> list[str]:
    try:
        return sorted(n for n in os.listdir("/dev") if n.startswith("nvidia"))
    except OSError:
        return []


def check_memlock(ctx: Context) -> Result:
    soft, hard = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    if not gpu_nodes():
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
    thp = read_text("/sys/kernel/mm/transparent_hugepage/enabled")
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
    for line in read_text("/proc/self/cgroup").splitlines():
        if line.startswith("0::"):
            rel = line[3:]
    for base in (f"/sys/fs/cgroup{rel}", "/sys/fs/cgroup"):
        lim = read_text(f"{base}/memory.max")
        if lim:
            use = read_text(f"{base}/memory.current")
            return (None if lim == "max" else int(lim)), (int(use) if use.isdigit() else None)
    lim = read_text("/sys/fs/cgroup/memory/memory.limit_in_bytes")
    use = read_text("/sys/fs/cgroup/memory/memory.usage_in_bytes")
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
