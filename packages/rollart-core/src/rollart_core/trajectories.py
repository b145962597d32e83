"""A run's trajectories on disk: written per step during the run, exported as one table after it.

- During a run with ``loop.export_trajectories: true``, :class:`TrajectoryLog` writes, at the end
  of every step, the trajectories that got their fate in that step (finished, aborted-stale, failed,
  ...) to ``RUN_DIR/trajectories/step-<step>.jsonl``: one :meth:`Trajectory.to_dict` a line with the
  step and the decoded text. Each file is written under a temporary name, fsynced and renamed: a
  crash leaves every step complete or absent, never half a file. A resumed run replaces the steps
  it makes again. A finished trajectory that waits in the buffer and later turns out too old to
  train is relabelled ``aborted_stale`` by the run: a later step's file records that change
  (a line ``{"fate_update": ..., "traj_id": ..., "step": ...}``) and the export applies it.
- After it, :func:`export_trajectories` (``rollart export --trajectories RUN_DIR``) writes them as one
  flat table, one row per trajectory, in JSONL or Parquet (pyarrow: ``pip install
  'rollart-core[parquet]'``): plain columns and lists of numbers, readable by pandas, Hugging Face
  ``datasets`` and DuckDB without rollart. :func:`trajectory_rows` yields the same rows. The columns:
  ``docs/trajectories.md`` and :data:`COLUMNS`.

Which trajectories were trained in which step comes from ``metrics.jsonl`` (each step's
``batch_traj_ids``): the ``trained_step`` column.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
from collections.abc import Callable, Iterator, Sequence
from pathlib import Path
from typing import Any, Literal

from rollart_core.errors import ConfigError
from rollart_core.types import Fate, Trajectory

__all__ = [
    "COLUMNS",
    "PARQUET_INSTALL",
    "TRAJECTORIES_DIR",
    "TrajectoryLog",
    "export_trajectories",
    "trajectory_rows",
]

TRAJECTORIES_DIR = "trajectories"
PARQUET_INSTALL = "pip install 'rollart-core[parquet]'"
_STEP_FILE = re.compile(r"^step-(\d+)\.jsonl$")

COLUMNS: dict[str, str] = {
    "traj_id": "string",
    "group_id": "string",
    "task": "string",
    "env_id": "string",
    "seed": "int64",
    "step": "int64",
    "trained_step": "int64?",
    "fate": "string?",
    "error": "string?",
    "reward": "float64",
    "env_return": "float64",
    "success": "bool?",
    "reward_details": "string",
    "terminated": "bool",
    "truncated": "bool",
    "start_version": "int64",
    "min_version": "int64?",
    "max_version": "int64?",
    "num_turns": "int64",
    "num_generated": "int64",
    "prompt_ids": "list<int64>",
    "response_ids": "list<int64>",
    "response_mask": "list<int64>",
    "logprobs": "list<float64>",
    "versions": "list<int64>",
    "prompt_text": "string?",
    "response_text": "string?",
    "turn_context_lens": "list<int64>",
    "turn_output_lens": "list<int64>",
    "turn_new_sequence": "list<bool>",
    "finish_reasons": "list<string>",
    "total_s": "float64?",
    "timings": "string",
    "info": "string",
}
"""Every exported column and its type (``?``: may be null); the meaning of each: docs/trajectories.md."""


class TrajectoryLog:
    """Writes each step's ended trajectories under ``run_dir/trajectories`` (see the module).
    ``decode``: token ids → text (the run's tokenizer), for the text columns; None leaves them out.
    ``first_step``: files of this step and later (from an earlier attempt of a resumed run) are removed."""

    def __init__(
        self, run_dir: Path, decode: Callable[[Sequence[int]], str] | None = None, first_step: int = 1
    ) -> None:
        self.dir = Path(run_dir) / TRAJECTORIES_DIR
        self.dir.mkdir(parents=True, exist_ok=True)
        self.decode = decode
        self._waiting: dict[str, Trajectory] = {}
        """Finished trajectories written but not yet trained: their fate may still change."""
        for path, step in _step_files(self.dir):
            if step >= first_step:
                path.unlink()

    def lines(
        self, step: int, trajectories: Sequence[Trajectory], trained: Sequence[Trajectory] = ()
    ) -> list[str]:
        """The step's file content: the fate changes of trajectories written earlier, then one line
        per trajectory that ended (decoding runs here, on the caller's thread). ``trained``: the
        step's batch (its members' fates are final)."""
        trained_ids = {t.traj_id for t in trained}
        for tid in trained_ids:
            self._waiting.pop(tid, None)
        out = []
        for tid, t in list(self._waiting.items()):
            if t.fate is not Fate.FINISHED:
                fate = t.fate.value if t.fate is not None else None
                out.append(json.dumps({"fate_update": fate, "traj_id": tid, "step": step}) + "\n")
                del self._waiting[tid]
        for t in trajectories:
            if t.fate is Fate.FINISHED and t.traj_id not in trained_ids:
                self._waiting[t.traj_id] = t
            d = t.to_dict()
            d["step"] = step
            if self.decode is not None and t.turns:
                ids = t.token_ids()
                split = len(t.turns[0].context_ids)
                d["prompt_text"] = self.decode(ids[:split])
                d["response_text"] = self.decode(ids[split:])
            out.append(json.dumps(d, default=str) + "\n")
        return out

    def write_lines(self, step: int, lines: list[str]) -> Path:
        """Write one step's file atomically (temporary name, fsync, rename, fsync of the directory)."""
        path = self.dir / f"step-{step:06d}.jsonl"
        tmp = path.with_name(path.name + ".tmp")
        with open(tmp, "w", encoding="utf-8") as f:
            f.writelines(lines)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
        fd = os.open(self.dir, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        return path

    async def write(
        self, step: int, trajectories: Sequence[Trajectory], trained: Sequence[Trajectory] = ()
    ) -> Path:
        """Serialise on the loop, write in a thread."""
        return await asyncio.to_thread(self.write_lines, step, self.lines(step, trajectories, trained))


def _step_files(directory: Path) -> list[tuple[Path, int]]:
    found = []
    for p in directory.iterdir() if directory.is_dir() else ():
        m = _STEP_FILE.match(p.name)
        if m:
            found.append((p, int(m.group(1))))
    return sorted(found, key=lambda x: x[1])


def _trained_steps(run_dir: Path) -> dict[str, int]:
    """traj_id → the step whose batch trained it, from metrics.jsonl (a torn last line is skipped)."""
    out: dict[str, int] = {}
    path = run_dir / "metrics.jsonl"
    if not path.is_file():
        return out
    for line in path.read_text(encoding="utf-8").splitlines():
        try:
            row = json.loads(line)
        except ValueError:
            continue
        for tid in row.get("batch_traj_ids") or ():
            out[str(tid)] = int(row["step"])
    return out


def trajectory_rows(run_dir: str | Path) -> Iterator[dict[str, Any]]:
    """The run's trajectories as flat rows (:data:`COLUMNS`), in step order. Raises ConfigError if
    ``run_dir`` holds none (the run was made without ``loop.export_trajectories``)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: not a run directory (it does not exist)")
    files = _step_files(run_dir / TRAJECTORIES_DIR)
    if not files:
        raise ConfigError(
            f"{run_dir}: no trajectories were saved in this run (no {TRAJECTORIES_DIR}/step-*.jsonl); "
            "they are written during a run with `loop: {export_trajectories: true}` in its config: "
            "set it and run again"
        )
    trained = _trained_steps(run_dir)
    updates: dict[str, str] = {}
    for path, _ in files:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.startswith('{"fate_update"'):
                    u = json.loads(line)
                    updates[u["traj_id"]] = u["fate_update"]
    for path, _ in files:
        with open(path, encoding="utf-8") as f:
            for line in f:
                if line.strip() and not line.startswith('{"fate_update"'):
                    row = _row(json.loads(line), trained)
                    row["fate"] = updates.get(row["traj_id"], row["fate"])
                    yield row


def _row(d: dict[str, Any], trained: dict[str, int]) -> dict[str, Any]:
    turns = d.get("turns") or []
    prompt = list(turns[0]["context_ids"]) if turns else []
    response: list[int] = []
    mask: list[int] = []
    logprobs: list[float] = []
    versions: list[int] = []
    for k, t in enumerate(turns):
        context = t["context_ids"] if k else []
        response += context
        mask += [0] * len(context)
        logprobs += [0.0] * len(context)
        versions += [-1] * len(context)
        response += t["output_ids"]
        mask += [1] * len(t["output_ids"])
        logprobs += [float(x) for x in t["output_logprobs"]]
        versions += [int(v) for v in t["output_versions"]]
    generated = [v for t in turns for v in t["output_versions"]]
    info = dict(d.get("info") or {})
    details = info.pop("reward_details", None)
    success = info.get("success")
    timings = d.get("timings") or {}
    return {
        "traj_id": d["traj_id"],
        "group_id": d["group_id"],
        "task": d["task"],
        "env_id": d["env_id"],
        "seed": int(d["seed"]),
        "step": int(d["step"]),
        "trained_step": trained.get(d["traj_id"]),
        "fate": d.get("fate"),
        "error": d.get("error"),
        "reward": float(d.get("reward", 0.0)),
        "env_return": float(d.get("env_return", 0.0)),
        "success": bool(success) if success is not None else None,
        "reward_details": json.dumps(details if details is not None else {}, default=str),
        "terminated": bool(d.get("terminated")),
        "truncated": bool(d.get("truncated")),
        "start_version": int(d["start_version"]),
        "min_version": min(generated) if generated else None,
        "max_version": max(generated) if generated else None,
        "num_turns": len(turns),
        "num_generated": sum(len(t["output_ids"]) for t in turns),
        "prompt_ids": prompt,
        "response_ids": response,
        "response_mask": mask,
        "logprobs": logprobs,
        "versions": versions,
        "prompt_text": d.get("prompt_text"),
        "response_text": d.get("response_text"),
        "turn_context_lens": [len(t["context_ids"]) for t in turns],
        "turn_output_lens": [len(t["output_ids"]) for t in turns],
        "turn_new_sequence": [bool(t.get("new_sequence")) for t in turns],
        "finish_reasons": [str(t.get("finish_reason", "")) for t in turns],
        "total_s": timings.get("total"),
        "timings": json.dumps(timings),
        "info": json.dumps(info, default=str),
    }


def _arrow_schema(pa: Any) -> Any:
    scalar = {"string": pa.string(), "int64": pa.int64(), "float64": pa.float64(), "bool": pa.bool_()}
    fields = []
    for name, kind in COLUMNS.items():
        nullable = kind.endswith("?")
        kind = kind.rstrip("?")
        if kind.startswith("list<"):
            typ = pa.list_(scalar[kind[5:-1]])
        else:
            typ = scalar[kind]
        fields.append(pa.field(name, typ, nullable=nullable or kind == "string"))
    return pa.schema(fields)


def export_trajectories(
    run_dir: str | Path,
    out: str | Path | None = None,
    *,
    format: Literal["jsonl", "parquet"] = "jsonl",
) -> tuple[Path, int]:
    """Write the run's trajectories as one table (see the module); returns ``(path, rows)``.
    ``out``: default ``RUN_DIR/trajectories.<format>``. Parquet needs pyarrow (its absence raises
    MissingExtraError naming ``pip install 'rollart-core[parquet]'``); it is written one row group
    per step, so a long run never needs all its trajectories in memory."""
    run_dir = Path(run_dir)
    if format not in ("jsonl", "parquet"):
        raise ConfigError(f"format must be 'jsonl' or 'parquet', got {format!r}")
    path = Path(out) if out is not None else run_dir / f"trajectories.{format}"
    rows = trajectory_rows(run_dir)
    first = next(rows, None)  # raises ConfigError for a run without trajectories, before anything is written
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    n = 0
    if format == "jsonl":
        with open(tmp, "w", encoding="utf-8") as f:
            for row in _chain(first, rows):
                f.write(json.dumps(row) + "\n")
                n += 1
    else:
        from rollart_core.extras import require

        pa = require("pyarrow", PARQUET_INSTALL)
        pq = require("pyarrow.parquet", PARQUET_INSTALL)
        schema = _arrow_schema(pa)
        with pq.ParquetWriter(tmp, schema) as writer:
            batch: list[dict[str, Any]] = []
            for row in _chain(first, rows):
                if batch and batch[-1]["step"] != row["step"]:
                    writer.write_table(pa.Table.from_pylist(batch, schema=schema))
                    batch = []
                batch.append(row)
                n += 1
            writer.write_table(pa.Table.from_pylist(batch, schema=schema))  # empty: the schema alone
    os.replace(tmp, path)
    return path, n


def _chain(first: dict[str, Any] | None, rest: Iterator[dict[str, Any]]) -> Iterator[dict[str, Any]]:
    if first is not None:
        yield first
    yield from rest
