"""One metrics interface. Sinks: a JSON-lines file and a one-line console summary per step."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any, Protocol, TextIO

__all__ = ["ConsoleSink", "JsonlSink", "MetricsSink", "MultiSink"]


class MetricsSink(Protocol):
    def log(self, step: int, metrics: dict[str, Any]) -> None: ...

    def close(self) -> None: ...


class JsonlSink:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "a", encoding="utf-8")

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        self._f.write(json.dumps({"step": step, **metrics}, default=str) + "\n")
        self._f.flush()

    def close(self) -> None:
        self._f.close()


class ConsoleSink:
    """Prints the keys it is given, in order, as ``key=value``."""

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
