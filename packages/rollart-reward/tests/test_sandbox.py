"""The code sandbox, run for real (bubblewrap, real processes, real sockets on 127.0.0.1): the harness
decides (early exits and always-true ``__eq__`` score 0), the code cannot read, write, signal, connect or
outlive its sandbox; as root and as ``nobody``."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import socket
import stat
import subprocess
import sys
import sysconfig
import tempfile
import time
import uuid

import pytest

from rollart_core.types import Trajectory, Turn
from rollart_reward import sandbox
from rollart_reward.rewards import CodeTestsConfig, CodeTestsReward
from rollart_reward.sandbox import SandboxError, parse_tests, run_python, run_python_async

SOLUTION = "def add(a, b):\n    return a + b\n"
TESTS = "assert add(1, 2) == 3\nassert add(-1, 1) == 0\n"

needs_bwrap = pytest.mark.skipif(
    sandbox.probe_isolation()[0] is None,
    reason=f"no bubblewrap isolation here: {sandbox.probe_isolation()[1]}",
)


def test_correct_solution_passes() -> None:
    r = run_python(SOLUTION, TESTS, isolation="best_effort")
    assert r.passed and r.killed_reason is None and (r.tests_passed, r.tests_total) == (2, 2), r


def test_wrong_solution_fails_with_feedback() -> None:
    r = run_python("def add(a, b):\n    return a + b if a > 0 else 7\n", TESTS, isolation="best_effort")
    assert not r.passed and r.killed_reason is None and (r.tests_passed, r.tests_total) == (1, 2), r
    assert "AssertionError" in r.stderr and "add(-1, 1) returned 7" in r.stderr


@pytest.mark.parametrize(
    "cheat",
    [
        "import os\nos._exit(0)\n",
        "import sys\nsys.exit(0)\n",
        "import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n",
        "class Yes:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"
        "def add(a, b):\n    return Yes()\n",
        "class I(int):\n    def __eq__(self, other):\n        return True\n    __hash__ = int.__hash__\n"
        "def add(a, b):\n    return I(0)\n",
        'import sys\nprint(\'{"nonce": "x", "results": [{"passed": true}]}\')\nsys.stdout.flush()\nsys.exit(0)\n',
    ],
)
async def test_reward_hacks_score_zero(cheat: str) -> None:
    code = "def add(a, b):\n    return 0\n" + cheat
    reward = CodeTestsReward(CodeTestsConfig(timeout_s=5, isolation="best_effort"))
    t = Trajectory(
        traj_id="x",
        task="code",
        env_id="e",
        group_id="g",
        seed=0,
        start_version=0,
        turns=[Turn(context_ids=[1], output_ids=[2], action_text=f"```python\n{code}```")],
        info={"tests": TESTS},
    )
    r = await reward.score(t)
    assert r.score == 0.0 and not r.details["passed"] and r.details["tests_passed"] == 0, r.details
    assert r.details["tests_total"] == 2


def test_call_and_io_cases_are_compared_type_strictly() -> None:
    code = (
        "def f(x):\n    return x\n"
        "def g():\n    return (1, [2.5, {'a': None}], {3, 4}, b'z')\n"
        "import sys\nif __name__ == '__main__':\n    print(sum(map(int, sys.stdin.read().split())))\n"
    )
    cases = [
        {"call": "f", "args": [1], "expected": 1},
        {"call": "f", "args": [True], "expected": 1},  # bool is not int
        {"call": "f", "args": [1.0], "expected": 1},  # float is not int
        {"call": "f", "args": [[1, 2]], "expected": (1, 2)},  # list is not tuple
        {"call": "g", "expected": (1, [2.5, {"a": None}], {4, 3}, b"z")},
        {"stdin": "2 3\n", "stdout": "5\n"},
        {"stdin": "2 3\n", "stdout": "6"},
    ]
    r = run_python(code, cases, isolation="best_effort")
    assert (r.tests_passed, r.tests_total) == (3, 7) and not r.passed, r
    assert r.stderr.count("AssertionError") == 4


def test_malformed_tests_are_a_clear_error() -> None:
    with pytest.raises(SandboxError, match="test case 0"):
        parse_tests([{"call": "f"}])
    with pytest.raises(SandboxError, match="needs 'call'"):
        parse_tests([{"input": 1}])
    assert parse_tests("x = 1\nassert f(x) == 2")[0]["kind"] == "script"  # not a literal call: a script
    assert [c["kind"] for c in parse_tests(TESTS)] == ["call", "call"]


def test_infinite_loop_is_killed() -> None:
    r = run_python("while True:\n    pass\n", timeout_s=1.5, isolation="best_effort")
    assert not r.passed and r.killed_reason in ("timeout", "cpu_time"), r
    assert r.duration_s < 6


@needs_bwrap
def test_fork_bomb_is_contained() -> None:
    bomb = "import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass\n"
    r = run_python(bomb, timeout_s=1.5, max_processes=56)  # 56 + the harness's 8 tasks: 64 in all
    assert not r.passed and r.killed_reason in ("timeout", "cpu_time"), r
    assert r.duration_s < 10


def test_huge_allocation_fails() -> None:
    r = run_python(
        "x = bytearray(10 * 1024**3)\nprint('allocated')\n", memory_mb=256, isolation="best_effort"
    )
    assert not r.passed and r.killed_reason == "memory", r
    assert "allocated" not in r.stdout


def test_output_is_capped() -> None:
    r = run_python(
        "import sys\nwhile True:\n    sys.stdout.write('x' * 4096)\n",
        max_output_bytes=10_000,
        isolation="best_effort",
    )
    assert not r.passed and r.killed_reason == "output_limit", r
    assert len(r.stdout) + len(r.stderr) <= 10_000 + 200


def test_async_runs_concurrently_and_sync_works_inside_a_loop() -> None:
    async def main() -> list[sandbox.SandboxResult]:
        rs = await asyncio.gather(
            *(
                run_python_async(SOLUTION, f"assert add({i}, 1) == {i + 1}", isolation="best_effort")
                for i in range(4)
            )
        )
        rs.append(run_python(SOLUTION, "assert add(2, 2) == 5", isolation="best_effort"))
        return list(rs)

    rs = asyncio.run(main())
    assert [r.passed for r in rs] == [True, True, True, True, False]


def test_require_names_what_is_missing(monkeypatch: pytest.MonkeyPatch) -> None:
    """Without bwrap on PATH, ``require`` refuses to run; ``best_effort`` runs and says the level."""
    monkeypatch.setenv("PATH", "/nonexistent")
    monkeypatch.setattr(sandbox, "_probe_cache", {})
    with pytest.raises(SandboxError, match="bwrap not found"):
        run_python(SOLUTION, TESTS)
    r = run_python(SOLUTION, TESTS, isolation="best_effort")
    assert r.passed and r.isolation in ("netns", "rlimits")
    monkeypatch.setattr(sandbox, "_probe_cache", {})


# ---------------------------------------------------------------- isolation, as root and as nobody

ESCAPES = r"""
import json, os, socket, subprocess, sys, time
def read(p):
    try:
        with open(p) as f:
            return f.read()
    except OSError:
        return "OSError"
