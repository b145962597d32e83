"""Tests for the FrozenLake environment.

Solvability and paths are checked with a BFS written here, independent of the module's own
``shortest_path_length``.
"""

from __future__ import annotations

import random
from collections import deque

import pytest
from pydantic import ValidationError

from rollart_env.frozenlake import FrozenLakeConfig, FrozenLakeEnv, generate_map

MOVES = {"L": (0, -1), "D": (1, 0), "R": (0, 1), "U": (-1, 0)}


# independent helpers ---------------------------------------------------------------------------


def bfs_paths(rows: list[str]) -> dict[tuple[int, int], str]:
    """Every cell reachable from (0,0) without entering a hole, with an action string to reach it.

    The goal is terminal, so paths never pass *through* G (and holes are never entered).
    """
    n = len(rows)
    paths = {(0, 0): ""}
    q = deque([(0, 0)])
    while q:
        r, c = q.popleft()
        if rows[r][c] == "G":
            continue
        for a, (dr, dc) in MOVES.items():
            rr, cc = r + dr, c + dc
            if 0 <= rr < n and 0 <= cc < n and (rr, cc) not in paths and rows[rr][cc] != "H":
                paths[(rr, cc)] = paths[(r, c)] + a
                q.append((rr, cc))
    return paths


def player_pos(obs: str) -> tuple[int, int]:
    """Position of the single "P" in the grid part (last ``size`` lines) of an observation."""
    hits = [(r, c) for r, line in enumerate(obs.splitlines()) for c, ch in enumerate(line) if ch == "P"]
    assert len(hits) == 1, obs
    return hits[0]


def grid_lines(obs: str, size: int) -> list[str]:
    return obs.splitlines()[-size:]


async def new_env(seed: int, **cfg) -> tuple[FrozenLakeEnv, str, dict]:
    env = FrozenLakeEnv(FrozenLakeConfig(**cfg))
    obs, info = await env.reset(seed)
    return env, obs, info


# determinism and map generation ----------------------------------------------------------------


@pytest.mark.parametrize("slippery", [False, True])
async def test_same_seed_same_map_and_observations(slippery: bool) -> None:
    actions = list("RDRDLLUURRDDRRDD")
    runs = []
    for _ in range(2):
        env, obs, info = await new_env(123, size=5, hole_prob=0.25, max_steps=100, slippery=slippery)
        trace = [obs]
        for a in actions:
            res = await env.step(a)
            trace.append((res.observation, res.reward, res.terminated, res.truncated))
            if res.terminated or res.truncated:
                break
        runs.append((info["map"], trace))
    assert runs[0] == runs[1]


async def test_reset_with_same_seed_on_reused_env_reproduces_map() -> None:
    env, obs1, info1 = await new_env(7, size=6)
    await env.step("R")
    obs2, info2 = await env.reset(7)
    assert info1["map"] == info2["map"]
    assert obs1 == obs2


async def test_different_seeds_give_different_maps() -> None:
    maps = set()
    for seed in range(20):
        _, _, info = await new_env(seed, size=5, hole_prob=0.3)
        maps.add(tuple(info["map"]))
    assert len(maps) >= 18


@pytest.mark.parametrize("size,hole_prob", [(2, 0.5), (4, 0.2), (5, 0.6), (8, 0.3), (12, 0.4)])
async def test_every_map_is_solvable_with_start_and_goal_corners(size: int, hole_prob: float) -> None:
    for seed in range(40):
        _, _obs, info = await new_env(seed, size=size, hole_prob=hole_prob)
        rows = info["map"]
        assert len(rows) == size and all(len(r) == size for r in rows)
        assert set("".join(rows)) <= set("SFHG")
        assert rows[0][0] == "S"
        assert rows[-1][-1] == "G"
        assert "".join(rows).count("S") == 1 and "".join(rows).count("G") == 1
        assert (size - 1, size - 1) in bfs_paths(rows), rows
        # the optimal length reported in info is the BFS distance
        assert info["optimal_steps"] == len(bfs_paths(rows)[(size - 1, size - 1)])


@pytest.mark.timeout(20)
@pytest.mark.parametrize("seed", [0, 1, 2])
async def test_dense_large_map_is_generated_quickly_and_solvable(seed: int) -> None:
    # Unsolvable draws are almost certain here; generation must still end, with a solvable map.
    _, _, info = await new_env(seed, size=12, hole_prob=0.79)
    rows = info["map"]
    assert rows[0][0] == "S" and rows[-1][-1] == "G"
    assert (11, 11) in bfs_paths(rows)
    assert info["optimal_steps"] == len(bfs_paths(rows)[(11, 11)])


