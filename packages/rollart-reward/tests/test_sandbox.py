"""The code sandbox, run for real: fork bombs, loops, huge allocations and sockets are stopped."""

from __future__ import annotations

import asyncio
import os
import socket

from rollart_reward import sandbox
from rollart_reward.sandbox import run_python, run_python_async

SOLUTION = "def add(a, b):\n    return a + b\n"
TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\n"


def _sandbox_uid_processes() -> list[int]:
    lo, hi = sandbox._UID_BASE, sandbox._UID_BASE + sandbox._UID_SPAN
    return [p for p in (int(e) for e in os.listdir("/proc") if e.isdigit()) if _alive_in_range(p, lo, hi)]


def _alive_in_range(pid: int, lo: int, hi: int) -> bool:
    try:
        if not lo <= os.stat(f"/proc/{pid}").st_uid < hi:
            return False
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def test_correct_solution_passes() -> None:
    r = run_python(SOLUTION, TESTS)
    assert r.passed and r.returncode == 0 and r.killed_reason is None, r


def test_wrong_solution_fails() -> None:
    r = run_python("def add(a, b):\n    return a - b\n", TESTS)
    assert not r.passed and r.returncode == 1 and r.killed_reason is None
    assert "AssertionError" in r.stderr


def test_infinite_loop_is_killed() -> None:
    r = run_python("while True:\n    pass\n", timeout_s=1.5)
    assert not r.passed and r.killed_reason in ("timeout", "cpu_time"), r
    assert r.duration_s < 6


def test_fork_bomb_is_contained_and_reaped() -> None:
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = run_python(bomb, timeout_s=1.5)
    assert not r.passed and r.killed_reason in ("timeout", "cpu_time"), r
    assert r.duration_s < 10
    if os.geteuid() == 0:  # the per-run uid makes leftovers findable: none may survive
        assert _sandbox_uid_processes() == []


def test_huge_allocation_fails() -> None:
    r = run_python("x = bytearray(10 * 1024**3)\nprint('allocated')\n", memory_mb=256)
    assert not r.passed and r.killed_reason == "memory", r
    assert "allocated" not in r.stdout


def test_socket_connect_never_arrives() -> None:
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    port = server.getsockname()[1]
    try:
        code = (
            "import socket\n"
            f"s = socket.create_connection(('127.0.0.1', {port}), timeout=2)\n"
            "s.sendall(b'leak')\n"
            "print('connected')\n"
        )
        r = run_python(code, timeout_s=4)
        assert not r.passed and "connected" not in r.stdout, r
        try:
            conn, _ = server.accept()
        except BlockingIOError:
            conn = None
        assert conn is None, "a sandboxed connection reached the host listener"
    finally:
        server.close()
    assert sandbox.isolation() in ("netns", "userns+netns", "audit-hook")


def test_output_is_capped() -> None:
    r = run_python("import sys\nwhile True:\n    sys.stdout.write('x' * 4096)\n", max_output_bytes=10_000)
    assert not r.passed and r.killed_reason == "output_limit"
    assert len(r.stdout) + len(r.stderr) <= 10_000


def test_async_runs_concurrently_and_sync_works_inside_a_loop() -> None:
    async def main() -> list[sandbox.SandboxResult]:
        rs = await asyncio.gather(*(run_python_async(SOLUTION, f"assert add({i}, 1) == {i + 1}") for i in range(4)))
        rs.append(run_python(SOLUTION, "assert add(2, 2) == 5"))  # blocking form from a loop's thread
        return list(rs)

    rs = asyncio.run(main())
    assert [r.passed for r in rs] == [True, True, True, True, False]
