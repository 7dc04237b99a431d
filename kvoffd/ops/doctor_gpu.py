"""The GPU half of ``kvoffd doctor``, run in a child process.

Why a child: initialising CUDA can hang, abort or print driver noise on a broken host, and a CUDA
context must not exist in the process that later forks. The parent (kvoffd/ops/doctor_gpu_checks.py) runs
``python -m kvoffd.ops.doctor_gpu probe`` with a deadline and reads one JSON document from its stdout;
whatever happens here, the parent reports it as a check result, never as a traceback.

The IPC check is the real thing kvoffd does with an engine: a *separate process* (``export``) makes a
``cudaMalloc`` allocation and an interprocess event, hands out their IPC handles, and this process
opens both with the raw runtime API (``cudaIpcOpenMemHandle`` / ``cudaIpcOpenEventHandle``) and reads
the bytes back. A handle cannot be opened by the process that made it, hence the second child.
The runtime library is the one torch already loaded (found by soname), so no CUDA toolkit is needed.
"""

from __future__ import annotations

import ctypes
import json
import os
import subprocess
import sys
import time
from typing import Any

from kvoffd.ops.doctor_result import read_text

PATTERN = 0x5A
IPC_BYTES = 1 << 20
_CUDA_IPC_LAZY_ENABLE_PEER_ACCESS = 1
_EVENT_DISABLE_TIMING = 0x2
_EVENT_INTERPROCESS = 0x4
_MEMCPY_D2H = 2


class _IpcHandle(ctypes.Structure):
    """cudaIpcMemHandle_t and cudaIpcEventHandle_t: 64 opaque bytes, passed by value."""

    _fields_ = [("reserved", ctypes.c_char * 64)]


def _cudart() -> ctypes.CDLL:
    """The CUDA runtime torch loaded (dlopen by soname finds an already-loaded library first)."""
    import torch

    torch.cuda.init()
    major = (torch.version.cuda or "12").split(".")[0]
    errors = []
    for name in (f"libcudart.so.{major}", "libcudart.so.13", "libcudart.so.12", "libcudart.so.11.0", "libcudart.so"):
        try:
            lib = ctypes.CDLL(name)
        except OSError as e:
            errors.append(str(e))
            continue
        lib.cudaGetErrorString.restype = ctypes.c_char_p
        lib.cudaIpcOpenMemHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcHandle, ctypes.c_uint]
        lib.cudaIpcOpenEventHandle.argtypes = [ctypes.POINTER(ctypes.c_void_p), _IpcHandle]
        return lib
    raise OSError("no CUDA runtime library found: " + "; ".join(errors))


def _check(lib: ctypes.CDLL, rc: int, what: str) -> None:
    if rc != 0:
        raise RuntimeError(f"{what} failed: {lib.cudaGetErrorString(rc).decode()} (error {rc})")


# --------------------------------------------------------------------------------------------------
# The exporter child


def export(device: int) -> None:
    """Allocate, fill, export; print the handles as one JSON line; hold them until stdin closes."""
    lib = _cudart()
    _check(lib, lib.cudaSetDevice(device), "cudaSetDevice")
    ptr = ctypes.c_void_p()
    _check(lib, lib.cudaMalloc(ctypes.byref(ptr), ctypes.c_size_t(IPC_BYTES)), "cudaMalloc")
    _check(lib, lib.cudaMemset(ptr, PATTERN, ctypes.c_size_t(IPC_BYTES)), "cudaMemset")
    ev = ctypes.c_void_p()
    _check(lib, lib.cudaEventCreateWithFlags(ctypes.byref(ev), _EVENT_DISABLE_TIMING | _EVENT_INTERPROCESS),
           "cudaEventCreateWithFlags(interprocess)")
    _check(lib, lib.cudaEventRecord(ev, None), "cudaEventRecord")
    _check(lib, lib.cudaDeviceSynchronize(), "cudaDeviceSynchronize")
    mh, eh = _IpcHandle(), _IpcHandle()
    _check(lib, lib.cudaIpcGetMemHandle(ctypes.byref(mh), ptr), "cudaIpcGetMemHandle")
    _check(lib, lib.cudaIpcGetEventHandle(ctypes.byref(eh), ev), "cudaIpcGetEventHandle")
    sys.stdout.write(json.dumps({"mem": bytes(mh).hex(), "event": bytes(eh).hex(), "pid": os.getpid()}) + "\n")
    sys.stdout.flush()
    sys.stdin.readline()  # the importer has closed its mapping (the driver requires that order)
    lib.cudaEventDestroy(ev)
    lib.cudaFree(ptr)


