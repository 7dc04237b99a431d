"""`kvoffd`: start the daemon (and `kvoffd doctor`, `kvoffd purge`)."""

from __future__ import annotations

import asyncio
import errno
import logging
import signal
import sys

from kvoffd import sdnotify
from kvoffd.config import Config, ConfigError, check_pool_fits, check_pool_geometry, load_config
from kvoffd.hostmem import pool_memory_problem, read_memory_view
from kvoffd.units import format_size


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["doctor"]:
        from kvoffd.ops.doctor import main as doctor_main

        return doctor_main(argv[1:])
    if argv[:1] == ["purge"]:
        from kvoffd.purge import main as purge_main

        return purge_main(argv[1:])
    try:
        cfg = load_config(argv)
        pool_warning = check_pool_fits(cfg.pool_size)
        check_pool_geometry(cfg.pool_size)
        refusal, short = pool_memory_problem(cfg.pool_size, read_memory_view())
        if refusal:
            raise ConfigError(refusal)
        pool_warning = pool_warning or short
    except ConfigError as e:
        print(f"kvoffd: {e}", file=sys.stderr)
        return 2
    if cfg.backend in ("auto", "cuda"):
        _start_cuda_driver()
    logging.basicConfig(level=cfg.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if pool_warning:
        logging.getLogger("kvoffd").warning("%s", pool_warning)
    for notice in cfg.notices:
        logging.getLogger("kvoffd").warning("%s", notice)
    from kvoffd.server.fdbudget import raise_nofile_limit

    before, after = raise_nofile_limit()  # before the daemon sizes its descriptor budget
    logging.getLogger("kvoffd").info("file descriptor limit %d (soft limit was %d)", after, before)
    try:
        import uvloop
    except ImportError:
        uvloop = None
    if uvloop is not None:
        return uvloop.run(_serve(cfg))
    return asyncio.run(_serve(cfg))


def _start_cuda_driver() -> None:
    """Load and initialise the CUDA driver (cuInit, device 0's primary context) in a thread while the
    daemon imports its modules, so that the pinning of a warm restart's pool does not wait for it after
    them (a large part of a second on a GPU host: docs/benchmarks.md, run N; ctypes calls release the
    GIL, so the imports go on). No GPU or no driver: the error is kept, and the CUDA backend reports
    it at start."""
    import threading

    from kvoffd.transfer import cuda_driver

    def init() -> None:
        try:
            cuda_driver.driver().use_device(0)
        except (cuda_driver.CudaUnavailable, cuda_driver.CudaError):
            pass  # kept by cuda_driver (or met again at use_device): the CUDA backend reports it at start

    threading.Thread(target=init, name="kvoffd-cuda-init", daemon=True).start()


async def _serve(cfg: Config) -> int:
    """Build, bind and run the daemon until SIGINT/SIGTERM; 1 if it cannot start."""
    from kvoffd.server.endpoint import AddressInUse
    from kvoffd.server.loop import Server

    try:
        daemon = Server(cfg)  # a failure inside gives back what it made (Server.abandon)
    except (AddressInUse, OSError, RuntimeError, MemoryError) as e:
        logging.getLogger("kvoffd").error("cannot start: %s", e)
        return 1
    try:
        daemon.bind()
    except (AddressInUse, OSError, RuntimeError, MemoryError) as e:
        daemon.abandon()
        logging.getLogger("kvoffd").error("cannot start: %s", e)
        return 1
    except BaseException:
        daemon.abandon()
        raise
    loop = asyncio.get_running_loop()

    def stop() -> None:
        sdnotify.stopping(f"draining {daemon.jobs_in_flight} jobs")
        daemon.stop()

    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop)
    http = None
    hp = cfg.metrics_host_port
    if hp is not None:
        from kvoffd.server.http import start_http

        try:
            http = await start_http(daemon, *hp)
        except OSError as e:
            hint = ""
            if e.errno == errno.EADDRINUSE:
                hint = ("; another process (another kvoffd?) listens there: choose another port with "
                        "--metrics-address HOST:PORT (port 0 takes any free one), or turn metrics off with "
                        "--metrics-address none")
            daemon.abandon()
            logging.getLogger("kvoffd").error("cannot serve metrics on %s: %s%s", cfg.metrics_address, e, hint)
            return 1
        port = http.port
        daemon.metrics_address = f"{hp[0]}:{port}"
        logging.getLogger("kvoffd").info("metrics on http://%s:%d/metrics", hp[0], port)

    def ready() -> None:
        from kvoffd_client.vllm.launch import vllm_serve_argument

        logging.getLogger("kvoffd").info("for vLLM: vllm serve MODEL %s", vllm_serve_argument(daemon.bound_address))
        sdnotify.ready(f"serving on {daemon.bound_address}; pool {format_size(daemon.pool.nbytes)}, "
                       f"backends {','.join(b.name for b in daemon.backends)}")

    try:
        await daemon.serve(on_ready=ready)
    finally:
        if http is not None:
            http.close()
    return 0
