"""Experiment trackers: Weights & Biases and MLflow behind the one metrics interface.

``logging: {backends: [tensorboard, wandb, mlflow]}`` in a run's config chooses them. Each chosen
tracker gets, in this order:

==============================  ===============================================================
when                            what
==============================  ===============================================================
start (:meth:`Trackers.start`)  the config (W&B config; MLflow params plus ``config.json``)
every step (:meth:`~Trackers.log`)  the step's scalars (nested dicts as ``key/sub``), at its step
the end (:meth:`~Trackers.finish`)  the summary, the report's files, then the tracker run ends
==============================  ===============================================================

Failures never cost the run:

- at start, a chosen tracker whose package is missing raises :class:`MissingExtraError` naming the
  extra (``pip install 'rollart-core[wandb]'``); one that cannot start (a directory it cannot
  write, a refused login) raises :class:`ConfigError`; a tracker started before the failure is ended;
- after start, a tracker that fails (disk full, store gone) logs one warning with the error and turns
  itself off; the run goes on (``metrics.jsonl`` keeps every step) and :meth:`Trackers.status`
  counts what it did not receive.

``rollart train`` starts them before the pipeline, under :func:`tracking`, so that a tracker that
cannot start stops the run before anything else starts, and ends them after the report is written.
``train(cfg)`` called from Python starts them itself when no :func:`tracking` block is active; they
then end with its metrics sink and get no summary.

Importing this module imports neither ``wandb`` nor ``mlflow``.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import shutil
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextvars import ContextVar
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from rollart_core.errors import ConfigError
from rollart_core.extras import require

if TYPE_CHECKING:
    from rollart_core.config import LoggingConfig, RunConfig

__all__ = ["Tracker", "Trackers", "active_trackers", "tracking"]

log = logging.getLogger(__name__)

INSTALL = {
    "tensorboard": ("tensorboardX", "pip install 'rollart-core[tensorboard]'"),
    "wandb": ("wandb", "pip install 'rollart-core[wandb]'"),
    "mlflow": ("mlflow", "pip install 'rollart-core[mlflow]'"),
}
"""backend -> (module, install command)."""
_SECRET = re.compile(r"(^|_)(token|key|secret|password|passwd|credentials?)$", re.IGNORECASE)
_active: ContextVar[Trackers | None] = ContextVar("rollart_trackers", default=None)


class Tracker(Protocol):
    """One tracking service's run. Any method may raise: :class:`Trackers` turns the tracker off."""

    name: str

    def log(self, step: int, scalars: dict[str, float]) -> None: ...

    def log_summary(self, summary: dict[str, Any]) -> None: ...

    def log_files(self, files: list[Path]) -> None: ...

    def end(self, outcome: str) -> None:
        """``outcome``: ``completed``, ``failed``, ``interrupted …`` (the summary's)."""
        ...