def _ipc_check(lib: ctypes.CDLL, device: int, timeout_s: float) -> dict[str, Any]:
    child = subprocess.Popen([sys.executable, "-m", "kvoffd.ops.doctor_gpu", "export", str(device)],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = _readline(child, timeout_s)
        if not line:
            child.kill()
            err = child.communicate(timeout=5)[1].strip().splitlines()
            return {"ok": False, "error": "exporter failed: " + (err[-1] if err else f"exit {child.returncode}")}
        handles = json.loads(line)
        _check(lib, lib.cudaSetDevice(device), "cudaSetDevice")
        t0 = time.perf_counter()
        ptr = ctypes.c_void_p()
        mem_handle = _IpcHandle.from_buffer_copy(bytes.fromhex(handles["mem"]))
        event_handle = _IpcHandle.from_buffer_copy(bytes.fromhex(handles["event"]))
        _check(lib, lib.cudaIpcOpenMemHandle(ctypes.byref(ptr), mem_handle, _CUDA_IPC_LAZY_ENABLE_PEER_ACCESS),
               "cudaIpcOpenMemHandle")
        ev = ctypes.c_void_p()
        try:
            _check(lib, lib.cudaIpcOpenEventHandle(ctypes.byref(ev), event_handle), "cudaIpcOpenEventHandle")
            _check(lib, lib.cudaEventSynchronize(ev), "cudaEventSynchronize(imported event)")
            host = (ctypes.c_ubyte * IPC_BYTES)()
            _check(lib, lib.cudaMemcpy(host, ptr, ctypes.c_size_t(IPC_BYTES), _MEMCPY_D2H), "cudaMemcpy")
            open_s = time.perf_counter() - t0
            bad = sum(1 for b in bytes(host)[:: 4096] if b != PATTERN)
            if bad:
                return {"ok": False, "error": f"opened, but {bad} sampled bytes differ from what the exporter wrote"}
        finally:
            if ev.value:
                lib.cudaEventDestroy(ev)
            lib.cudaIpcCloseMemHandle(ptr)
        return {"ok": True, "open_s": open_s, "exporter_pid": handles.get("pid")}
    except Exception as e:
        return {"ok": False, "error": str(e)}
    finally:
        if child.poll() is None:
            try:
                child.stdin.write("done\n")
                child.stdin.flush()
                child.wait(timeout=10)
            except (OSError, subprocess.TimeoutExpired):
                child.kill()
                child.wait()


def _readline(child: subprocess.Popen, timeout_s: float) -> str:
    import selectors

    with selectors.DefaultSelector() as sel:
        sel.register(child.stdout, selectors.EVENT_READ)
        if not sel.select(timeout_s):
            return ""
    return child.stdout.readline()


# --------------------------------------------------------------------------------------------------
# PCIe link and bandwidth

#: Usable GB/s per lane for each transfer rate (after line encoding: 8b/10b up to 5 GT/s, then 128b/130b;
#: 64 GT/s uses FLIT mode, 242 of 256 bytes carry data).
_LANE_GBPS = {2.5: 0.25, 5.0: 0.5, 8.0: 0.9846, 16.0: 1.969, 32.0: 3.938, 64.0: 7.563}



def pcie_link(bus_id: str) -> dict[str, Any]:
    """The GPU's PCIe link from sysfs (max and current speed/width) and its ceiling in GB/s per direction."""
    dev = f"/sys/bus/pci/devices/{bus_id.lower()}"
    if not os.path.isdir(dev):
        return {}
    out: dict[str, Any] = {"numa_node": read_text(f"{dev}/numa_node")}
    for kind in ("max", "current"):
        speed = read_text(f"{dev}/{kind}_link_speed")  # "32.0 GT/s PCIe"
        width = read_text(f"{dev}/{kind}_link_width")
        try:
            gts, lanes = float(speed.split()[0]), int(width)
        except (ValueError, IndexError):
            continue
        out[kind] = {"gts": gts, "width": lanes, "gbps": round(_LANE_GBPS.get(gts, gts / 8) * lanes, 1)}
    return out


def _bandwidth(torch: Any, device: int, nbytes: int, reps: int = 5) -> dict[str, float]:
    """Pinned host <-> device copy GB/s (1e9 bytes/s), best of ``reps``, one direction at a time."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=f"cuda:{device}")
    stream = torch.cuda.Stream(device=device)
    out = {}
    with torch.cuda.device(device), torch.cuda.stream(stream):
        for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
            dst.copy_(src, non_blocking=True)  # warm-up
            best = 0.0
            for _ in range(reps):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record(stream)
                dst.copy_(src, non_blocking=True)
                end.record(stream)
                end.synchronize()
                best = max(best, nbytes / (start.elapsed_time(end) / 1e3) / 1e9)
            out[name] = round(best, 1)
    del host, dev
    return out


def _bus_id(props: Any, lib: ctypes.CDLL | None, device: int) -> str:
    if all(hasattr(props, a) for a in ("pci_domain_id", "pci_bus_id", "pci_device_id")):
        return f"{props.pci_domain_id:04x}:{props.pci_bus_id:02x}:{props.pci_device_id:02x}.0"
    if lib is not None:
        buf = ctypes.create_string_buffer(32)
        if lib.cudaDeviceGetPCIBusId(buf, 32, device) == 0:
            return buf.value.decode().lower()
    return ""


def probe(bandwidth_bytes: int, ipc: bool, timeout_s: float) -> dict[str, Any]:
    """Everything the parent reports about GPUs, as plain data."""
    out: dict[str, Any] = {"cuda_visible_devices": os.environ.get("CUDA_VISIBLE_DEVICES"),
                           "nvidia_visible_devices": os.environ.get("NVIDIA_VISIBLE_DEVICES")}
    try:
        import torch
    except Exception as e:  # ImportError, or a broken install raising OSError on a missing .so
        out["torch_error"] = f"{type(e).__name__}: {e}"
        return out
    out["torch"] = torch.__version__
    out["torch_cuda"] = torch.version.cuda
    if not torch.version.cuda:
        return out
    try:
        out["available"] = bool(torch.cuda.is_available())
        if not out["available"]:
            return out
        out["count"] = torch.cuda.device_count()
    except Exception as e:
        out["available"] = False
        out["init_error"] = f"{type(e).__name__}: {e}"
        return out
    try:
        lib = _cudart()
    except Exception as e:
        lib = None
        out["cudart_error"] = str(e)
    gpus = []
    for i in range(out["count"]):
        g: dict[str, Any] = {"index": i}
        try:
            p = torch.cuda.get_device_properties(i)
            g["name"] = p.name
            g["memory_bytes"] = int(p.total_memory)
            uuid = str(getattr(p, "uuid", "") or "")
            g["uuid"] = uuid if not uuid or uuid.startswith(("GPU-", "MIG-")) else "GPU-" + uuid
            g["bus_id"] = _bus_id(p, lib, i)
            g["link"] = pcie_link(g["bus_id"]) if g["bus_id"] else {}
            if bandwidth_bytes > 0:
                g["bandwidth"] = _bandwidth(torch, i, bandwidth_bytes)
                if g["bus_id"]:  # read again now that the link is busy (idle links train down to save power)
                    g["link"] = pcie_link(g["bus_id"])
            if ipc:
                g["ipc"] = _ipc_check(lib, i, timeout_s) if lib is not None else {
                    "ok": False, "error": out.get("cudart_error", "no CUDA runtime")}
        except Exception as e:
            g["error"] = f"{type(e).__name__}: {e}"
        gpus.append(g)
    out["gpus"] = gpus
    return out


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["export"]:
        export(int(argv[1]))
        return 0
    if argv[:1] == ["probe"]:
        bw = int(argv[1]) if len(argv) > 1 else 256 << 20
        ipc = (argv[2] if len(argv) > 2 else "1") == "1"
        timeout_s = float(argv[3]) if len(argv) > 3 else 60.0
        sys.stdout.write(json.dumps(probe(bw, ipc, timeout_s)) + "\n")
        return 0
    sys.stderr.write("usage: python -m kvoffd.ops.doctor_gpu probe [BYTES] [IPC 0|1] [TIMEOUT] | export DEVICE\n")
    return 2


if __name__ == "__main__":
    sys.exit(main())