@pytest.mark.parametrize("hole_prob", [0.1, 0.2])
def test_hole_fraction_near_hole_prob(hole_prob: float) -> None:
    size, n_maps = 8, 300
    holes = cells = 0
    for seed in range(n_maps):
        rows = generate_map(size, hole_prob, random.Random(seed))
        inner = "".join(rows)[1:-1]  # exclude S and G
        holes += inner.count("H")
        cells += len(inner)
    # Rejection of unsolvable maps lowers the fraction slightly; binomial noise here is ~0.004.
    assert abs(holes / cells - hole_prob) < 0.03


def test_zero_hole_prob_gives_no_holes() -> None:
    for seed in range(10):
        rows = generate_map(5, 0.0, random.Random(seed))
        assert "H" not in "".join(rows)


# stepping -------------------------------------------------------------------------------------


async def test_reset_observation_marks_player_at_start() -> None:
    _, obs, info = await new_env(3, size=5, hole_prob=0.3)
    lines = grid_lines(obs, 5)
    assert player_pos("\n".join(lines)) == (0, 0)
    expected = [list(r) for r in info["map"]]
    expected[0][0] = "P"
    assert lines == ["".join(r) for r in expected]


async def test_reaching_goal_terminates_with_reward_one_and_success() -> None:
    for seed in range(10):
        env, _, info = await new_env(seed, size=6, hole_prob=0.3, max_steps=100)
        rows = info["map"]
        path = bfs_paths(rows)[(5, 5)]
        total = 0.0
        pos = (0, 0)
        for i, a in enumerate(path):
            res = await env.step(a)
            dr, dc = MOVES[a]
            pos = (pos[0] + dr, pos[1] + dc)
            total += res.reward
            last = i == len(path) - 1
            assert res.terminated is last
            assert res.truncated is False
            assert res.info["success"] is last
            assert res.info["cell"] == rows[pos[0]][pos[1]]
            # player drawn where the walk says it is, other cells unchanged
            lines = grid_lines(res.observation, 6)
            assert player_pos("\n".join(lines)) == pos
            exp = [list(r) for r in rows]
            exp[pos[0]][pos[1]] = "P"
            assert lines == ["".join(r) for r in exp]
        assert res.reward == 1.0
        assert total == 1.0
        with pytest.raises(RuntimeError):
            await env.step("L")


async def test_stepping_into_hole_terminates_with_zero_reward() -> None:
    checked = 0
    for seed in range(50):
        env, _, info = await new_env(seed, size=5, hole_prob=0.4, max_steps=100)
        rows = info["map"]
        paths = bfs_paths(rows)
        target = None
        for (r, c), path in sorted(paths.items(), key=lambda kv: len(kv[1])):
            if rows[r][c] == "G":
                continue
            for a, (dr, dc) in MOVES.items():
                rr, cc = r + dr, c + dc
                if 0 <= rr < 5 and 0 <= cc < 5 and rows[rr][cc] == "H":
                    target = path + a
                    break
            if target:
                break
        if target is None:
            continue
        for a in target[:-1]:
            res = await env.step(a)
            assert not res.terminated
        res = await env.step(target[-1])
        assert res.terminated is True
        assert res.truncated is False
        assert res.reward == 0.0
        assert res.info["success"] is False
        assert res.info["cell"] == "H"
        with pytest.raises(RuntimeError):
            await env.step("R")
        checked += 1
    assert checked >= 20


@pytest.mark.parametrize("action,start", [("U", (0, 0)), ("L", (0, 0))])
async def test_moving_into_wall_keeps_position(action: str, start: tuple[int, int]) -> None:
    env, _, _ = await new_env(0, size=4, hole_prob=0.0, max_steps=10)
    res = await env.step(action)
    assert player_pos(res.observation) == start
    assert res.terminated is False and res.truncated is False
    assert res.reward == 0.0
    assert res.info["cell"] == "S"


