"""One metrics interface. Sinks: a JSON-lines file, TensorBoard, Weights & Biases and MLflow
(:mod:`rollart_core.trackers`), and the console: a live display on an interactive terminal
(:class:`rollart_core.console.LiveSink`), else a plain line per step."""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol, TextIO

if TYPE_CHECKING:
    from rollart_core.config import RunConfig

__all__ = [
    "ConsoleSink",
    "JsonlSink",
    "MemorySink",
    "MetricsSink",
    "MultiSink",
    "TensorBoardSink",
    "default_sinks",
    "since_process_start",
]


def since_process_start() -> float | None:
    """Seconds since this process started (Linux ``/proc``; None elsewhere): start-up phases are
    measured from the command, imports included, not from when the loop began."""
    try:
        with open("/proc/self/stat") as f:
            start_ticks = int(f.read().rpartition(")")[2].split()[19])
        with open("/proc/uptime") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return uptime - start_ticks / os.sysconf("SC_CLK_TCK")


class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    def __init__(self, path: str | Path, first_step: int | None = None) -> None:
        """Append to ``path``; ``first_step`` (a resumed run): first drop the rows of that step and
        later ones, which the run is about to write again."""
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if first_step is not None and self.path.is_file():
            kept = [
                line
                for line in self.path.read_text(encoding="utf-8").splitlines(keepends=True)
                if _row_step(line) < first_step
            ]
            tmp = self.path.with_name(self.path.name + ".tmp")
            tmp.write_text("".join(kept), encoding="utf-8")
            tmp.replace(self.path)
        self._f = open(self.path, "a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self._f.write(json.dumps({"step": step, **metrics}, default=str) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


def _row_step(line: str) -> float:
    try:
        return float(json.loads(line).get("step", float("inf")))
    except (ValueError, AttributeError):
        return float("inf")  # a torn last line: drop it


class TensorBoardSink:
    """Scalars (and nested dicts of scalars, e.g. fates) as TensorBoard events (``tensorboardX``)."""

    def __init__(self, logdir: str | Path) -> None:
        from rollart_core.extras import require

        tbx = require("tensorboardX", "pip install 'rollart-core[tensorboard]'")
        self._w = tbx.SummaryWriter(str(logdir))

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for k, v in metrics.items():
            if isinstance(v, dict):
                for kk, vv in v.items():
                    if isinstance(vv, (int, float)):
                        self._w.add_scalar(f"{k}/{kk}", vv, step)
            elif isinstance(v, (int, float)) and not isinstance(v, bool):
                self._w.add_scalar(k, v, step)
        self._w.flush()

    def close(self) -> None:
        self._w.close()


def default_sinks(
    out_dir: Path,
    console_keys: list[str],
    first_step: int | None = None,
    total_steps: int | None = None,
    config: RunConfig | None = None,
) -> MultiSink:
    """JSON lines + the backends of ``config.logging`` + the console: a live display (step
    k/``total_steps``, ETA, …) when stdout is an interactive terminal and ``rich`` is installed, else a
    plain line per step. ``first_step``: a resumed run's first step (earlier rows of ``metrics.jsonl``
    are kept, the rest dropped). Backends: TensorBoard (by default when ``tensorboardX`` is
    installed), W&B and MLflow (:mod:`rollart_core.trackers`: those of an enclosing
    :func:`~rollart_core.trackers.tracking` block, else started here)."""
    sinks: list[MetricsSink] = [JsonlSink(out_dir / "metrics.jsonl", first_step)]
    backends = config.logging.backends if config is not None else ["tensorboard"]
    if "tensorboard" in backends:
        try:
            sinks.append(TensorBoardSink(out_dir / "tensorboard"))
        except ImportError:
            if config is not None and "backends" in config.logging.model_fields_set:
                raise  # chosen by name: say what to install
            # else an optional extra; the JSON lines carry the same numbers
    if config is not None and set(backends) - {"tensorboard"}:
        from rollart_core.trackers import Trackers, active_trackers

        trackers = active_trackers() or Trackers.start(config)
        if trackers is not None:
            sinks.append(trackers)
    from rollart_core.console import LiveSink, wants_live

    sinks.append(LiveSink(total_steps, first_step or 1) if wants_live() else ConsoleSink(console_keys))
    return MultiSink(*sinks)


class ConsoleSink:
    """Prints the keys it is given, in order, as ``key=value``; then the step's warnings, summarised
    (when ``rollart train`` counts them: :func:`rollart_core.console.route_logs`)."""

    def __init__(self, keys: list[str], stream: TextIO | None = None) -> None:
        self.keys = keys
        self.stream = stream or sys.stdout

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        parts = [f"step {step:>3}"]
        for k in self.keys:
            if k in metrics:
                v = metrics[k]
                parts.append(f"{k}={v:.3f}" if isinstance(v, float) else f"{k}={v}")
        print("  ".join(parts), file=self.stream, flush=True)
        from rollart_core.console import active_tally

        tally = active_tally()
        for line in tally.drain() if tally is not None else []:
            print(f"  warnings: {line}", file=self.stream, flush=True)

    def close(self) -> None:
        pass


class MemorySink:
    """Keeps every row in ``rows`` (``{"step": step, **metrics}``): for benchmarks and tools."""

    def __init__(self) -> None:
        self.rows: list[dict[str, Any]] = []

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self.rows.append({"step": step, **metrics})

    def close(self) -> None:
        pass


class MultiSink:
    def __init__(self, *sinks: MetricsSink) -> None:
        self.sinks = sinks

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        for s in self.sinks:
            s.log(step, metrics)

    def close(self) -> None:
        for s in self.sinks:
            s.close()