class Trackers:
    """The chosen trackers of one run, as a :class:`~rollart_core.metrics.MetricsSink`."""

    def __init__(self, trackers: list[Tracker]) -> None:
        self.trackers = trackers
        self.errors: dict[str, str] = {}
        """tracker -> the error that turned it off."""
        self.missed: dict[str, int] = {}
        """tracker -> calls it did not get after it was turned off (steps, summary, files)."""
        self.held = False
        """True inside :func:`tracking`: :meth:`close` leaves the trackers running for the block."""
        self._ended = False

    @classmethod
    def start(cls, cfg: RunConfig) -> Trackers | None:
        """Start the trackers ``cfg.logging`` chooses (None when it chooses only TensorBoard)."""
        lc = cfg.logging
        chosen = [b for b in lc.backends if b != "tensorboard"]
        explicit = "backends" in lc.model_fields_set
        for backend in lc.backends if explicit else chosen:  # every package first: start none or all
            require(*INSTALL[backend])
        if not chosen:
            return None
        run_name = lc.run_name or cfg.name
        config = _redacted(cfg.model_dump(mode="json"))
        started: list[Tracker] = []
        try:
            for backend in chosen:
                start = _start_wandb if backend == "wandb" else _start_mlflow
                started.append(start(lc, run_name, cfg.output_dir, config))
        except BaseException:
            for t in started:
                with contextlib.suppress(Exception):
                    t.end("failed")
            raise
        log.info("trackers: %s", ", ".join(t.name for t in started))
        return cls(started)

    def log(self, step: int, metrics: dict[str, Any]) -> None:
        scalars = _scalars(metrics)
        for t in self.trackers:
            self._call(t, "step metrics", t.log, step, scalars)

    def status(self) -> dict[str, Any]:
        """Per tracker: ``ok``, or the error that turned it off and how many calls it missed."""
        return {
            t.name: {"error": self.errors[t.name], "missed": self.missed.get(t.name, 0)}
            if t.name in self.errors
            else "ok"
            for t in self.trackers
        }

    def finish(self, summary: dict[str, Any], files: Sequence[Path] = ()) -> None:
        """Send the summary and ``files`` (the report's page and figures), then end every tracker."""
        fields = {k: v for k, v in summary.items() if k != "history"}
        for t in self.trackers:
            self._call(t, "summary", t.log_summary, fields)
            if files:
                self._call(t, "report files", t.log_files, [Path(f) for f in files])
        self._end(str(summary.get("outcome", "completed" if summary.get("completed", True) else "failed")))

    def close(self) -> None:
        """End of the step metrics: ends the trackers, unless :func:`tracking` holds them."""
        if not self.held:
            self._end("completed")

    def _end(self, outcome: str) -> None:
        if self._ended:
            return
        self._ended = True
        for t in self.trackers:
            try:
                t.end(outcome)
            except Exception as exc:  # the run's own outputs are already safe
                if t.name in self.errors:  # already off and said so: its store is gone
                    log.debug("tracker %s: ending its run failed too: %s", t.name, exc)
                else:
                    log.warning("tracker %s: ending its run failed: %s", t.name, exc)
        if self.errors:
            log.warning("trackers turned off during the run: %s", self.status())

    def _call(self, t: Tracker, what: str, fn: Any, *args: Any) -> None:
        if t.name in self.errors:
            self.missed[t.name] = self.missed.get(t.name, 0) + 1
            return
        try:
            fn(*args)
        except Exception as exc:
            self.errors[t.name] = f"{type(exc).__name__}: {exc}"
            log.warning(
                "tracker %s failed (%s): %s; it is off for the rest of the run, which goes on "
                "(metrics.jsonl keeps every step)",
                t.name,
                what,
                self.errors[t.name],
            )
            log.debug("tracker %s failure", t.name, exc_info=True)


def active_trackers() -> Trackers | None:
    """The trackers of the enclosing :func:`tracking` block, if any."""
    return _active.get()


@contextlib.contextmanager
def tracking(cfg: RunConfig) -> Iterator[Trackers | None]:
    """Start the trackers ``cfg.logging`` chooses for the length of the block (None: none chosen).
    Metrics sinks built inside (:func:`rollart_core.metrics.default_sinks`) log to them; call
    :meth:`Trackers.finish` with the summary and the report's files before the block ends. Leaving
    the block without it (an error) ends them with the outcome ``failed``. The block owns the process's
    W&B service: it stops it at the end (``wandb.teardown()``)."""
    trackers = Trackers.start(cfg)
    if trackers is None:
        yield None
        return
    trackers.held = True
    token = _active.set(trackers)
    outcome = "completed"
    try:
        yield trackers
    except BaseException:
        outcome = "failed"
        raise
    finally:
        _active.reset(token)
        trackers._end(outcome)
        if any(isinstance(t, WandbTracker) for t in trackers.trackers):
            # the block owns the run (`rollart train`): stop W&B's service process now rather than
            # leave it to interpreter exit, where it is killed unreaped
            sys.modules["wandb"].teardown()


