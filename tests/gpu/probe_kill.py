"""What an interprocess event does when the process that recorded it dies (run by hand on a GPU).

    python tests/gpu/probe_kill.py [host|device]

An engine records an event behind a ~1 s kernel and is SIGKILLed at once. We then query the event
from this process (host side) or make a stream wait on it (device side), and report what happens
over a few seconds. The CUDA backend's choice of host-side gating rests on this.
"""

from __future__ import annotations

import os
import sys
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "bench"))  # bench/support


def main() -> None:
    from support.standin import Engine, Spec

    from kvoffd.transfer import cuda_driver as cudart

    mode = sys.argv[1] if len(sys.argv) > 1 else "host"
    drv = cudart.driver()
    eng = Engine(Spec(layout="blocks", num_blocks=64))
    info = eng("export")
    drv.use_device(0)
    base = drv.ipc_open_mem_handle(info["memory"].handle)
    ev = drv.ipc_open_event_handle(info["memory"].events[0])
    print("opened", flush=True)
    i = eng("record", sleep_cycles=2_000_000_000)
    assert i == 0
    print("query before kill:", drv.event_query(ev), flush=True)
    t0 = time.perf_counter()
    eng.kill()
    print(f"killed in {time.perf_counter() - t0:.3f} s", flush=True)
    if mode == "device":
        s = drv.stream_create(0)
        drv.stream_wait_event(s, ev)
        done = drv.event_create()
        drv.event_record(done, s)
        ev_check = done
    else:
        ev_check = ev
    for _ in range(50):
        try:
            r = drv.event_query(ev_check)
        except cudart.CudaError as e:
            r = f"error {e}"
        print(f"t={time.perf_counter() - t0:.2f}s query={r}", flush=True)
        if r is True or isinstance(r, str):
            break
        time.sleep(0.1)
    drv.ipc_close_mem_handle(base)
    print("closed the memory handle; alive", flush=True)


if __name__ == "__main__":
    main()
