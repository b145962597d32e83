"""What ``rollart train`` shows on the console, and where everything else goes.

- :func:`route_logs` (the CLI calls it; library code never configures logging): Python logging of
  rollart, vLLM, Ray and everything else at INFO and above goes to ``<output_dir>/logs/rollart.log``;
  ERROR records also reach the console as one line each; WARNING records are counted by
  :class:`WarningTally` and summarised once per step ("12× rollart_env.manager: env … crashed").
  ``verbose``: everything on the console as before, no tally.
- :class:`LiveSink` (a :class:`~rollart_core.metrics.MetricsSink`): a ``rich`` live display for an
  interactive terminal: step k/N with ETA, reward, held-out success, throughput, lag, fates, warnings.
  :class:`~rollart_core.metrics.ConsoleSink` is the plain line per step for pipes and CI.
- :func:`startup_display`: "starting…" with elapsed seconds while the pipeline is built, so the
  first minute is not silent; the :class:`LiveSink` takes the same live region over at step 0/1.
"""

from __future__ import annotations

import contextlib
import logging
import os
import sys
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

__all__ = ["LiveSink", "WarningTally", "active_tally", "route_logs", "startup_display", "wants_live"]

_LOG_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# third-party loggers that install their own console handlers (and stop propagating) when imported
_SELF_CONFIGURED = ("ray", "vllm", "mooncake")
_tally: WarningTally | None = None
_live: Any = None  # the rich Live shared by the start-up display and the LiveSink


def wants_live(stream: Any = None) -> bool:
    """A live display only on an interactive terminal, with ``rich`` installed."""
    stream = stream or sys.stdout
    if not getattr(stream, "isatty", lambda: False)():
        return False
    try:
        import rich  # noqa: F401
    except ImportError:
        return False
    return True


class WarningTally(logging.Handler):
    """Counts WARNING records per (logger, message template) until :meth:`drain`."""

    def __init__(self) -> None:
        super().__init__(level=logging.WARNING)
        self.counts: Counter[tuple[str, str]] = Counter()
        self.first: dict[tuple[str, str], str] = {}
        self.total = 0

    def emit(self, record: logging.LogRecord) -> None:
        if record.levelno >= logging.ERROR:
            return  # errors reach the console themselves
        key = (record.name, str(record.msg))
        self.counts[key] += 1
        self.total += 1
        if key not in self.first:
            with contextlib.suppress(Exception):
                self.first[key] = record.getMessage()

    def drain(self, limit: int = 3, width: int = 140) -> list[str]:
        """One line per kind of warning since the last call (most frequent first), then forget them."""
        lines = []
        for key, n in self.counts.most_common(limit):
            msg = " ".join(self.first.get(key, key[1]).split())
            if len(msg) > width:
                msg = msg[: width - 1] + "…"
            lines.append(f"{n}× {key[0]}: {msg}")
        if len(self.counts) > limit:
            lines.append(
                f"… and {sum(self.counts.values()) - sum(n for _, n in self.counts.most_common(limit))} "
                "more warnings"
            )
        self.counts.clear()
        self.first.clear()
        return lines


def active_tally() -> WarningTally | None:
    return _tally


def _console_error_handler() -> logging.Handler:
    h = logging.StreamHandler(sys.stderr)
    h.setLevel(logging.ERROR)
    h.setFormatter(logging.Formatter("rollart: %(levelname)s %(name)s: %(message)s"))
    return h


def _adopt(name: str) -> None:
    """Make a self-configured library logger propagate to ours instead of printing itself."""
    lg = logging.getLogger(name)
    for h in list(lg.handlers):
        lg.removeHandler(h)
    lg.propagate = True
    lg.setLevel(logging.INFO)


@contextlib.contextmanager
def route_logs(log_file: Path, verbose: bool = False) -> Iterator[Path]:
    """Logging for one ``rollart train``: see the module docstring. Restores the previous set-up."""
    global _tally
    log_file.parent.mkdir(parents=True, exist_ok=True)
    root = logging.getLogger()
    saved = (
        root.level,
        list(root.handlers),
        {
            n: (
                logging.getLogger(n).propagate,
                list(logging.getLogger(n).handlers),
                logging.getLogger(n).level,
            )
            for n in _SELF_CONFIGURED
        },
    )
    file_handler = logging.FileHandler(log_file, encoding="utf-8")
    file_handler.setFormatter(logging.Formatter(_LOG_FORMAT))
    file_handler.setLevel(logging.INFO)
    added: list[logging.Handler] = [file_handler]
    if verbose:
        console = logging.StreamHandler(sys.stderr)
        console.setFormatter(logging.Formatter(_LOG_FORMAT))
        added.append(console)
    else:
        # progress bars of huggingface_hub / transformers (model creation and loading) go nowhere
        os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
        _tally = WarningTally()
        added += [_tally, _console_error_handler()]
        from rollart_core.resources import LOOPBACK_ENV

        for k, v in LOOPBACK_ENV.items():  # read by Ray at import time: before importing it
            os.environ.setdefault(k, v)
        with contextlib.suppress(ImportError):  # Ray configures its logger on import: import it now
            import ray  # noqa: F401
        for name in _SELF_CONFIGURED:
            if name in sys.modules:
                _adopt(name)
    for h in list(root.handlers):
        root.removeHandler(h)
    for h in added:
        root.addHandler(h)
    root.setLevel(logging.INFO)
    logging.captureWarnings(True)
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("default")
            yield log_file
    finally:
        logging.captureWarnings(False)
        for h in added:
            root.removeHandler(h)
        file_handler.close()
        root.setLevel(saved[0])
        for h in saved[1]:
            root.addHandler(h)
        for name, (prop, handlers, level) in saved[2].items():
            lg = logging.getLogger(name)
            lg.propagate, lg.level = prop, level
            for h in handlers:
                if h not in lg.handlers:
                    lg.addHandler(h)
        _tally = None


