"""Sokoban rules, generation (solvable by an independent solver, deterministic per seed), bad input."""

from __future__ import annotations

import random

import pytest
from pydantic import ValidationError

from rollart_env.sokoban import Board, SokobanConfig, SokobanEnv, parse_board, render, solve


def board(text: str) -> Board:
    return parse_board(text)


@pytest.mark.parametrize("num_boxes,size", [(1, 5), (1, 6), (2, 7), (3, 8)])
async def test_every_generated_board_is_unsolved_and_solvable(num_boxes: int, size: int) -> None:
    env = SokobanEnv(SokobanConfig(num_boxes=num_boxes, size=size, reverse_steps=40))
    for seed in range(30):
        obs, info = await env.reset(seed)
        b = parse_board(obs)
        assert len(b.boxes) == len(b.targets) == num_boxes
        assert not b.solved()
        assert b.player not in b.walls and not (b.boxes & b.walls)
        # the outer ring is wall
        assert all((0, c) in b.walls and (size - 1, c) in b.walls for c in range(size))
        sol = solve(b)
        assert sol is not None, obs
        assert len(sol) <= info["reverse_solution_len"]  # the backwards walk is one (longer) solution


async def test_replaying_the_solution_through_step_solves_with_reward() -> None:
    env = SokobanEnv(SokobanConfig(num_boxes=2, size=7, reverse_steps=60))
    obs, _ = await env.reset(11)
    moves = solve(parse_board(obs))
    assert moves
    total = 0.0
    for i, m in enumerate(moves):
        res = await env.step(m)
        total += res.reward
        assert res.terminated is (i == len(moves) - 1)
    assert res.info["success"] and total == 1.0
    with pytest.raises(RuntimeError):
        await env.step("U")


async def test_deterministic_given_seed_and_seeds_differ() -> None:
    a, b = SokobanEnv(), SokobanEnv()
    assert (await a.reset(5))[0] == (await b.reset(5))[0]
    boards = {(await a.reset(s))[0] for s in range(20)}
    assert len(boards) >= 15


def test_push_rules() -> None:
    b = board("######\n#P B.#\n#  T #\n######".replace(" ", "."))
    assert b.push("R") == (True, 0) and b.player == (1, 2)
    # pushing the box into free floor moves both
    assert b.push("R") == (True, 0) and b.player == (1, 3) and (1, 4) in b.boxes
    # box against the wall: blocked, nothing moves
    assert b.push("R") == (False, 0) and b.player == (1, 3) and (1, 4) in b.boxes
    # walking into a wall is a no-op
    b2 = board("#####\n#P..#\n#B..#\n#T..#\n#####")
    assert b2.push("U") == (False, 0) and b2.player == (1, 1)
    # pushing onto the target counts +1; pulling is impossible: moving away leaves the box
    assert b2.push("D") == (True, 1) and b2.solved()
    assert b2.push("U") == (True, 0) and (3, 1) in b2.boxes


def test_two_boxes_in_a_row_cannot_be_pushed() -> None:
    b = board("#######\n#PBB.T#\n#....T#\n#######")
    assert b.push("R") == (False, 0)
    assert b.player == (1, 1) and b.boxes == {(1, 2), (1, 3)}


def test_render_parse_round_trip() -> None:
    text = "#####\n#+B.#\n#.*.#\n#...#\n#####"
    b = parse_board(text)
    assert render(b) == text
    assert solve(b) is not None


def test_unsolvable_board_detected_by_solver() -> None:
    # box in a corner that is not a target can never move
    assert solve(board("#####\n#B..#\n#.P.#\n#..T#\n#####")) is None


@pytest.mark.parametrize("bad", ["", "hello", "UU", "north", "42", "?"])
async def test_unparsable_action_penalised_episode_continues(bad: str) -> None:
    env = SokobanEnv(SokobanConfig(format_penalty=-0.3))
    obs, _ = await env.reset(3)
    res = await env.step(bad)
    assert "Invalid action" in res.observation and obs in res.observation
    assert res.reward == -0.3 and not res.terminated and not res.truncated
    assert res.info["invalid"]


@pytest.mark.parametrize("text,expected", [("u", "U"), (" Left ", "L"), ("**right**", "R"), ("down.", "D")])
async def test_action_spellings(text: str, expected: str) -> None:
    a, b = SokobanEnv(), SokobanEnv()
    await a.reset(9)
    await b.reset(9)
    assert (await a.step(text)).observation == (await b.step(expected)).observation


async def test_truncation_at_max_steps() -> None:
    env = SokobanEnv(SokobanConfig(max_steps=3))
    await env.reset(1)
    results = [await env.step("x") for _ in range(3)]
    assert [r.truncated for r in results] == [False, False, True]


def test_invalid_config_names_the_field() -> None:
    with pytest.raises(ValidationError, match="size"):
        SokobanConfig(size=2)
    with pytest.raises(ValidationError, match="num_boxes"):
        SokobanConfig(size=4, num_boxes=4)
    with pytest.raises(ValidationError, match="bogus"):
        SokobanConfig.model_validate({"bogus": 1})


def test_generation_is_quick_for_larger_boards() -> None:
    from rollart_env.sokoban import generate_board

    cfg = SokobanConfig(size=10, num_boxes=4, wall_prob=0.3, reverse_steps=200)
    for s in range(20):
        b, sol = generate_board(cfg, random.Random(s))
        replay = b.copy()
        for m in sol:
            replay.push(m)
        assert replay.solved()  # the recorded backwards walk, replayed forwards, solves the board


async def test_instructions_off_leaves_the_board_as_the_whole_prompt() -> None:
    with_text, bare = SokobanEnv(), SokobanEnv(SokobanConfig(instructions=False))
    assert with_text.system_prompt and "U, D, L or R" in with_text.system_prompt
    assert bare.system_prompt is None and SokobanEnv.system_prompt == with_text.system_prompt
    # the observation (the board) and the rules of play are unchanged
    assert await bare.reset(3) == await with_text.reset(3)
    for action in "UDLR":
        assert await bare.step(action) == await with_text.step(action)
