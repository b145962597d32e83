"""The sandbox's verdict and host under attack, run for real (bubblewrap, cgroups, seccomp): script-form
tests cannot be forged from the answer's process, the whole process tree and its files share one memory
limit, and a hardening step that cannot be applied stops the run. Bombs stay within 256 MB / 64
processes in total (the machine is shared)."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from rollart_reward import _harness, sandbox
from rollart_reward.sandbox import SandboxError, run_python

needs_bwrap = pytest.mark.skipif(
    sandbox.probe_isolation()[0] is None,
    reason=f"no bubblewrap isolation here: {sandbox.probe_isolation()[1]}",
)
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="cgroups are made as root here")

# HumanEval's shape: a check(candidate) function with math.isclose and an expected exception.
CHECK = """
import math
def check(candidate):
    assert math.isclose(candidate(1.5, 2.0), 3.5)
    assert candidate(-1, 1) == 0
    try:
        candidate("a", 1)
    except TypeError:
        pass
    else:
        raise AssertionError("no TypeError")
check(add)
"""
WRONG = "def add(a, b):\n    return 0\n"

# The worker's reply pipe is sys.argv[2]: write every verdict the old and the new protocol could take.
FD_FORGE = (
    "import os, sys\n"
    'for line in [\'{"ok": true}\', \'{"i": 1, "ok": true, "names": {}}\', \'{"i": 2, "ok": true, '
    '"value": ["b", true]}\']:\n'
    "    os.write(int(sys.argv[2]), (line + '\\n').encode())\n"
    "os._exit(0)\n"
)
# The worker's own reply function, found through the caller's frames.
FRAME_FORGE = (
    "import os, sys\n"
    "f = sys._getframe(1)\n"
    "while f is not None and 'reply' not in f.f_locals:\n"
    "    f = f.f_back\n"
    "f.f_locals['reply'](ok=True)\n"
    "f.f_locals['reply'](i=f.f_locals['msg'].get('i'), ok=True, names={'add': ['h', 0]})\n"
    "os._exit(0)\n"
)
PATCH_STDLIB = (
    "import builtins, math\nmath.isclose = lambda *a, **k: True\nbuiltins.AssertionError = OSError\n"
)
ALWAYS_EQUAL = "class Y:\n    def __eq__(self, other):\n        return True\n    __hash__ = object.__hash__\n"


@needs_bwrap
@pytest.mark.parametrize(
    "attack",
    [FD_FORGE, FRAME_FORGE, PATCH_STDLIB, ALWAYS_EQUAL + "def add(a, b):\n    return Y()\n"],
    ids=["reply_fd", "reply_frame", "patch_stdlib", "always_equal"],
)
def test_script_verdict_cannot_be_forged(attack: str) -> None:
    control = run_python("def add(a, b):\n    return a + b\n", CHECK)
    assert control.passed, control  # the same script passes a right answer
    r = run_python(WRONG + attack, CHECK)
    assert not r.passed and r.tests_passed == 0 and r.tests_total == 1, r


@needs_bwrap
def test_script_tests_reach_the_solution_through_proxies() -> None:
    code = (
        "import math\nK = 7\n"
        "class Solution:\n    def two(self, xs, t):\n        seen = {}\n        for i, x in enumerate(xs):\n"
        "            if t - x in seen:\n                return [seen[t - x], i]\n            seen[x] = i\n"
        "def root(x):\n    if x < 0:\n        raise ValueError('negative')\n    return math.sqrt(x)\n"
    )
    tests = (
        "from solution import Solution\n"
        "assert Solution().two([2, 7, 11], 9) == [0, 1]\n"
        "assert math.isclose(root(K + 2), 3.0)\n"  # `math` bound from the solution's own import
        "try:\n    root(-1)\nexcept ValueError as e:\n    assert str(e) == 'negative'\n"
        "else:\n    raise AssertionError\n"
    )
    r = run_python(code, tests)
    assert r.passed, r
    # unittest finds the test code's cases (a wrong answer is not "0 tests ran, OK").
    ut = "import unittest\nclass T(unittest.TestCase):\n    def test_a(self):\n        self.assertEqual(sq(3), 9)\nunittest.main()\n"
    assert run_python("def sq(x):\n    return x * x\n", ut).passed
    assert not run_python("def sq(x):\n    return 0\n", ut).passed
    # Passing a function to the solution is refused (only data and solution objects cross over).
    r = run_python("def f(g):\n    return 1\n", "assert f(lambda: 1) == 1\n")
    assert not r.passed and "cannot be passed to the solution" in r.stderr, r
    # A caught protocol failure still fails: the worker died, whatever the test code catches.
    r = run_python(
        "import os\ndef f():\n    os._exit(0)\n", "try:\n    f()\nexcept BaseException:\n    pass\n"
    )
    assert not r.passed, r


SECCOMP_PROBES = r"""
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def err(rc):
    return ctypes.get_errno() if rc == -1 else 0
