"""Adapters (gymnasium, GEM-style) and environments over HTTP with a real server on 127.0.0.1."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from rollart_core.errors import ConfigError, EnvError, InvalidActionError
from rollart_core.registry import build
from rollart_env import EnvServer, GemConfig, GemEnv, GymnasiumConfig, GymnasiumEnv, RemoteEnv, SokobanEnv
from rollart_env.calculator import CalculatorEnv


def lake(**kw) -> GymnasiumEnv:
    return GymnasiumEnv(
        GymnasiumConfig(
            env_id="FrozenLake-v1",
            make_kwargs={"is_slippery": False},
            action_names=["L", "D", "R", "U"],
            **kw,
        )
    )


async def test_gymnasium_round_trip_matches_the_raw_env() -> None:
    import gymnasium

    env = lake()
    raw = gymnasium.make("FrozenLake-v1", is_slippery=False, render_mode="ansi")
    obs, _info = await env.reset(3)
    raw.reset(seed=3)
    assert "S" in obs and "G" in obs and "\x1b" not in obs
    assert env.action_vocabulary == ("L", "D", "R", "U")
    # the default 4x4 map: D D R R D R reaches the goal
    for i, a in enumerate("DDRRDR"):
        res = await env.step(a)
        _r_obs, r_rew, r_term, _r_trunc, _ = raw.step("LDRU".index(a))
        assert res.reward == r_rew and res.terminated == r_term
        assert res.terminated is (i == 5)
    assert res.reward == 1.0
    await env.close()


async def test_gymnasium_bad_action_and_index_actions() -> None:
    env = lake(format_penalty=-0.25, max_steps=3)
    obs, _ = await env.reset(0)
    res = await env.step("jump")
    assert "Invalid action" in res.observation and obs in res.observation and res.reward == -0.25
    res = await env.step("1")  # by index: down
    assert not res.terminated and res.reward == 0.0
    res = await env.step("d")  # by name, case-insensitive
    assert res.truncated  # max_steps=3


def test_gymnasium_config_errors() -> None:
    with pytest.raises(ConfigError, match="action_names has 2 names"):
        GymnasiumEnv(GymnasiumConfig(env_id="FrozenLake-v1", action_names=["a", "b"]))
    with pytest.raises(ConfigError, match="cannot make"):
        GymnasiumEnv(GymnasiumConfig(env_id="NoSuchEnv-v9"))
    with pytest.raises(ConfigError, match="Discrete"):
        GymnasiumEnv(GymnasiumConfig(env_id="Pendulum-v1", render_mode=None))
    with pytest.raises(ConfigError, match=r"env_id"):
        build("env", "gymnasium", {"make_kwargs": {}}, "tasks.0.env.options")


class GuessTheNumber:
    """A GEM-style env (GEM's API: synchronous reset(seed)/step(action: str) on text)."""

    def __init__(self, high: int = 20) -> None:
        self.high = high

    def reset(self, seed: int | None = None):
        import random

        self.target = random.Random(seed).randint(1, self.high)
        self.turns = 0
        return f"Guess a number between 1 and {self.high}.", {"target": self.target}

    def step(self, action: str):
        self.turns += 1
        try:
            guess = int(action.strip())
        except ValueError:
            return "Please answer with a number.", -0.1, False, False, {}
        if guess == self.target:
            return "Correct!", 1.0, True, False, {}
        hint = "higher" if guess < self.target else "lower"
        return f"Try {hint}.", 0.0, False, self.turns >= 10, {}


def make_guess(high: int = 20) -> GuessTheNumber:
    return GuessTheNumber(high)


@pytest.mark.parametrize("threaded", [False, True])
async def test_gem_env_by_factory_binary_search(threaded: bool) -> None:
    env = GemEnv(GemConfig(factory=f"{__name__}:make_guess", kwargs={"high": 100}, threaded=threaded))
    _obs, info = await env.reset(42)
    lo, hi = 1, 100
    for _ in range(10):
        mid = (lo + hi) // 2
        res = await env.step(str(mid))
        if res.terminated:
            break
        lo, hi = (mid + 1, hi) if "higher" in res.observation else (lo, mid - 1)
    assert res.terminated and res.reward == 1.0 and mid == info["target"]
    bad = await env.step("forty-two")
    assert bad.reward == -0.1 and not bad.terminated


def test_gem_config_needs_exactly_one_source() -> None:
    with pytest.raises(ValidationError, match="exactly one"):
        GemConfig()
    with pytest.raises(ValidationError, match="exactly one"):
        GemConfig(env_id="game:GuessTheNumber-v0", factory="x:y")
    with pytest.raises(ConfigError, match=r"package\.module:name"):
        GemEnv(GemConfig(factory="nocolon"))


async def test_remote_env_over_http_matches_local() -> None:
    async with EnvServer(SokobanEnv, max_sessions=2) as server:
        assert server.url.startswith("http://127.0.0.1:")
        remote = await RemoteEnv.connect(server.url)
        local = SokobanEnv()
        assert remote.action_vocabulary == local.action_vocabulary
        assert remote.system_prompt == local.system_prompt
        r_obs, r_info = await remote.reset(17)
        l_obs, l_info = await local.reset(17)
        assert (r_obs, r_info) == (l_obs, l_info)
        for a in ["U", "L", "nonsense", "D", "R"]:
            r, loc = await remote.step(a), await local.step(a)
            assert (r.observation, r.reward, r.terminated, r.truncated, r.info) == (
                loc.observation,
                loc.reward,
                loc.terminated,
                loc.truncated,
                loc.info,
            )
        # session limit, then close frees the session
        other = await RemoteEnv.connect(server.url)
        with pytest.raises(EnvError, match="max_sessions"):
            await RemoteEnv.connect(server.url)
        await other.close()
        assert len(server.sessions) == 1
        await remote.close()
        assert server.sessions == {} and server.created == 2


async def test_remote_errors_are_env_errors() -> None:
    async with EnvServer(SokobanEnv) as server:
        env = await RemoteEnv.connect(server.url)
        with pytest.raises(EnvError, match="RuntimeError: step\\(\\) after the episode ended"):
            await env.step("U")  # the server's env raised: 500 with the cause
        await env.reset(1)
        real, env.session_id = env.session_id, "nope"
        with pytest.raises(EnvError, match="404"):
            await env.step("U")
        env.session_id = real
        await env.close()
        import aiohttp

        async with aiohttp.ClientSession() as http:
            async with http.post(f"{server.url}/sessions") as r:
                sid = (await r.json())["session"]
            async with http.post(f"{server.url}/sessions/{sid}/reset", json={"seed": "x"}) as r:
                assert r.status == 422
    # server gone: a clear error, not a hang
    with pytest.raises(EnvError, match=r"ClientConnectorError|Cannot connect"):
        await RemoteEnv.connect(server.url, timeout_s=5)


def test_remote_config_is_validated() -> None:
    with pytest.raises(ConfigError, match="url"):
        build("env", "remote", {"url": "ftp://x"}, "tasks.0.env.options")


class _RejectingEnv(SokobanEnv):
    """Sokoban whose step rejects the action ``boom`` as the model's fault (InvalidActionError)."""

    async def step(self, action_text: str):  # type: ignore[no-untyped-def]
        if action_text == "boom":
            raise InvalidActionError("boom is not an action", reward=-1.0)
        return await super().step(action_text)


async def test_calculator_overflow_over_http_is_an_observation_not_a_500() -> None:
    async with EnvServer(CalculatorEnv) as server:
        env = await RemoteEnv.connect(server.url)
        await env.reset(0)
        res = await env.step("<calc>1e308 / 0.3</calc>")
        assert res.observation.startswith("calc error: ") and not res.terminated
        await env.close()


async def test_an_invalid_action_crosses_http_as_itself_with_its_reward() -> None:
    async with EnvServer(_RejectingEnv) as server:
        env = await RemoteEnv.connect(server.url)
        await env.reset(1)
        with pytest.raises(InvalidActionError, match="boom is not an action") as info:
            await env.step("boom")
        assert info.value.reward == -1.0
        assert (await env.step("U")).observation  # the session is still served
        await env.close()
