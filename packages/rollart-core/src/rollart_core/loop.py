"""The training loop's entry points (kept at this path for callers of ``rollart_core.loop``); the
loop itself is the control plane in :mod:`rollart_core.control`."""

from rollart_core.control.admission import next_task, on_time
from rollart_core.control.train import CONSOLE_KEYS, evaluate, rollout_step, train

__all__ = ["CONSOLE_KEYS", "evaluate", "next_task", "on_time", "rollout_step", "train"]
