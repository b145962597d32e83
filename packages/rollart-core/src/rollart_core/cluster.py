"""Start (or join) a Ray cluster on loopback, and shut down only what we started."""

from __future__ import annotations

import logging
import os
from types import TracebackType
from typing import Any

from rollart_core.config import RayConfig
from rollart_core.extras import require

__all__ = ["LOOPBACK_ENV", "RayCluster"]

log = logging.getLogger(__name__)

# Keep Ray on 127.0.0.1, stop it copying the uv venv into every session, silence the token warning.
LOOPBACK_ENV = {
    "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0",
    "RAY_ENABLE_UV_RUN_RUNTIME_ENV": "0",
    "RAY_AUTH_MODE": "disabled",
    "RAY_USAGE_STATS_ENABLED": "0",
}


class RayCluster:
    """``with RayCluster(cfg):`` — ``ray.init`` on 127.0.0.1 unless Ray is already initialised."""

    def __init__(self, config: RayConfig | None = None) -> None:
        self.config = config or RayConfig()
        self.started = False

    def __enter__(self) -> RayCluster:
        for k, v in LOOPBACK_ENV.items():
            os.environ.setdefault(k, v)
        ray = require("ray", "pip install 'rollart-core[ray]'")
        if ray.is_initialized():
            return self
        kwargs: dict[str, Any] = {"include_dashboard": False, "log_to_driver": True}
        if self.config.address:
            kwargs["address"] = self.config.address
        else:
            kwargs.update(_node_ip_address="127.0.0.1", resources=dict(self.config.resources))
            if self.config.num_cpus is not None:
                kwargs["num_cpus"] = self.config.num_cpus
        ray.init(**kwargs)
        self.started = True
        return self

    def __exit__(self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None) -> None:
        if self.started:
            import ray

            ray.shutdown()
            self.started = False