# ---- W&B --------------------------------------------------------------------------------------


class WandbTracker:
    name = "wandb"

    def __init__(self, run: Any) -> None:
        self.run = run
        self._sync_file = Path(run.settings.sync_file)

    def log(self, step: int, scalars: dict[str, float]) -> None:
        # wandb writes through its own service process: a file gone under it is otherwise silent
        if not self._sync_file.is_file():
            raise OSError(f"the W&B run file {self._sync_file} is gone")
        self.run.log(scalars, step=step)

    def log_summary(self, summary: dict[str, Any]) -> None:
        self.run.summary.update(_flat_fields(summary))

    def log_files(self, files: list[Path]) -> None:
        folder = Path(self.run.dir) / "report"
        folder.mkdir(exist_ok=True)
        for f in files:
            if f.is_file():  # copied: the W&B run folder is uploaded on its own by `wandb sync`
                dst = folder / f.name
                shutil.copyfile(f, dst)
                self.run.save(str(dst), base_path=self.run.dir, policy="now")

    def end(self, outcome: str) -> None:
        self.run.finish(exit_code=0 if outcome == "completed" else 1)


def _start_wandb(lc: LoggingConfig, run_name: str, out_dir: Path, config: dict[str, Any]) -> WandbTracker:
    wandb = require(*INSTALL["wandb"])
    folder = _writable_dir(lc.wandb.dir or out_dir, "logging.wandb.dir")
    try:
        run = wandb.init(
            project=lc.wandb.project,
            entity=lc.wandb.entity,
            mode=lc.wandb.mode,
            dir=str(folder),
            name=run_name,
            config=config,
            tags=lc.wandb.tags or None,
            reinit="create_new",
            settings=wandb.Settings(
                console="off",  # rollart's own console and log files stay as they are
                x_disable_stats=True,
                save_code=False,
                disable_git=True,
                silent=True,
            ),
        )
    except Exception as exc:
        raise ConfigError(f"logging.wandb: W&B could not start ({lc.wandb.mode}) in {folder}: {exc}") from exc
    log.info("W&B run %s (%s) in %s", run.id, lc.wandb.mode, run.dir)
    return WandbTracker(run)


# ---- MLflow -----------------------------------------------------------------------------------


class MlflowTracker:
    name = "mlflow"

    def __init__(self, client: Any, run_id: str) -> None:
        from mlflow.entities import Metric

        self.client, self.run_id, self._metric = client, run_id, Metric

    def log(self, step: int, scalars: dict[str, float]) -> None:
        now = int(time.time() * 1000)
        metrics = [self._metric(_mlflow_key(k), float(v), now, step) for k, v in scalars.items()]
        for i in range(0, len(metrics), 1000):  # MLflow's per-batch limit
            self.client.log_batch(self.run_id, metrics=metrics[i : i + 1000], synchronous=True)

    def log_summary(self, summary: dict[str, Any]) -> None:
        self.client.log_dict(self.run_id, summary, "summary.json")
        now, step = int(time.time() * 1000), int(summary.get("steps") or 0)
        metrics = [
            self._metric(_mlflow_key(f"summary/{k}"), float(v), now, step)
            for k, v in _flat_fields(summary).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool)
        ]
        self.client.log_batch(self.run_id, metrics=metrics, synchronous=True)
        if "outcome" in summary:
            self.client.set_tag(self.run_id, "rollart.outcome", str(summary["outcome"]))

    def log_files(self, files: list[Path]) -> None:
        for f in files:
            if f.is_file():
                self.client.log_artifact(self.run_id, str(f), artifact_path="report")

    def end(self, outcome: str) -> None:
        status = "FINISHED" if outcome == "completed" else "FAILED" if outcome == "failed" else "KILLED"
        self.client.set_terminated(self.run_id, status=status)


