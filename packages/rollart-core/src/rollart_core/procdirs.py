"""Private temporary directories owned by a process, and the sweep of those whose process died.

Engines and servers keep their sockets in a mode-0700 directory of the temp dir. A process that is
killed (SIGKILL, a Ray actor ended with ``ray.kill``, a worker's ``os._exit``) never runs the code that
would remove it, and a day of test runs or restarts piles hundreds of them up. The directory's name
carries the owner's PID and PID namespace; whoever makes a new one with the same prefix first removes
the ones whose owner is gone. Only directories of this user and of this PID namespace are touched (a
PID from another container's namespace means nothing here), and a live PID, even a stranger's that
reused the number, keeps its directory.

    path = owned_tempdir("rollart-rt-")     # /tmp/rollart-rt-<pidns>-<pid>-<random>
"""

from __future__ import annotations

import os
import shutil
import stat
import tempfile

__all__ = ["owned_tempdir", "sweep_orphans"]


def _pid_namespace() -> str:
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:  # no /proc (macOS): no sweep, the PID alone means too little
        return ""


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: alive
        return True
    return True


def owned_tempdir(prefix: str) -> str:
    """A new mode-0700 directory ``<tmp>/<prefix><pidns>-<pid>-<random>``, after sweeping the orphans
    of ``prefix`` (:func:`sweep_orphans`). The caller removes it when done; if it is killed first,
    the next caller's sweep does."""
    sweep_orphans(prefix)
    return tempfile.mkdtemp(prefix=f"{prefix}{_pid_namespace() or 'x'}-{os.getpid()}-")


def sweep_orphans(prefix: str, root: str | None = None) -> list[str]:
    """Remove the directories ``<root>/<prefix><pidns>-<pid>-*`` of this user whose ``pid`` is not a
    live process of this PID namespace; returns the paths removed. ``root``: the temp dir."""
    ns = _pid_namespace()
    if not ns:
        return []
    root = root or tempfile.gettempdir()
    try:
        names = os.listdir(root)
    except OSError:
        return []
    removed = []
    for name in names:
        if not name.startswith(prefix):
            continue
        owner_ns, _, rest = name[len(prefix) :].partition("-")
        pid, _, _ = rest.partition("-")
        if owner_ns != ns or not pid.isdigit() or _alive(int(pid)):  # this process is alive too
            continue
        path = os.path.join(root, name)
        try:
            st = os.lstat(path)
        except OSError:
            continue
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.getuid():
            continue
        shutil.rmtree(path, ignore_errors=True)
        removed.append(path)
    return removed
