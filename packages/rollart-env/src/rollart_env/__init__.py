"""rollart-env: environments (text in, text out) for agentic RL.

Public API:
- :class:`FrozenLakeEnv` — a grid with a fresh solvable random map per seed, discrete actions.
"""

from rollart_env.frozenlake import (
    ACTIONS,
    FrozenLakeConfig,
    FrozenLakeEnv,
    generate_map,
    shortest_path_length,
)

__all__ = ["ACTIONS", "FrozenLakeConfig", "FrozenLakeEnv", "generate_map", "shortest_path_length"]