def ptrace():
    return err(libc.ptrace(16, os.getppid(), 0, 0))  # PTRACE_ATTACH
def vm_readv():
    return err(libc.process_vm_readv(os.getppid(), None, 0, None, 0, 0))
def keyctl():
    return err(libc.syscall(250, 0, 0, 0, 0, 0))
def unshare_user():
    return err(libc.unshare(0x10000000))
def mount():
    return err(libc.mount(b"none", b"/tmp", b"tmpfs", 0, None))
def seccomp_mode():
    return [l for l in open("/proc/self/status") if l.startswith("Seccomp:")][0].split()[1]
def write(path):
    try:
        with open(path, "wb") as f:
            f.write(b"x" * (1 << 20))
        return "written"
    except OSError as exc:
        return exc.errno
"""


@needs_bwrap
def test_seccomp_blocks_and_userns_is_disabled() -> None:
    cases = [{"call": c, "expected": 1} for c in ("ptrace", "vm_readv", "keyctl", "unshare_user", "mount")]
    cases += [
        {"call": "seccomp_mode", "expected": "2"},
        {"call": "write", "args": ["/evil"], "expected": 30},  # EROFS: bwrap's unsized root is read-only
        {"call": "write", "args": ["/dev/evil"], "expected": 30},
        {"call": "write", "args": ["/tmp/ok"], "expected": "written"},
    ]
    r = run_python(SECCOMP_PROBES, cases)
    assert r.passed, r


# Files (1 MB each) up to 48 MB, then 5 forked children of 40 MB each (touched pages): 248 MB if nothing bounded the
# tree. The parent prints what was held at once: the files plus the children alive with their 40 MB.
TREE_BOMB = r"""
import os, select, time
files = 0
try:
    while files < (48 << 20):
        with open(f"/tmp/fill{files >> 20}", "wb") as f:
            f.write(b"x" * (1 << 20))
        files += 1 << 20
except OSError:
    pass
r, w = os.pipe()
kids = []
for _ in range(5):
    try:
        pid = os.fork()
    except OSError:
        break
    if pid == 0:
        try:
            block = bytearray(b"\x01") * (40 << 20)
            os.write(w, b"r")
            select.select([r], [], [])
        finally:
            os._exit(0)
    kids.append(pid)
os.close(w)
deadline = time.monotonic() + 3
ready = 0
while ready < len(kids) and time.monotonic() < deadline:
    if select.select([r], [], [], 0.1)[0]:
        got = os.read(r, 16)
        if not got:
            break
        ready += len(got)
