"""Function-runtime workers, forked from a template process (like a platform's warm snapshot).

The template (``python -m rollart_reward._worker NAME OPTIONS SOCKET``) imports rollart and builds
the reward function once, prints ``{"ready": true, "load_s"}`` and then reads fork requests
``{"fork": TOKEN}`` on stdin. Each fork becomes one worker: it connects to the runtime's Unix socket,
says ``{"hello": TOKEN, "pid"}`` and then serves calls one at a time:
``{"id", "trajectory"}`` in → ``{"id", "result"|"error", "busy_s"}`` out (JSON lines). A cold start
thus costs a fork, not an interpreter start and imports. The function's own prints go to stderr.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from typing import Any


async def _serve(fn: Any, path: str, token: str) -> None:
    from rollart_reward.wire import result_to_dict, trajectory_from_dict

    reader, writer = await asyncio.open_unix_connection(path, limit=64 << 20)
    writer.write((json.dumps({"hello": token, "pid": os.getpid()}) + "\n").encode())
    await writer.drain()
    while True:
        line = await reader.readline()
        if not line:
            return
        msg = json.loads(line)
        t = time.perf_counter()
        try:
            result = await fn.score(trajectory_from_dict(msg["trajectory"]))
            reply = {"id": msg["id"], "result": result_to_dict(result)}
        except Exception as exc:  # reported to the caller, who retries or fails the trajectory
            reply = {"id": msg["id"], "error": f"{type(exc).__name__}: {exc}"}
        reply["busy_s"] = time.perf_counter() - t
        writer.write((json.dumps(reply) + "\n").encode())
        await writer.drain()


def main() -> None:
    name, options, path = sys.argv[1], json.loads(sys.argv[2]), sys.argv[3]
    control = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)  # whatever the reward function prints must not corrupt the protocol
    sys.stdout = sys.stderr
    t0 = time.perf_counter()
    from rollart_core.registry import build

    fn = build("reward", name, options, where=f"reward {name}")
    import rollart_reward.wire  # noqa: F401  (loaded before forking, like the function)

    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # forked workers are reaped by the kernel
    control.write(json.dumps({"ready": True, "load_s": time.perf_counter() - t0}) + "\n")
    for line in sys.stdin:
        token = json.loads(line)["fork"]
        if os.fork() == 0:
            signal.signal(signal.SIGCHLD, signal.SIG_DFL)
            os.setsid()  # the runtime kills workers one by one; the template's group stays intact
            sys.stdin.close()
            control.close()
            try:
                asyncio.run(_serve(fn, path, token))
            finally:
                os._exit(0)


if __name__ == "__main__":
    main()
