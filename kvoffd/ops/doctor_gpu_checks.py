"""``kvoffd doctor``'s GPU checks (gpus, cuda-ipc, bandwidth): run the probe in a child process
(kvoffd/ops/doctor_gpu.py) with a deadline, and judge its findings. A probe that hangs or crashes
is a result line, never a traceback.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from typing import Any

from kvoffd.ops import doctor_host
from kvoffd.ops.doctor_result import FAIL, PASS, SKIP, WARN, Context, Result
from kvoffd.units import format_size

BANDWIDTH_RATIO_WARN = 0.6  # achieved / link ceiling below this is worth a look


def gpu_findings(ctx: Context) -> dict[str, Any]:
    """The GPU probe's findings, run once per context in a child process (see doctor_gpu)."""
    if ctx.gpu_probe is None:
        ctx.gpu_probe = run_gpu_probe(ctx)
    return ctx.gpu_probe


def run_gpu_probe(ctx: Context) -> dict[str, Any]:
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


def check_gpus(ctx: Context) -> Result:
    nodes = doctor_host.device_nodes()
    gpu_nodes = doctor_host.gpu_nodes()
    g = gpu_findings(ctx)
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
    g = gpu_findings(ctx)
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
    for x in gpu_findings(ctx)["gpus"]:
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
    for x in gpu_findings(ctx)["gpus"]:
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
