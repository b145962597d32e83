"""Dataset tasks: problems (a prompt and its reference answer) from a local JSONL or Parquet file.

One row per episode. Single-turn by default: the observation is the row's prompt, the first
``step(reply)`` ends the episode, and ``info`` carries the reference where rollart-reward's rewards
look for it (``info["answer"]``, also under the file's own ``answer_key``; the prompt as
``info["question"]`` for ``llm_judge``), so ``number_match`` / ``exact_match`` / ``math_verify`` /
``code_tests`` score the reply. With ``match`` set the env judges the reply itself (``info["success"]``,
step reward ``correct_reward`` / ``wrong_reward``); with a ``feedback_template`` a wrong reply gets
feedback as the next observation until ``max_turns`` replies were given (multi-turn).

Rows, seeds and splits:

- The file is read once per process (cached by path, modification time and size), whatever the number
  of env objects built from it (the runner builds one per trajectory).
- The split is a deterministic function of each row: a keyed hash of its position in the file (or of
  its ``id_key`` value, which survives reordering and appends) puts it in ``heldout`` (a
  ``heldout_fraction`` of the rows, or exactly ``heldout_size`` of them) or ``train``; a ``train`` env
  never shows a held-out row.
- ``reset(seed)`` maps the seed to ``(epoch, position) = divmod(seed, rows in the split)`` and the
  position through a keyed pseudo-random permutation of the split (one per epoch and
  ``shuffle_seed``): consecutive seeds ``0, 1, 2, …`` visit every row of the split once per epoch, each
  epoch in a fresh order. rollart's rollout derives each group's seed by hashing
  (``derive_seed(cfg.seed, tag, n, task)``, uniform over 31 bits), so inside a rollart run every group
  draws a row uniformly at random, with replacement (not epoch by epoch); the members of a group share
  the seed, hence the row.
- ``split: auto`` (the default) serves ``train`` rows, except for the seeds of rollart's held-out
  evaluation (``derive_seed("heldout", task, episode)``, the first ``auto_eval_tasks`` tasks and
  ``auto_eval_episodes`` episodes), which get ``heldout`` rows, episode ``e`` the ``e``-th of the
  held-out order: ``rollart train``'s ``eval_every`` evaluates on rows training never sees, each
  episode on a different row. A training seed equal to one of those (a chance of about
  ``auto_eval_tasks * auto_eval_episodes / 2**31`` per group, 2e-6 with the defaults) would be served a
  held-out row, the same odds as a training seed colliding with an evaluation seed in any rollart env.
"""

from __future__ import annotations

import functools
import hashlib
import json
import re
import string
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollart_core.errors import ConfigError
from rollart_core.extras import require
from rollart_core.types import StepResult

__all__ = ["DatasetConfig", "DatasetEnv", "extract_reply", "load_rows"]

PARQUET_INSTALL = "pip install 'rollart-env[parquet]'"
FEEDBACK_FIELDS = frozenset({"answer", "turn", "turns_left"})
MAX_REPLY_CHARS = 4096
"""Only the reply's last this many characters are parsed (bounded parsing of untrusted text)."""
_NUMBER = re.compile(r"[-+]?\d{1,60}(?:\.\d{1,60})?")
_TAGGED = re.compile(r"<answer>(.{0,400}?)</answer>|\\boxed\{([^{}]{0,400})\}", re.S)


class DatasetConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    path: Path
    """The data file: ``.jsonl`` (one JSON object per line; blank lines skipped) or ``.parquet``
    (needs pyarrow: ``pip install 'rollart-env[parquet]'``). A relative path is taken from the
    current directory."""
    prompt_key: str = "prompt"
    """Field of a row holding the prompt (a string): the first observation."""
    answer_key: str = "answer"
    """Field of a row holding the reference answer (any JSON value; a string or number for ``match``)."""
    id_key: str | None = None
    """Field whose value decides the row's split (instead of its position in the file)."""
    info_keys: list[str] = []
    """Further fields of the row copied into ``info`` (e.g. ``tests`` for the ``code_tests`` reward)."""
    split: Literal["auto", "train", "heldout", "all"] = "auto"
    """Rows this env serves: ``train``, ``heldout``, ``all`` (no split), or ``auto``: train rows, and
    held-out rows for rollart's held-out evaluation seeds (see the module docstring)."""
    heldout_fraction: float = Field(0.1, ge=0.0, lt=1.0)
    """Share of the rows held out (each row by its hash, so the count is about this share)."""
    heldout_size: int | None = Field(None, ge=1)
    """Exactly this many rows held out (the ones with the smallest hashes); replaces ``heldout_fraction``."""
    split_seed: int = 0
    """Key of the split's hash: another value gives another (equally sized) split."""
    shuffle_seed: int = 0
    """Key of the per-epoch order of the rows."""
    auto_eval_tasks: int = Field(8, ge=1, le=64)
    """``split: auto``: task positions whose held-out evaluation seeds are recognised."""
    auto_eval_episodes: int = Field(256, ge=1, le=8192)
    """``split: auto``: evaluation episodes per task recognised (``loop.eval_episodes`` must not exceed it)."""
    system_prompt: str | None = None
    """System prompt of every episode (None: none)."""
    action_vocabulary: list[str] | None = None
    """Replies as one token each from this list (used for ``allowed_token_ids``, e.g. the ten digits
    for one-digit answers with ``max_tokens: 1``); every reference answer must be one of them."""
    match: Literal["none", "exact", "number"] = "none"
    """How the env judges a reply itself: ``number`` (the reply's tagged or last number equals the
    reference numerically), ``exact`` (the reply, or its ``<answer>``/``\\boxed{}`` part, equals the
    reference after trimming and case folding), ``none`` (only the reward function judges)."""
    max_turns: int = Field(1, ge=1)
    """Replies per episode: more than 1 needs a ``feedback_template`` and a ``match``. The task's
    ``max_turns`` in the run config must be at least this."""
    feedback_template: str | None = None
    """Observation after a wrong reply, e.g. ``"Your answer {answer} is wrong. Try again."``; fields
    ``{answer}`` (the extracted reply, at most 40 characters), ``{turn}``, ``{turns_left}``."""
    correct_reward: float = 1.0
    """Step reward of a reply judged correct (only with ``match``)."""
    wrong_reward: float = 0.0

    @model_validator(mode="after")
    def _consistent(self) -> DatasetConfig:
        if self.path.suffix not in (".jsonl", ".parquet"):
            raise ValueError(f"path {str(self.path)!r}: a .jsonl or .parquet file is supported")
        if self.feedback_template is not None:
            try:
                fields = {
                    f for _, f, _, _ in string.Formatter().parse(self.feedback_template) if f is not None
                }
            except ValueError as exc:
                raise ValueError(f"feedback_template is not a format string: {exc}") from None
            unknown = fields - FEEDBACK_FIELDS
            if unknown:
                raise ValueError(
                    f"feedback_template: unknown field(s) {sorted(unknown)}; use {sorted(FEEDBACK_FIELDS)}"
                )
            if self.max_turns < 2:
                raise ValueError("feedback_template needs max_turns >= 2 (a reply after the feedback)")
        if self.max_turns > 1 and self.feedback_template is None:
            raise ValueError(
                "max_turns > 1 needs a feedback_template (what the model sees after a wrong reply)"
            )
        if self.max_turns > 1 and self.match == "none":
            raise ValueError(
                "max_turns > 1 needs match: exact or number (the env decides when a reply is wrong)"
            )
        if self.action_vocabulary is not None and (
            not self.action_vocabulary or len(set(self.action_vocabulary)) != len(self.action_vocabulary)
        ):
            raise ValueError("action_vocabulary must be a non-empty list without repeats")
        if self.split == "all" and self.heldout_size is not None:
            raise ValueError("split: all has no held-out rows; drop heldout_size")
        return self


# --------------------------------------------------------------------------- loading (cached)


def load_rows(path: str | Path) -> tuple[tuple[dict[str, Any], str], ...]:
    """Every row of a JSONL or Parquet file with its location (``line N`` / ``row N``), read once per
    process while the file is unchanged. A missing, empty or unparsable file is a ConfigError naming it."""
    return _read(*_file_version(path))