def write(p):
    try:
        with open(p, "w") as f:
            f.write("pwned")
        return "written"
    except OSError:
        return "OSError"
def environs(marker):
    seen = []
    for pid in [d for d in os.listdir("/proc") if d.isdigit()] + [str(os.getppid()), "self"]:
        try:
            with open(f"/proc/{pid}/environ", "rb") as f:
                seen.append(f.read())
        except OSError:
            pass
    return any(marker.encode() in e for e in seen) or any(marker in v for v in os.environ.values())
def connect(port):
    try:
        socket.create_connection(("127.0.0.1", port), timeout=2).sendall(b"leak")
        return "connected"
    except OSError:
        return "OSError"
def subprocess_connect(port):
    p = subprocess.run([sys.executable, "-c", f"import socket; socket.create_connection(('127.0.0.1', {port}),"
                        " timeout=2)"], capture_output=True)
    return p.returncode
def visible_pids():
    return len([d for d in os.listdir("/proc") if d.isdigit()]) < 10
"""


def _escape_cases(secret_path: str, secret: str, outside: str, port: int, marker: str) -> list[dict]:
    return [
        {"call": "read", "args": [secret_path], "expected": "OSError"},
        {"call": "read", "args": ["/sandbox/solution.py"], "expected": ESCAPES},  # control: can read itself
        {"call": "write", "args": [outside], "expected": "OSError"},
        {"call": "write", "args": ["/sandbox/solution.py"], "expected": "OSError"},
        {"call": "write", "args": ["/usr/lib/evil.pth"], "expected": "OSError"},
        {"call": "write", "args": ["/tmp/scratch"], "expected": "written"},  # control: private tmp works
        {"call": "environs", "args": [marker], "expected": False},
        {"call": "connect", "args": [port], "expected": "OSError"},
        {"call": "subprocess_connect", "args": [port], "expected": 1},
        {"call": "visible_pids", "expected": True},
    ]


DAEMON = r"""
import os, sys, time
MARKER = "{marker}"
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(60)", MARKER])
    os._exit(0)
os.wait()
deadline = time.monotonic() + 5
while time.monotonic() < deadline:
    found = False
    for d in os.listdir("/proc"):
        try:
            found = found or MARKER.encode() in open(f"/proc/{{d}}/cmdline", "rb").read()
        except OSError:
            pass
    if found:
        print("daemon up")
        break