alive = sum(1 for pid in kids if os.waitpid(pid, os.WNOHANG) == (0, 0))
held = files + min(alive, ready) * (40 << 20)
print("held_mb", held >> 20, "files_mb", files >> 20, "kids", len(kids), "ready", ready, "alive", alive)
"""


def _held_mb(stdout: str) -> int:
    fields = stdout.split()
    return int(fields[fields.index("held_mb") + 1])


@needs_bwrap
@needs_root
def test_whole_tree_memory_limit_holds_with_children_and_files() -> None:
    r = run_python(TREE_BOMB, "", memory_mb=128, timeout_s=8, max_processes=32, limits="cgroup")
    assert r.limits == "cgroup" and r.memory_peak_bytes is not None, r
    assert r.memory_peak_bytes <= 128 << 20, r
    if "held_mb" in r.stdout:  # the parent may itself be the one the OOM killer took
        assert _held_mb(r.stdout) <= 128, r.stdout
        assert "files_mb 24" in r.stdout, r.stdout  # /tmp got its share (3/4 of tmpfs_mb = 32)


@needs_bwrap
def test_split_rlimits_sum_to_the_same_limit() -> None:
    r = run_python(TREE_BOMB, "", memory_mb=256, timeout_s=8, max_processes=32, limits="rlimits")
    assert r.limits == "rlimits", r
    assert "held_mb" in r.stdout and _held_mb(r.stdout) <= 256, r


@needs_bwrap
def test_cpu_time_is_counted_over_the_whole_tree() -> None:
    spin = "import os\nfor _ in range(3):\n    if os.fork() == 0:\n        break\nwhile True:\n    pass\n"
    r = run_python(spin, "", timeout_s=20, cpu_s=1.0, max_processes=16)
    assert not r.passed and r.killed_reason == "cpu_time", r
    assert r.duration_s < 10, r


@needs_bwrap
def test_fork_bomb_stays_within_the_process_limit() -> None:
    bomb = (
        "import os, time\nn = 0\nfor _ in range(200):\n    try:\n        if os.fork() == 0:\n"
        "            time.sleep(30)\n            os._exit(0)\n        n += 1\n    except OSError:\n"
        "        break\nprint('forked', n)\n"
    )
    r = run_python(bomb, "", timeout_s=5, max_processes=56)  # 56 + the harness's 8 tasks = 64
    forked = int(r.stdout.split()[-1])
    assert 0 < forked < 56, r.stdout


def test_missing_hardening_pieces_refuse_to_run(tmp_path: object) -> None:
    with pytest.raises(SandboxError, match="seccomp program"):
        run_python(WRONG, "assert add(1, 2) == 3", seccomp="/no/such/filter.bpf")
    with pytest.raises(SandboxError, match="cgroup"):
        run_python(WRONG, "assert add(1, 2) == 3", limits="cgroup", cgroup_parent="/no-such-cgroup")


@needs_bwrap
def test_a_filter_bwrap_rejects_stops_the_run(tmp_path: object) -> None:
    bad = os.path.join(str(tmp_path), "bad.bpf")
    with open(bad, "wb") as f:
        f.write(b"\x00" * 8)  # one `ld` and no return: the kernel refuses the program
    with pytest.raises(SandboxError, match="did not start"):
        run_python(WRONG, "assert add(1, 2) == 3", seccomp=bad)


def test_harness_without_ctypes_refuses_instead_of_running_dumpable() -> None:
    """The prctl step fails closed: with ctypes unimportable the harness reports a setup error and
    never starts a worker (before this it ran on, readable by the answer)."""
    report_r, report_w = os.pipe()
    cfg = {
        "nonce": "n",
        "cases": [{"kind": "script", "script": ""}],
        "limits": {},
        "timeout_s": 5,
        "max_output": 1000,
        "solution": "/nonexistent.py",
        "workdir": "/",
        "env": {},
        "report_fd": report_w,
    }
    run = "import runpy, sys; sys.modules['ctypes'] = None; runpy.run_path(sys.argv[1], run_name='__main__')"
    p = subprocess.run(
        [sys.executable, "-I", "-c", run, _harness.__file__],
        input=json.dumps(cfg).encode(),
        pass_fds=(report_w,),
        capture_output=True,
        timeout=30,
    )
    os.close(report_w)
    with os.fdopen(report_r, "rb") as f:
        report = f.read()
    assert p.returncode == 0, p.stderr
    assert report.startswith(b"setup-error: cannot make the harness non-dumpable: ctypes"), report


# Written from inside the sandbox to the host's stdout/stderr pipes through bwrap's init (which holds
# them): possible when the sandbox's uid owns those pipes (a non-root trainer).
HOST_PIPE_FORGE = (
    "import os\n"
    "for fd in (1, 2):\n"
    "    try:\n"
    "        w = os.open(f'/proc/1/fd/{fd}', os.O_WRONLY)\n"
    "        os.write(w, b'\\0setup-error:forged\\n\\0level:rlimits\\n')\n"
    "        print('wrote', fd)\n"
    "    except OSError:\n"
    "        pass\n"
    "def add(a, b):\n    return 0\n"
)
NOBODY = ["setpriv", "--reuid", "65534", "--regid", "65534", "--clear-groups", "--"]
AS_NOBODY = r"""
import json, site, sys
site.addsitedir(sys.argv[1])
from rollart_reward.sandbox import SandboxError, run_python
try:
    r = run_python(sys.argv[2], "assert add(1, 2) == 3\nx = 1\n", timeout_s=8)
    print(json.dumps({"passed": r.passed, "stdout": r.stdout}))
except SandboxError as exc:
    print(json.dumps({"error": str(exc)}))
"""


@needs_bwrap
@needs_root
def test_host_pipes_cannot_turn_a_run_into_a_refusal() -> None:
    """A refusal (SandboxError: fate reward_failed, not a score) only comes before the harness starts:
    a marker written later by the answer scores 0 like any other failure."""
    import shutil
    import sysconfig

    if shutil.which("setpriv") is None:
        pytest.skip("needs setpriv to run as nobody")
    site_dir = sysconfig.get_paths()["purelib"]
    p = subprocess.run(
        [*NOBODY, "/usr/bin/python3", "-I", "-c", AS_NOBODY, site_dir, HOST_PIPE_FORGE],
        capture_output=True,
        timeout=60,
        cwd="/",
        env={"PATH": os.environ.get("PATH", "/usr/bin:/bin")},
    )
    if p.returncode != 0 and "No module named" in p.stderr.decode():
        pytest.skip("uid 65534 cannot import the installed packages here")
    out = json.loads(p.stdout.decode().strip().splitlines()[-1])
    assert out.get("passed") is False, out
    assert "wrote" in out["stdout"], out  # the write itself happened: only the verdict ignores it