def _file_version(path: str | Path) -> tuple[str, int, int]:
    """``(resolved path, mtime_ns, size)``: the cache key of a file's content."""
    p = Path(path).resolve()
    try:
        st = p.stat()
    except OSError as exc:
        raise ConfigError(f"dataset {path}: cannot read the file ({exc.strerror or exc})") from None
    if not p.is_file():
        raise ConfigError(f"dataset {path}: not a file")
    return str(p), st.st_mtime_ns, st.st_size


@functools.lru_cache(maxsize=16)
def _read(path: str, mtime_ns: int, size: int) -> tuple[tuple[dict[str, Any], str], ...]:
    del mtime_ns, size  # cache keys: a rewritten file is read again
    rows = _read_parquet(path) if path.endswith(".parquet") else _read_jsonl(path)
    if not rows:
        raise ConfigError(f"dataset {path}: the file holds no rows")
    return tuple(rows)


def _read_jsonl(path: str) -> list[tuple[dict[str, Any], str]]:
    rows = []
    try:
        with open(path, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as exc:
                    raise ConfigError(f"dataset {path}, line {n}: not valid JSON ({exc.msg})") from None
                if not isinstance(row, dict):
                    raise ConfigError(
                        f"dataset {path}, line {n}: a row must be a JSON object, got {type(row).__name__}"
                    )
                rows.append((row, f"line {n}"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"dataset {path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None
    except OSError as exc:
        raise ConfigError(f"dataset {path}: cannot read the file ({exc.strerror or exc})") from None
    return rows


def _read_parquet(path: str) -> list[tuple[dict[str, Any], str]]:
    pq = require("pyarrow.parquet", PARQUET_INSTALL)
    try:
        table = pq.read_table(path)
    except Exception as exc:  # pyarrow raises ArrowInvalid / OSError subclasses for a bad file
        raise ConfigError(f"dataset {path}: not a readable Parquet file ({exc})") from None
    return [(row, f"row {n}") for n, row in enumerate(table.to_pylist(), 1)]


@dataclass(frozen=True)
class _Split:
    rows: tuple[tuple[dict[str, Any], str], ...]
    train: tuple[int, ...]
    heldout: tuple[int, ...]


def _unit_hash(*parts: object) -> float:
    digest = hashlib.blake2b(":".join(map(str, parts)).encode(), digest_size=8).digest()
    return int.from_bytes(digest, "big") / 2**64


@functools.lru_cache(maxsize=32)
def _prepare(cfg_key: str, path: str, mtime_ns: int, size: int) -> _Split:
    """Validate every row for these options and split them (cached per options and file version)."""
    cfg = DatasetConfig.model_validate_json(cfg_key)
    rows = _read(path, mtime_ns, size)
    vocab = set(cfg.action_vocabulary) if cfg.action_vocabulary is not None else None
    ids: list[object] = []
    for i, (row, where) in enumerate(rows):
        for key in (cfg.prompt_key, cfg.answer_key, *([cfg.id_key] if cfg.id_key else []), *cfg.info_keys):
            if key not in row:
                raise ConfigError(f"dataset {path}, {where}: no key {key!r} (the row has {sorted(row)[:10]})")
        if not isinstance(row[cfg.prompt_key], str) or not row[cfg.prompt_key]:
            raise ConfigError(
                f"dataset {path}, {where}: {cfg.prompt_key!r} must be a non-empty string, "
                f"got {row[cfg.prompt_key]!r:.60}"
            )
        answer = row[cfg.answer_key]
        if cfg.match != "none" and (not isinstance(answer, str | int | float) or isinstance(answer, bool)):
            raise ConfigError(
                f"dataset {path}, {where}: {cfg.answer_key!r} must be a string or a number "
                f"for match: {cfg.match}, got {answer!r:.60}"
            )
        if cfg.match == "number" and _as_number(str(answer)) is None:
            raise ConfigError(
                f"dataset {path}, {where}: {cfg.answer_key!r} = {answer!r:.60} is not a number "
                "(match: number)"
            )
        if vocab is not None and str(answer) not in vocab:
            raise ConfigError(
                f"dataset {path}, {where}: {cfg.answer_key!r} = {answer!r:.60} is not in the "
                "action_vocabulary (the reply could never be right)"
            )
        ids.append(row[cfg.id_key] if cfg.id_key else i)
    if cfg.id_key is not None and len({json.dumps(v, sort_keys=True, default=str) for v in ids}) != len(ids):
        raise ConfigError(f"dataset {path}: the values of id_key {cfg.id_key!r} are not unique")
    if cfg.split == "all":
        return _Split(rows, tuple(range(len(rows))), ())
    h = [_unit_hash("split", cfg.split_seed, json.dumps(v, sort_keys=True, default=str)) for v in ids]
    if cfg.heldout_size is not None:
        if cfg.heldout_size >= len(rows):
            raise ConfigError(
                f"dataset {path}: heldout_size {cfg.heldout_size} leaves no training rows ({len(rows)} rows)"
            )
        held = set(sorted(range(len(rows)), key=h.__getitem__)[: cfg.heldout_size])
    else:
        held = {i for i in range(len(rows)) if h[i] < cfg.heldout_fraction}
    split = _Split(rows, tuple(i for i in range(len(rows)) if i not in held), tuple(sorted(held)))
    if not split.train:
        raise ConfigError(f"dataset {path}: no training rows left (heldout_fraction {cfg.heldout_fraction})")
    if cfg.split in ("heldout", "auto") and not split.heldout:
        raise ConfigError(
            f"dataset {path}: split {cfg.split} but no row is held out ({len(rows)} rows, "
            f"heldout_fraction {cfg.heldout_fraction}); raise heldout_fraction, set heldout_size, "
            "or use split: train / all"
        )
    return split


def permute(position: int, n: int, key: str) -> int:
    """The ``position``-th element of a keyed pseudo-random permutation of ``range(n)`` (a 4-round
    Feistel network on the next even power of two, cycle-walked into range): O(1) per call, so an
    epoch's order of a large file is never materialised."""
    if not 0 <= position < n:
        raise ValueError(f"position {position} not in range({n})")
    bits = max(2, (n - 1).bit_length())
    bits += bits % 2
    half = bits // 2
    mask = (1 << half) - 1
    x = position
    while True:
        left, right = x >> half, x & mask
        for r in range(4):
            digest = hashlib.blake2b(f"{key}:{r}:{right}".encode(), digest_size=8).digest()
            left, right = right, left ^ (int.from_bytes(digest, "big") & mask)
        x = (left << half) | right
        if x < n:
            return x


@functools.lru_cache(maxsize=4)
def _eval_seeds(tasks: int, episodes: int) -> dict[int, int]:
    """rollart's held-out evaluation seeds → episode index (``rollart_core.control.train.evaluate``)."""
    from rollart_core.control.rollout import derive_seed

    seeds: dict[int, int] = {}
    for e in range(episodes):
        for ti in range(tasks):
            seeds.setdefault(derive_seed("heldout", ti, e), e)
    return seeds


# --------------------------------------------------------------------------- judging replies


def _as_number(text: str) -> Fraction | None:
    t = text.strip().replace(",", "")
    if not _NUMBER.fullmatch(t):
        return None
    return Fraction(t)


def extract_reply(text: str, match: str) -> str | None:
    """The answer part of a reply: an ``<answer>…</answer>`` or ``\\boxed{…}`` part if there is one,
    else (``number``) the last number or (``exact``) the whole reply; None if there is no answer."""
    tail = text[-MAX_REPLY_CHARS:]
    tagged = [m.group(1) if m.group(1) is not None else m.group(2) for m in _TAGGED.finditer(tail)]
    part = tagged[-1] if tagged else tail
    if match == "number":
        numbers = _NUMBER.findall(part.replace(",", ""))
        return numbers[-1] if numbers else None
    part = " ".join(part.split()).rstrip(".")
    return part or None


def _correct(extracted: str | None, reference: object, match: str) -> bool:
    if extracted is None:
        return False
    if match == "number":
        got, ref = _as_number(extracted), _as_number(str(reference))
        return got is not None and ref is not None and got == ref
    return extracted.casefold() == " ".join(str(reference).split()).rstrip(".").casefold()


# --------------------------------------------------------------------------- the environment


class DatasetEnv:
    """One dataset row per episode: the prompt, the model's reply (or replies), the reference in ``info``."""

    Config = DatasetConfig
    profile = "decode_heavy"
    """Routing hint: a prompt and a short reply; set a task's ``pool`` for long-prompt data sets."""

    @classmethod
    def check_config(cls, config: DatasetConfig) -> None:
        """Read and validate the file for these options (``SupportsConfigCheck``): a missing, empty
        or unparsable file, a row without a key or with a bad value, a split without rows is a
        ConfigError naming the file, the row and the key, before a run starts anything."""
        _prepare(config.model_dump_json(), *_file_version(config.path))

    def __init__(self, config: DatasetConfig) -> None:
        self.config = config
        # the same checks as check_config (cached: the file is read and its rows checked once)
        self._split = _prepare(config.model_dump_json(), *_file_version(config.path))
        self.system_prompt = config.system_prompt
        self.action_vocabulary = tuple(config.action_vocabulary) if config.action_vocabulary else None
        self.seed: int | None = None
        """The seed of the current episode's ``reset``."""
        self.row: int | None = None
        """Index (0-based, in the file) of the current episode's row."""
        self.served_split: str | None = None
        """``train`` or ``heldout``: the split the current row came from (``all``: ``train``)."""
        self._reference: Any = None
        self.turns = 0
        self.done = True

    @property
    def train_rows(self) -> tuple[int, ...]:
        return self._split.train

    @property
    def heldout_rows(self) -> tuple[int, ...]:
        return self._split.heldout

    def pick(self, seed: int) -> tuple[int, str, int]:
        """``(row index, split, epoch)`` that ``reset(seed)`` serves."""
        cfg = self.config
        split = "heldout" if cfg.split == "heldout" else "train"
        if cfg.split == "auto":
            episode = _eval_seeds(cfg.auto_eval_tasks, cfg.auto_eval_episodes).get(seed)
            if episode is not None:
                split, seed = "heldout", episode
        rows = self._split.heldout if split == "heldout" else self._split.train
        epoch, position = divmod(seed, len(rows))
        return rows[permute(position, len(rows), f"{cfg.shuffle_seed}:{split}:{epoch}")], split, epoch

    async def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        cfg = self.config
        self.seed = seed
        self.row, self.served_split, epoch = self.pick(seed)
        row, where = self._split.rows[self.row]
        self.turns = 0
        self.done = False
        self._reference = row[cfg.answer_key]
        info: dict[str, Any] = {key: row[key] for key in cfg.info_keys}
        info.update(
            {
                "answer": self._reference,
                cfg.answer_key: self._reference,
                "question": row[cfg.prompt_key],
                "row": self.row,
                "location": where,
                "split": self.served_split,
                "epoch": epoch,
            }
        )
        return row[cfg.prompt_key], info

    async def step(self, action_text: str) -> StepResult:
        if self.done:
            raise RuntimeError("step() after the episode ended; call reset()")
        cfg = self.config
        self.turns += 1
        if cfg.match == "none":
            self.done = True
            return StepResult("", 0.0, True, False, {"attempts": self.turns})
        extracted = extract_reply(action_text, cfg.match)
        ok = _correct(extracted, self._reference, cfg.match)
        info = {"success": ok, "attempts": self.turns, "extracted": extracted}
        if ok or self.turns >= cfg.max_turns:
            self.done = True
            return StepResult(
                "Correct." if ok else "Wrong.",
                cfg.correct_reward if ok else cfg.wrong_reward,
                True,
                False,
                info,
            )
        shown = (extracted or "(none)")[:40]
        feedback = (cfg.feedback_template or "").format(
            answer=shown, turn=self.turns, turns_left=cfg.max_turns - self.turns
        )
        return StepResult(feedback, cfg.wrong_reward, False, False, info)

    async def close(self) -> None:
        self.done = True