"""

KILL_ALL = "import os, signal\nos.kill(-1, signal.SIGKILL)\n"


def _host_processes_with(marker: str) -> list[int]:
    found = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/cmdline", "rb") as f:
                    if marker.encode() in f.read():
                        found.append(int(d))
            except OSError:
                pass
    return found


# Runs the same checks through the sandbox in another process (as root, or as `nobody` via setpriv).
RUNNER = r"""
import json, site, sys
site.addsitedir(sys.argv[1])
from rollart_reward.sandbox import run_python
spec = json.loads(sys.argv[2])
out = {}
for name, (code, tests) in spec.items():
    r = run_python(code, tests or "", timeout_s=8)
    out[name] = {"passed": r.passed, "tp": r.tests_passed, "tt": r.tests_total, "level": r.isolation,
                 "stdout": r.stdout, "stderr": r.stderr[-1500:], "killed": r.killed_reason}
print(json.dumps(out))
"""


def _passable_by_others(path: str) -> bool:
    """Every directory from ``path`` up to / lets other users through (o+x): what uid 65534 needs to
    import the packages installed there."""
    p = os.path.realpath(path)
    while True:
        if not os.stat(p).st_mode & stat.S_IXOTH:
            return False
        if os.path.dirname(p) == p:
            return True
        p = os.path.dirname(p)


def _as_user(user: str) -> list[str]:
    if user == "root":
        if os.geteuid() != 0:
            pytest.skip("not running as root")
        return []
    if os.geteuid() != 0 or shutil.which("setpriv") is None:
        pytest.skip("switching to nobody needs root and setpriv")
    for d in (sysconfig.get_paths()["purelib"], os.path.dirname(os.path.abspath(sandbox.__file__))):
        if not _passable_by_others(d):
            pytest.skip(
                f"uid 65534 cannot import the installed packages: a directory above {d} lacks o+x "
                "(e.g. a checkout inside a mode-0700 `mktemp -d` directory)"
            )
    return ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "--"]


@needs_bwrap
@pytest.mark.parametrize("user", ["root", "nobody"])
def test_sandbox_cannot_escape(user: str) -> None:
    prefix = _as_user(user)
    marker = f"rollart-{uuid.uuid4().hex}"
    secret = f"secret-{uuid.uuid4().hex}"
    secret_dir = "/root" if user == "root" else tempfile.gettempdir()
    fd, secret_path = tempfile.mkstemp(dir=secret_dir, prefix="rollart-secret-")
    outside = os.path.join(os.path.dirname(os.path.abspath(__file__)), f".rollart-write-{uuid.uuid4().hex}")
    server = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    server.bind(("127.0.0.1", 0))
    server.listen(8)
    server.setblocking(False)
    sibling = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(120)", marker + "-sibling"], start_new_session=True
    )
    try:
        os.write(fd, secret.encode())
        os.close(fd)
        os.chmod(secret_path, 0o644)  # readable by every uid on the host: only the sandbox stands in the way
        spec = {
            "escapes": [
                ESCAPES,
                _escape_cases(secret_path, secret, outside, server.getsockname()[1], marker),
            ],
            "kill_all": [KILL_ALL, None],
            "daemon": [DAEMON.format(marker=marker), None],
        }
        site_dir = sysconfig.get_paths()["purelib"]
        python = sys.executable if user == "root" else "/usr/bin/python3"
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), marker: secret, "SECRET": marker}
        t0 = time.monotonic()
        p = subprocess.run(
            [*prefix, python, "-I", "-c", RUNNER, site_dir, json.dumps(spec)],
            capture_output=True,
            timeout=120,
            env=env,
            cwd="/",
        )
        assert p.returncode == 0, p.stderr.decode()[-3000:]
        out = json.loads(p.stdout)
        esc = out["escapes"]
        assert esc["level"] == "bwrap" and (esc["tp"], esc["tt"]) == (10, 10), esc
        assert not os.path.exists(outside)
        try:
            conn, _ = server.accept()
        except BlockingIOError:
            conn = None
        assert conn is None, "a sandboxed connection reached the host listener"
        assert sibling.poll() is None, "kill(-1) in the sandbox reached a host process"
        assert not out["kill_all"]["passed"]
        assert "daemon up" in out["daemon"]["stdout"], out["daemon"]
        deadline = time.monotonic() + 5  # the PID namespace is torn down as the run returns; allow the reap
        while _host_processes_with(marker) != [sibling.pid] and time.monotonic() < deadline:
            time.sleep(0.02)
        assert _host_processes_with(marker) == [sibling.pid], "a sandbox daemon outlived the run"
        assert time.monotonic() - t0 < 60
    finally:
        sibling.kill()
        sibling.wait()
        server.close()
        os.unlink(secret_path)
        if os.path.exists(outside):
            os.unlink(outside)
