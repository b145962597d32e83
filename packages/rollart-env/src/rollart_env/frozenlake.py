"""FrozenLake-style grid with a fresh solvable random map for every seed.

The map is part of every observation, so a policy must read it: holes are placed at random
(``hole_prob``), the start is the top-left corner and the goal the bottom-right, and a map is
redrawn until a path exists. Actions are single letters (``L D R U``), so an agent can be limited
to them with ``allowed_token_ids``. Deterministic given the seed.
"""

from __future__ import annotations

import random
from collections import deque
from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from rollart_core.types import StepResult

__all__ = ["ACTIONS", "FrozenLakeConfig", "FrozenLakeEnv", "generate_map", "shortest_path_length"]

ACTIONS = {"L": (0, -1), "D": (1, 0), "R": (0, 1), "U": (-1, 0)}


class FrozenLakeConfig(BaseModel):
    model_config = ConfigDict(extra="forbid", use_attribute_docstrings=True)

    size: int = Field(4, ge=2, le=12)
    hole_prob: float = Field(0.2, ge=0.0, lt=0.8)
    max_steps: int = Field(12, ge=1)
    invalid_penalty: float = 0.0
    """Reward for an action that does not parse (the episode continues)."""
    slippery: bool = False
    instructions: bool = True
    """Send the task's instructions as the system prompt. False: the observation (the map) is the
    whole prompt, a third of the tokens; a randomly initialised policy cannot read instructions."""


MAX_MAP_DRAWS = 10_000


def generate_map(size: int, hole_prob: float, rng: random.Random) -> list[str]:
    """A random map with S at (0,0), G at the far corner, and at least one safe path.

    Redrawn until solvable; after ``MAX_MAP_DRAWS`` draws (only dense, large maps get there: at
    ``size=12, hole_prob=0.7`` a draw is solvable about once in a million) a random monotone path
    is carved through the last draw, so every valid config terminates quickly.
    """
    for _ in range(MAX_MAP_DRAWS):
        grid = [["H" if rng.random() < hole_prob else "F" for _ in range(size)] for _ in range(size)]
        grid[0][0], grid[-1][-1] = "S", "G"
        rows = ["".join(r) for r in grid]
        if shortest_path_length(rows) is not None:
            return rows
    moves = ["D"] * (size - 1) + ["R"] * (size - 1)
    rng.shuffle(moves)
    r = c = 0
    for m in moves:
        r, c = (r + 1, c) if m == "D" else (r, c + 1)
        if grid[r][c] == "H":
            grid[r][c] = "F"
    return ["".join(row) for row in grid]


def shortest_path_length(rows: list[str]) -> int | None:
    n = len(rows)
    seen = {(0, 0)}
    q: deque[tuple[int, int, int]] = deque([(0, 0, 0)])
    while q:
        r, c, d = q.popleft()
        if rows[r][c] == "G":
            return d
        for dr, dc in ACTIONS.values():
            rr, cc = r + dr, c + dc
            if 0 <= rr < n and 0 <= cc < n and (rr, cc) not in seen and rows[rr][cc] != "H":
                seen.add((rr, cc))
                q.append((rr, cc, d + 1))
    return None


class FrozenLakeEnv:
    """Reach G from S without stepping into H. Reward 1 at the goal, else 0."""

    Config = FrozenLakeConfig
    action_vocabulary = tuple(ACTIONS)
    system_prompt: str | None = (
        "Move on the frozen lake from S to G without falling into a hole H. Reply with one letter: L, D, R or U."
    )

    def __init__(self, config: FrozenLakeConfig | None = None) -> None:
        self.config = config or FrozenLakeConfig()
        if not self.config.instructions:
            self.system_prompt = None
        self.rows: list[str] = []
        self.pos = (0, 0)
        self.steps = 0
        self.done = True
        self._rng = random.Random(0)

    def render(self) -> str:
        out = []
        for r, row in enumerate(self.rows):
            chars = list(row)
            if r == self.pos[0]:
                chars[self.pos[1]] = "P"
            out.append("".join(chars))
        return "\n".join(out)

    async def reset(self, seed: int) -> tuple[str, dict[str, Any]]:
        self._rng = random.Random(seed)
        self.rows = generate_map(self.config.size, self.config.hole_prob, self._rng)
        self.pos = (0, 0)
        self.steps = 0
        self.done = False
        info = {"map": list(self.rows), "optimal_steps": shortest_path_length(self.rows)}
        return self.render(), info

    async def step(self, action_text: str) -> StepResult:
        if self.done:
            raise RuntimeError("step() after the episode ended; call reset()")
        self.steps += 1
        action = action_text.strip()[:1].upper()
        truncated = self.steps >= self.config.max_steps
        if action not in ACTIONS:
            self.done = truncated
            return StepResult(
                f"Invalid action {action_text.strip()[:20]!r}; reply with L, D, R or U.\n{self.render()}",
                self.config.invalid_penalty,
                False,
                truncated,
                {"invalid": True},
            )
        if self.config.slippery and self._rng.random() < 1 / 3:
            action = self._rng.choice(list(ACTIONS))
        dr, dc = ACTIONS[action]
        n = self.config.size
        self.pos = (min(max(self.pos[0] + dr, 0), n - 1), min(max(self.pos[1] + dc, 0), n - 1))
        cell = self.rows[self.pos[0]][self.pos[1]]
        terminated = cell in "HG"
        reward = 1.0 if cell == "G" else 0.0
        self.done = terminated or truncated
        return StepResult(
            self.render(),
            reward,
            terminated,
            truncated and not terminated,
            {"cell": cell, "success": cell == "G"},
        )

    async def close(self) -> None:
        self.done = True