def _start_mlflow(lc: LoggingConfig, run_name: str, out_dir: Path, config: dict[str, Any]) -> MlflowTracker:
    require(*INSTALL["mlflow"])
    uri = lc.mlflow.tracking_uri or str(out_dir / "mlruns")
    scheme = uri.split("://", 1)[0] if "://" in uri else ""
    if scheme in ("", "file"):
        path = Path(uri[len("file://") :] if scheme else uri)
        uri = _writable_dir(path, "logging.mlflow.tracking_uri").as_uri()
        # MLflow 3 asks for an opt-in to its file store (in maintenance mode, not removed); choosing
        # a file store here is that opt-in. Only MLflow's FileStore reads this variable.
        os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")
    elif scheme.startswith("sqlite"):
        _writable_dir(Path(uri.split(":///", 1)[1]).parent, "logging.mlflow.tracking_uri")
    from mlflow.entities import Param
    from mlflow.tracking import MlflowClient

    try:
        client = MlflowClient(tracking_uri=uri)
        experiment = client.get_experiment_by_name(lc.mlflow.experiment)
        experiment_id = (
            experiment.experiment_id if experiment else client.create_experiment(lc.mlflow.experiment)
        )
        run_id = client.create_run(
            experiment_id, run_name=run_name, tags={"rollart.output_dir": str(out_dir)}
        ).info.run_id
        params = [Param(_mlflow_key(k), str(v)[:6000]) for k, v in _flat_fields(config, sep=".").items()]
        for i in range(0, len(params), 100):  # MLflow's per-batch limit for params
            client.log_batch(run_id, params=params[i : i + 100], synchronous=True)
        client.log_dict(run_id, config, "config.json")
    except Exception as exc:
        raise ConfigError(f"logging.mlflow: MLflow could not start at {uri}: {exc}") from exc
    log.info("MLflow run %s at %s", run_id, uri)
    return MlflowTracker(client, run_id)


# ---- helpers ----------------------------------------------------------------------------------


def _writable_dir(path: Path, field: str) -> Path:
    """``path`` made if needed and checked by writing a file in it: a tracker that could not write
    would otherwise fail quietly in the middle of the run."""
    path = Path(path).absolute()
    try:
        path.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path, prefix=".rollart-probe-"):
            pass
    except OSError as exc:
        raise ConfigError(f"{field}: cannot write to {path}: {exc}") from exc
    return path


def _scalars(metrics: dict[str, Any]) -> dict[str, float]:
    """The numbers of a step's metrics; a dict of numbers (``fates``, ``*_by_task``) as ``key/sub``."""
    out: dict[str, float] = {}
    for k, v in metrics.items():
        if isinstance(v, dict):
            out.update({f"{k}/{kk}": vv for kk, vv in v.items() if _is_number(vv)})
        elif _is_number(v):
            out[k] = v
    return out


def _is_number(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool)


def _flat_fields(d: dict[str, Any], sep: str = "/", prefix: str = "") -> dict[str, Any]:
    """Nested dicts flattened (``a/b``); lists as JSON text; numbers, bools, strings, None kept."""
    out: dict[str, Any] = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict) and v:
            out.update(_flat_fields(v, sep, key + sep))
        elif isinstance(v, (int, float, str, bool)) or v is None:
            out[key] = v
        else:
            out[key] = json.dumps(v, default=str)
    return out


def _mlflow_key(key: str) -> str:
    """MLflow accepts letters, digits, ``_ - . / `` and spaces in names."""
    return re.sub(r"[^\w\-./ ]", "_", key)[:250]


def _redacted(config: Any) -> Any:
    """The config with the values of secret-looking keys (``token``, ``api_key`` …) replaced: the
    trackers' copies may be uploaded."""
    if isinstance(config, dict):
        return {
            k: "<redacted>" if _SECRET.search(str(k)) and v is not None else _redacted(v)
            for k, v in config.items()
        }
    if isinstance(config, list):
        return [_redacted(v) for v in config]
    return config
