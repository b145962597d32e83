"""Start (or join) a Ray cluster on loopback, and shut down only what we started."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from pathlib import Path
from types import TracebackType
from typing import Any

from rollart_core.config import RayConfig
from rollart_core.extras import require
from rollart_core.watchdog import guard_driver

__all__ = ["LOOPBACK_ENV", "RayCluster", "worker_logs_to"]

log = logging.getLogger(__name__)

# Keep Ray on 127.0.0.1, stop it copying the uv venv into every session, silence the token warning.
LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}


_worker_log_link: Path | None = None


def worker_logs_to(link: Path | None) -> None:
    """Process-wide (the CLI calls it): Ray workers' output (engines, trainer ranks, env workers) is
    not printed by the driver (``log_to_driver=False``) but stays in Ray's session log folder, and
    ``link`` (e.g. ``<output_dir>/logs/ray``) is made a symlink to that folder when this process
    starts Ray, so it can be found from the run directory. None: print it on the driver (the default)."""
    global _worker_log_link
    _worker_log_link = link


def _link_worker_logs(ray: Any, link: Path) -> None:
    try:
        logs = Path(ray._private.worker._global_node.get_logs_dir_path())  # no public API for this
    except Exception as exc:  # the output is still in Ray's temp dir, only not linked
        log.warning("cannot find Ray's log folder to link it at %s: %r", link, exc)
        return
    link.parent.mkdir(parents=True, exist_ok=True)
    if link.is_symlink() or link.exists():
        link.unlink()
    link.symlink_to(logs, target_is_directory=True)
    log.info("Ray workers' logs (engines, trainer ranks): %s -> %s", link, logs)


class RayCluster:
    """``with RayCluster(cfg):`` — ``ray.init`` on 127.0.0.1 unless Ray is already initialised.

    Before it starts (or joins) Ray, the driver's watchdog is started (:func:`~rollart_core.watchdog.guard_driver`):
    whatever the run starts from here on (Ray's processes, the engines' subprocesses, the reward
    runtime, Mooncake) is stopped by it when the driver dies, SIGKILL included. Ray 2.60 lets
    ``ray.init`` turn off only the dashboard's web UI (``include_dashboard=False``: a minimal API server
    still runs); the autoscaler monitor, the log monitor and the raylet's dashboard and runtime-env
    agents always start, and the watchdog covers them."""

    def __init__(self, config: RayConfig | None = None) -> None:
        self.config = config or RayConfig()
        self.started = False
        self.start_s = 0.0
        """Seconds ``ray.init`` took (0 when joining an initialised Ray)."""

    def __enter__(self) -> RayCluster:
        for k, v in LOOPBACK_ENV.items():
            os.environ.setdefault(k, v)
        ray = require("ray", "pip install 'rollart-core[ray]'")
        if ray.is_initialized():
            return self
        try:
            guard_driver()
        except OSError as exc:  # the run goes on; only a SIGKILLed driver would leave processes behind
            log.warning("no watchdog for this driver (%s): a killed driver may leave processes behind", exc)
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": _worker_log_link is None}
        if self.config.address:
            kwargs["address"] = self.config.address
        else:
            kwargs.update(
                _node_ip_address="127.0.0.1",
                resources=dict(self.config.resources),
                _system_config={"worker_niceness": self.config.worker_niceness},
            )
            if self.config.num_cpus is not None:
                kwargs["num_cpus"] = self.config.num_cpus
        t0 = time.perf_counter()
        main = threading.current_thread() is threading.main_thread()
        sigterm = signal.getsignal(signal.SIGTERM) if main else None
        ray.init(**kwargs)
        if callable(sigterm):  # ray.init takes SIGTERM over (exit at once, its agents left behind):
            signal.signal(signal.SIGTERM, sigterm)  # the application's own handler goes back
        self.start_s = time.perf_counter() - t0
        self.started = True
        if _worker_log_link is not None:
            _link_worker_logs(ray, _worker_log_link)
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self.started:
            import ray

            ray.shutdown()
            self.started = False
