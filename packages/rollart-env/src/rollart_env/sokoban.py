"""Sokoban on small boards, generated solvable for every seed.

Generation plays the game backwards: boxes start on their targets (a solved board) and the player
walks around at random, sometimes *pulling* a box behind it. Every pull is the exact reverse of a
push, so replaying the walk forwards solves the board: every generated board is solvable by
construction (the tests re-check this with an independent forward solver, :func:`solve`).

Board symbols (also in the system prompt)::

    #  wall      .  floor     T  target
    B  box       *  box on a target
    P  player    +  player on a target

Actions are single letters ``U D L R`` (one token each, usable with ``allowed_token_ids``); the
words ``up down left right`` are accepted too. Deterministic given the seed.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, model_validator

from rollart_core.types import StepResult
from rollart_env._text import parse_direction

__all__ = ["MOVES", "Board", "SokobanConfig", "SokobanEnv", "generate_board", "render", "solve"]

MOVES = {"U": (-1, 0), "D": (1, 0), "L": (0, -1), "R": (0, 1)}
Pos = tuple[int, int]


class SokobanConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    size: int = Field(6, ge=4, le=10)
    """Board side including the outer wall ring (so ``size - 2`` cells of play per side)."""
    num_boxes: int = Field(1, ge=1, le=4)
    wall_prob: float = Field(0.1, ge=0.0, le=0.4)
    """Chance of each inner cell becoming a wall (the floor is kept connected)."""
    reverse_steps: int = Field(30, ge=1, le=1000)
    """Length of the backwards random walk; longer walks give harder boards."""
    max_steps: int = Field(30, ge=1)
    format_penalty: float = -0.1
    """Reward for an action that does not parse (the episode continues)."""
    step_penalty: float = 0.0
    box_reward: float = 0.0
    """Shaping: +box_reward when a box reaches a target, -box_reward when one leaves it."""
    success_reward: float = 1.0
    instructions: bool = True
    """Send the rules as the system prompt. False: the board is the whole prompt, about a quarter of
    the tokens of a 6x6 turn (49 instead of 186 under the tiny character-level tokenizer); a
    randomly initialised policy cannot read them."""

    @model_validator(mode="after")
    def _fits(self) -> SokobanConfig:
        inner = (self.size - 2) ** 2
        if self.num_boxes * 2 + 2 > inner:
            raise ValueError(f"num_boxes={self.num_boxes} does not fit a board of size {self.size}")
        return self


class Board:
    """Walls, targets, boxes and the player; immutable parts shared between copies."""

    __slots__ = ("boxes", "player", "size", "targets", "walls")

    def __init__(
        self, size: int, walls: frozenset[Pos], targets: frozenset[Pos], boxes: set[Pos], player: Pos
    ):
        self.size, self.walls, self.targets, self.boxes, self.player = size, walls, targets, boxes, player

    def copy(self) -> Board:
        return Board(self.size, self.walls, self.targets, set(self.boxes), self.player)

    def solved(self) -> bool:
        return self.boxes == set(self.targets)

    def push(self, action: str) -> tuple[bool, int]:
        """Apply a move; returns (moved, change in boxes on targets). Blocked moves change nothing."""
        dr, dc = MOVES[action]
        r, c = self.player
        nxt = (r + dr, c + dc)
        if nxt in self.walls:
            return False, 0
        if nxt in self.boxes:
            beyond = (r + 2 * dr, c + 2 * dc)
            if beyond in self.walls or beyond in self.boxes:
                return False, 0
            self.boxes.remove(nxt)
            self.boxes.add(beyond)
            self.player = nxt
            return True, (beyond in self.targets) - (nxt in self.targets)
        self.player = nxt
        return True, 0


def render(board: Board) -> str:
    rows = []
    for r in range(board.size):
        row = []
        for c in range(board.size):
            p = (r, c)
            if p in board.walls:
                ch = "#"
            elif p == board.player:
                ch = "+" if p in board.targets else "P"
            elif p in board.boxes:
                ch = "*" if p in board.targets else "B"
            else:
                ch = "T" if p in board.targets else "."
            row.append(ch)
        rows.append("".join(row))
    return "\n".join(rows)


def parse_board(text: str) -> Board:
    """Inverse of :func:`render` (used by tests and tools)."""
    rows = text.strip("\n").split("\n")
    walls, targets, boxes, player = set(), set(), set(), None
    for r, row in enumerate(rows):
        for c, ch in enumerate(row):
            if ch == "#":
                walls.add((r, c))
            if ch in "T*+":
                targets.add((r, c))
            if ch in "B*":
                boxes.add((r, c))
            if ch in "P+":
                player = (r, c)
    if player is None:
        raise ValueError("board has no player")
    return Board(len(rows), frozenset(walls), frozenset(targets), boxes, player)


def _connected(floor: set[Pos]) -> set[Pos]:
    if not floor:
        return set()
    start = min(floor)
    seen = {start}
    q = deque([start])
    while q:
        r, c = q.popleft()
        for dr, dc in MOVES.values():
            n = (r + dr, c + dc)
            if n in floor and n not in seen:
                seen.add(n)
                q.append(n)
    return seen


MAX_DRAWS = 1000


def generate_board(cfg: SokobanConfig, rng: random.Random) -> tuple[Board, list[str]]:
    """A solvable, unsolved board and the forward solution implied by its backwards walk."""
    n = cfg.size
    for _ in range(MAX_DRAWS):
        inner = [(r, c) for r in range(1, n - 1) for c in range(1, n - 1)]
        floor = {p for p in inner if rng.random() >= cfg.wall_prob}
        floor = _connected(floor)
        if len(floor) < cfg.num_boxes * 2 + 2:
            continue
        walls = frozenset((r, c) for r in range(n) for c in range(n)) - floor
        cells = sorted(floor)
        targets = rng.sample(cells, cfg.num_boxes)
        free = [p for p in cells if p not in targets]
        board = Board(n, walls, frozenset(targets), set(targets), rng.choice(free))
        reverse: list[str] = []
        for _ in range(cfg.reverse_steps):
            a = rng.choice("UDLR")
            dr, dc = MOVES[a]
            r, c = board.player
            dest = (r + dr, c + dc)
            if dest in walls or dest in board.boxes:
                continue
            behind = (r - dr, c - dc)
            if behind in board.boxes and rng.random() < 0.7:  # pull the box along
                board.boxes.remove(behind)
                board.boxes.add((r, c))
                # forward: from dest, moving opposite to a pushes this box from (r,c) to behind
            board.player = dest
            reverse.append(a)
        if board.solved():
            continue
        opposite = {"U": "D", "D": "U", "L": "R", "R": "L"}
        return board, [opposite[a] for a in reversed(reverse)]
    raise RuntimeError(f"no unsolved board after {MAX_DRAWS} draws; raise reverse_steps or lower wall_prob")


def solve(board: Board, max_states: int = 200_000) -> list[str] | None:
    """Shortest solution (in moves) by breadth-first search over (player, boxes); None if none."""
    start = (board.player, frozenset(board.boxes))
    targets = board.targets
    prev: dict[Any, tuple[Any, str] | None] = {start: None}
    q = deque([start])
    while q:
        state = q.popleft()
        player, boxes = state
        if boxes == targets:
            path: list[str] = []
            cur = state
            while prev[cur] is not None:
                cur, a = prev[cur]  # type: ignore[misc]
                path.append(a)
            return path[::-1]
        for a, (dr, dc) in MOVES.items():
            nxt = (player[0] + dr, player[1] + dc)
            if nxt in board.walls:
                continue
            nb = boxes
            if nxt in boxes:
                beyond = (nxt[0] + dr, nxt[1] + dc)
                if beyond in board.walls or beyond in boxes:
                    continue
                nb = (boxes - {nxt}) | {beyond}
            ns = (nxt, nb)
            if ns not in prev:
                prev[ns] = (state, a)
                if len(prev) > max_states:
                    return None
                q.append(ns)
    return None


class SokobanEnv:
    """Push every box onto a target. Reward ``success_reward`` when solved, plus optional shaping."""

    Config = SokobanConfig
    action_vocabulary = ("U", "D", "L", "R")
    profile = "decode_heavy"
    """Many short turns with one-token actions."""
    system_prompt: str | None = (
        "Sokoban: push every box onto a target. # wall, . floor, T target, B box, * box on target, "
        "P you, + you on a target. You push boxes, never pull them. Reply with one letter: U, D, L or R."
    )

    def __init__(self, config: SokobanConfig | None = None) -> None:
        self.config = config or SokobanConfig()
        if not self.config.instructions:
            self.system_prompt = None
        self.board: Board | None = None
        self.steps = 0
        self.done = True
        self.solution: list[str] = []

    async def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self.board, self.solution = generate_board(self.config, random.Random(seed))
        self.steps = 0
        self.done = False
        return render(self.board), {
            "reverse_solution_len": len(self.solution),
            "num_boxes": self.config.num_boxes,
        }

    async def step(self, action_text: str) -> StepResult:
        if self.done or self.board is None:
            raise RuntimeError("step() after the episode ended; call reset()")
        cfg = self.config
        self.steps += 1
        truncated = self.steps >= cfg.max_steps
        action = parse_direction(action_text)
        if action is None:
            self.done = truncated
            return StepResult(
                f"Invalid action {action_text.strip()[:20]!r}; reply with U, D, L or R.\n{render(self.board)}",
                cfg.format_penalty,
                False,
                truncated,
                {"invalid": True},
            )
        moved, delta = self.board.push(action)
        solved = self.board.solved()
        reward = cfg.step_penalty + cfg.box_reward * delta + (cfg.success_reward if solved else 0.0)
        self.done = solved or truncated
        info = {
            "moved": moved,
            "boxes_on_target": len(self.board.boxes & self.board.targets),
            "success": solved,
        }
        return StepResult(render(self.board), reward, solved, truncated and not solved, info)

    async def close(self) -> None:
        self.done = True