async def test_moving_into_far_walls_keeps_position() -> None:
    env, _, _ = await new_env(0, size=3, hole_prob=0.0, max_steps=50)
    # walk to the top-right corner, then push against the right and top walls
    for a in "RR":
        await env.step(a)
    for a in "RRUU":
        res = await env.step(a)
        assert player_pos(res.observation) == (0, 2)
        assert not res.terminated
    # bottom-left corner, push down and left
    for a in "LL":
        await env.step(a)
    for a in "DD":
        await env.step(a)
    for a in "DL":
        res = await env.step(a)
        assert player_pos(res.observation) == (2, 0)
        assert not res.terminated


@pytest.mark.parametrize("bad", ["hello", "", "   ", "?", "xyz", "42"])
async def test_invalid_action_penalised_and_episode_continues(bad: str) -> None:
    env, _obs0, _info = await new_env(5, size=4, hole_prob=0.0, max_steps=20, invalid_penalty=-0.25)
    res = await env.step(bad)
    assert "Invalid" in res.observation
    assert res.reward == -0.25
    assert res.terminated is False
    assert res.truncated is False
    assert player_pos("\n".join(grid_lines(res.observation, 4))) == (0, 0)
    # the episode continues and a valid action still moves the player
    res = await env.step("D")
    assert "Invalid" not in res.observation
    assert player_pos(res.observation) == (1, 0)
    assert res.reward == 0.0


async def test_full_word_actions_use_first_letter() -> None:
    env, _, _ = await new_env(5, size=4, hole_prob=0.0, max_steps=20)
    res = await env.step("  right ")
    assert player_pos(res.observation) == (0, 1)
    res = await env.step("down")
    assert player_pos(res.observation) == (1, 1)


async def test_max_steps_truncates() -> None:
    env, _, _ = await new_env(0, size=4, hole_prob=0.0, max_steps=3)
    for i in range(3):
        res = await env.step("U")  # into the wall: never terminates
        assert res.terminated is False
        assert res.truncated is (i == 2)
    with pytest.raises(RuntimeError):
        await env.step("R")


async def test_invalid_actions_count_towards_truncation() -> None:
    env, _, _ = await new_env(0, size=4, hole_prob=0.0, max_steps=2, invalid_penalty=-1.0)
    res = await env.step("nope")
    assert res.truncated is False
    res = await env.step("nope")
    assert res.truncated is True and res.terminated is False
    assert res.reward == -1.0
    with pytest.raises(RuntimeError):
        await env.step("R")


async def test_goal_on_last_allowed_step_is_terminated_not_truncated() -> None:
    env, _, info = await new_env(0, size=3, hole_prob=0.0, max_steps=4)
    path = bfs_paths(info["map"])[(2, 2)]
    assert len(path) == 4
    for a in path:
        res = await env.step(a)
    assert res.terminated is True
    assert res.truncated is False
    assert res.reward == 1.0


async def test_step_before_reset_and_after_close_raise() -> None:
    env = FrozenLakeEnv()
    with pytest.raises(RuntimeError):
        await env.step("R")
    await env.reset(0)
    await env.close()
    with pytest.raises(RuntimeError):
        await env.step("R")


# config -----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "kwargs,field",
    [
        ({"size": 1}, "size"),
        ({"size": 13}, "size"),
        ({"hole_prob": 0.9}, "hole_prob"),
        ({"hole_prob": -0.1}, "hole_prob"),
        ({"max_steps": 0}, "max_steps"),
        ({"colour": "blue"}, "colour"),
    ],
)
def test_invalid_config_raises_validation_error_naming_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ValidationError) as ei:
        FrozenLakeConfig(**kwargs)
    locs = [e["loc"] for e in ei.value.errors()]
    assert any(field in loc for loc in locs), locs
    assert field in str(ei.value)


def test_default_config_is_valid() -> None:
    c = FrozenLakeConfig()
    assert 2 <= c.size <= 12 and 0.0 <= c.hole_prob < 0.8


async def test_instructions_off_leaves_the_map_as_the_whole_prompt() -> None:
    with_text, bare = FrozenLakeEnv(), FrozenLakeEnv(FrozenLakeConfig(instructions=False))
    assert with_text.system_prompt and "L, D, R or U" in with_text.system_prompt
    assert bare.system_prompt is None and FrozenLakeEnv.system_prompt == with_text.system_prompt
    # the observation (the map with the player marked) is unchanged
    assert await bare.reset(5) == await with_text.reset(5)
    assert (await bare.step("D")).observation == (await with_text.step("D")).observation
