"""SIGTERM stops a run the way Ctrl-C does: it cleans up what it started.

Schedulers, ``timeout``, ``kill`` and container runtimes stop a process with SIGTERM. Left to Python's
default the driver dies on the spot; left to Ray's (``ray.init`` installs one that exits at once) the
driver aborts and leaves Ray's agents, spawned trainer ranks and engines behind. :func:`sigterm_as_sigint`
makes SIGTERM take the SIGINT path instead: under ``asyncio.run`` the main task is cancelled, so every
stage's shutdown runs (engines stopped, Ray shut down) and the run's report is written;
outside it, :class:`Terminated` (a ``KeyboardInterrupt``) is raised. :class:`RayCluster` puts this
handler back after ``ray.init`` took SIGTERM over.

    sigterm_as_sigint()            # at the top of a command's main()
    ...
    except KeyboardInterrupt:
        return 143 if terminated() else 130
"""

from __future__ import annotations

import signal
import threading
from types import FrameType

__all__ = ["Terminated", "sigterm_as_sigint", "terminated"]

_received = False


class Terminated(KeyboardInterrupt):
    """Raised where SIGTERM arrives when no SIGINT handler of asyncio's is there to cancel the run."""


def _on_sigterm(signum: int, frame: FrameType | None) -> None:
    global _received
    _received = True
    handler = signal.getsignal(signal.SIGINT)
    if callable(handler) and handler is not signal.default_int_handler:
        handler(signal.SIGINT, frame)  # asyncio.Runner's: cancel the main task (a second time: raise)
        return
    raise Terminated(f"signal {signum} (SIGTERM)")


def sigterm_as_sigint() -> bool:
    """Install the handler (main thread only; returns whether it did)."""
    if threading.current_thread() is not threading.main_thread():
        return False
    signal.signal(signal.SIGTERM, _on_sigterm)
    return True


def terminated() -> bool:
    """Whether a SIGTERM arrived (the exit status is then 143, not Ctrl-C's 130)."""
    return _received
