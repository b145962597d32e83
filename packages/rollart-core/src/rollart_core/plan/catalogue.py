"""Hardware catalogue for the planner: what each class of machine can do and what it costs.

Numbers are per device, from public spec sheets (dense BF16 tensor FLOP/s without sparsity, HBM
bandwidth and capacity). Prices are rough on-demand cloud prices in USD per device-hour (late
2025 market level) and are the part users most often change: pass ``--catalogue file.yaml`` to
``rollart plan`` with your own (same schema: a mapping ``name → HardwareClass`` fields).
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from rollart_core.config import read_yaml_mapping
from rollart_core.errors import ConfigError, validation_details

__all__ = ["DEFAULT_CATALOGUE", "HardwareClass", "load_catalogue"]


class HardwareClass(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True, frozen=True)

    kind: Literal["gpu", "cpu", "serverless"] = "gpu"
    flops: float = Field(0.0, ge=0)
    """Peak dense BF16 FLOP/s of one device (GPU) or node (CPU)."""
    mem_bw: float = Field(0.0, ge=0)
    """Memory bandwidth, bytes/s."""
    mem_bytes: float = Field(0.0, ge=0)
    """Device memory (GPU) or node RAM (CPU), bytes."""
    price_per_hour: float = Field(gt=0)
    """USD per device-hour (GPU), node-hour (CPU); serverless: USD per vCPU-hour of execution."""
    mfu: float = Field(0.5, gt=0, le=1)
    """Fraction of peak FLOP/s reached in prefill (and compute-bound decode)."""
    bw_util: float = Field(0.7, gt=0, le=1)
    """Fraction of peak bandwidth reached by decode."""
    cpus: int = Field(0, ge=0)
    """CPU nodes: cores (environments run one per core by default)."""
    max_concurrency: int = Field(1000, ge=1)
    """Serverless: concurrent invocations the platform allows."""


_T, _G = 1e12, 2**30
DEFAULT_CATALOGUE: dict[str, HardwareClass] = {
    # compute-optimised (prefill): H800 = H100 SXM compute with cut NVLink
    "H800": HardwareClass(flops=989 * _T, mem_bw=3.35e12, mem_bytes=80 * _G, price_per_hour=2.2),
    "H100": HardwareClass(flops=989 * _T, mem_bw=3.35e12, mem_bytes=80 * _G, price_per_hour=2.5),
    "H200": HardwareClass(flops=989 * _T, mem_bw=4.8e12, mem_bytes=141 * _G, price_per_hour=3.5),
    "A100": HardwareClass(flops=312 * _T, mem_bw=2.039e12, mem_bytes=80 * _G, price_per_hour=1.3),
    # bandwidth-optimised (decode): little compute, a lot of HBM bandwidth for its price
    "H20": HardwareClass(flops=148 * _T, mem_bw=4.0e12, mem_bytes=96 * _G, price_per_hour=0.9),
    "CPU": HardwareClass(
        kind="cpu", flops=4 * _T, mem_bw=0.3e12, mem_bytes=512 * _G, price_per_hour=1.6, cpus=64
    ),
    "serverless": HardwareClass(kind="serverless", price_per_hour=0.06, max_concurrency=1000),
}


def load_catalogue(path: str | Path | None = None) -> dict[str, HardwareClass]:
    """The default catalogue, with entries from ``path`` (YAML/JSON mapping) added or replaced."""
    cat = dict(DEFAULT_CATALOGUE)
    if path is None:
        return cat
    p = Path(path)
    raw = read_yaml_mapping(p, "catalogue")  # a mapping of hardware class name → fields
    for name, fields in raw.items():
        try:
            cat[str(name)] = HardwareClass.model_validate(fields)
        except ValidationError as exc:
            errs = "; ".join(validation_details(exc))
            raise ConfigError(f"{p}: hardware class {name!r}: {errs}") from None
    return cat