def _fmt(v: Any, digits: int = 3) -> str:
    if isinstance(v, float):
        return f"{v:.{digits}f}"
    return "-" if v is None else str(v)


class _Phase:
    def __init__(self, title: str) -> None:
        self.title = title
        self.t0 = time.perf_counter()

    def __rich__(self) -> Any:
        from rich.text import Text

        return Text(
            f"⠿ {self.title} … {time.perf_counter() - self.t0:.0f} s (start-up: Ray, engines, trainer)",
            style="cyan",
        )


@contextlib.contextmanager
def startup_display(title: str) -> Iterator[None]:
    """A live "starting … N s" line on an interactive terminal until the first step (or the end)."""
    global _live
    if not wants_live():
        yield
        return
    from rich.console import Console
    from rich.live import Live

    _live = Live(_Phase(title), console=Console(), refresh_per_second=4, transient=True)
    _live.start()
    try:
        yield
    finally:
        live, _live = _live, None
        if live is not None:
            live.stop()


class LiveSink:
    """The live display: previous steps scroll above as lines; below them, a panel with step k/N,
    elapsed and ETA, and the latest step's numbers (reward, held-out success, throughput, lag, fates,
    warnings this step)."""

    def __init__(self, total_steps: int | None, first_step: int = 1) -> None:
        from rich.console import Console
        from rich.live import Live

        global _live
        self.total = total_steps
        self.first_step = first_step
        self.t0 = time.perf_counter()
        self.t_first: float | None = None
        self.steps_done = 0
        self.last: dict[str, Any] = {}
        self.last_eval: float | None = None
        self.warn_lines: list[str] = []
        if _live is not None:  # take over the start-up display's live region
            self.live = _live
            _live = None
            self.owned = True
        else:
            self.live = Live(console=Console(), refresh_per_second=4, transient=True)
            self.live.start()
            self.owned = True
        self.live.update(self)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        now = time.perf_counter()
        if "eval_success" in metrics:
            self.last_eval = metrics["eval_success"]
        tally = active_tally()
        self.warn_lines = tally.drain() if tally is not None else []
        if step >= 1 and "version" in metrics and "reward_mean" in metrics:
            if self.t_first is None:
                self.t_first = now
            self.steps_done += 1
            self.last = metrics
        self.last_step = step
        self.t_last = now
        self.live.console.print(self._line(step, metrics))
        for w in self.warn_lines:
            self.live.console.print(f"  [yellow]warnings:[/] {w}", highlight=False, markup=True)
        self.live.update(self)

    def _eta(self) -> str:
        if self.total is None or self.t_first is None or self.steps_done < 2:
            return "-"
        per_step = (self.t_last - self.t_first) / (self.steps_done - 1)
        left = self.total - self.last_step
        return f"{max(0.0, per_step * left):.0f} s"

    @staticmethod
    def _line(step: int, m: dict[str, Any]) -> str:
        parts = [f"step {step:>3}"]
        for k, label in (
            ("reward_mean", "reward"),
            ("success_rate", "success"),
            ("eval_success", "held-out"),
            ("traj_per_s", "traj/s"),
            ("gen_tok_per_s", "gen tok/s"),
            ("lag_max", "lag"),
            ("loss", "loss"),
            ("train_s", "train s"),
        ):
            if k in m:
                parts.append(f"{label} {_fmt(m[k], 2)}")
        if isinstance(m.get("fates"), dict):
            parts.append(" ".join(f"{k}={v}" for k, v in sorted(m["fates"].items())))
        return "  ".join(parts)

    def __rich__(self) -> Any:
        from rich.progress_bar import ProgressBar
        from rich.table import Table

        m = self.last
        grid = Table.grid(padding=(0, 2))
        grid.add_column(style="bold")
        grid.add_column()
        done = getattr(self, "last_step", 0)
        bar = ProgressBar(total=float(self.total or 1), completed=float(done), width=30)
        head = Table.grid(padding=(0, 1))
        head.add_row(
            f"step {done}/{self.total or '?'}",
            bar,
            f"elapsed {time.perf_counter() - self.t0:.0f} s  ETA {self._eta()}",
        )
        grid.add_row("progress", head)
        grid.add_row(
            "reward",
            f"{_fmt(m.get('reward_mean'))}  success {_fmt(m.get('success_rate'))}  "
            f"held-out success {_fmt(self.last_eval)}",
        )
        grid.add_row(
            "throughput",
            f"{_fmt(m.get('traj_per_s'), 2)} traj/s  {_fmt(m.get('gen_tok_per_s'), 0)} gen tok/s"
            f"  train {_fmt(m.get('train_s'), 1)} s  sync {_fmt(m.get('sync_s'), 2)} s",
        )
        grid.add_row(
            "staleness",
            f"lag max {_fmt(m.get('lag_max'), 0)}  mean {_fmt(m.get('lag_mean'), 2)}  "
            f"version {_fmt(m.get('version'))}",
        )
        fates = m.get("fates")
        grid.add_row(
            "fates",
            " ".join(f"{k}={v}" for k, v in sorted(fates.items())) if isinstance(fates, dict) else "-",
        )
        grid.add_row("warnings", "; ".join(self.warn_lines) or "none this step")
        return grid

    def close(self) -> None:
        if self.owned:
            self.live.stop()
            self.owned = False
