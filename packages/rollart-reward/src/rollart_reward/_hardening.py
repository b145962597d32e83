"""The sandbox's hardening steps that live on the host side: the seccomp program handed to bubblewrap,
the per-run cgroup that bounds the answer's whole process tree, and the split rlimits used where no
cgroup can be made. Every step raises :class:`HardeningError` naming what is missing when it cannot be
applied; the caller refuses to run rather than run weaker.
"""

from __future__ import annotations

import errno
import itertools
import os
import platform
import re
import signal
import struct
import time
from dataclasses import dataclass

__all__ = [
    "BLOCKED_SYSCALLS",
    "Cgroup",
    "HardeningError",
    "TreeLimits",
    "seccomp_program",
    "tree_cpu_seconds",
]


class HardeningError(Exception):
    """A hardening step cannot be applied on this host (the message names the missing piece)."""


# ---------------------------------------------------------------- seccomp

# x86_64 numbers (checked against asm/unistd_64.h). Blocked with EPERM: debugging and memory access
# across processes, kernel keyrings, namespaces and mounts, kernel modules / BPF / perf, io_uring (its
# own syscall surface), file-handle opening (escapes bind mounts), and host-wide settings.
BLOCKED_SYSCALLS: dict[str, int] = {
    "ptrace": 101,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "pidfd_getfd": 438,
    "process_madvise": 440,
    "kcmp": 312,
    "keyctl": 250,
    "add_key": 248,
    "request_key": 249,
    "unshare": 272,
    "setns": 308,
    "mount": 165,
    "umount2": 166,
    "pivot_root": 155,
    "chroot": 161,
    "move_mount": 429,
    "open_tree": 428,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "mount_setattr": 442,
    "bpf": 321,
    "perf_event_open": 298,
    "userfaultfd": 323,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_by_handle_at": 304,
    "name_to_handle_at": 303,
    "fanotify_init": 300,
    "kexec_load": 246,
    "kexec_file_load": 320,
    "init_module": 175,
    "finit_module": 313,
    "delete_module": 176,
    "syslog": 103,
    "acct": 163,
    "swapon": 167,
    "swapoff": 168,
    "reboot": 169,
    "quotactl": 179,
    "lookup_dcookie": 212,
    "iopl": 172,
    "ioperm": 173,
    "settimeofday": 164,
    "clock_settime": 227,
    "adjtimex": 159,
    "clock_adjtime": 305,
    "vhangup": 153,
}
_NR_CLONE, _NR_CLONE3 = 56, 435
_AUDIT_ARCH_X86_64 = 0xC000003E
_X32_BIT = 0x40000000
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET: a new namespace via clone().
_CLONE_NS_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000 | 0x40000000

_LD_W_ABS, _JEQ, _JGE, _JSET, _RET = 0x20, 0x15, 0x35, 0x45, 0x06
_RET_KILL_PROCESS, _RET_ALLOW, _RET_ERRNO = 0x80000000, 0x7FFF0000, 0x00050000


def seccomp_program() -> bytes:
    """A classic-BPF seccomp program (``struct sock_filter[]``, as ``bwrap --seccomp FD`` reads it):
    another architecture or the x32 ABI is killed, :data:`BLOCKED_SYSCALLS` fail with EPERM,
    ``clone`` with a namespace flag fails with EPERM, ``clone3`` (flags out of BPF's reach) with ENOSYS
    so libc falls back to ``clone``. Everything else is allowed."""
    machine = platform.machine()
    if machine not in ("x86_64", "AMD64"):
        raise HardeningError(
            f"seccomp: no syscall table for {machine!r} (the built-in filter is x86_64 only)"
        )
    # (code, jump-if-true label, jump-if-false label, k); labels resolve to relative offsets below.
    prog: list[tuple[int, str | None, str | None, int]] = [
        (_LD_W_ABS, None, None, 4),  # seccomp_data.arch
        (_JEQ, None, "kill", _AUDIT_ARCH_X86_64),
        (_LD_W_ABS, None, None, 0),  # seccomp_data.nr
        (_JGE, "eperm", None, _X32_BIT),
        (_JEQ, "clone", None, _NR_CLONE),
        (_JEQ, "enosys", None, _NR_CLONE3),
    ]
    prog += [(_JEQ, "eperm", None, nr) for nr in sorted(BLOCKED_SYSCALLS.values())]
    labels = {"clone": len(prog) + 1}
    prog += [
        (_RET, None, None, _RET_ALLOW),
        (_LD_W_ABS, None, None, 16),  # clone: args[0] (flags), low 32 bits (little endian)
        (_JSET, "eperm", None, _CLONE_NS_FLAGS),
        (_RET, None, None, _RET_ALLOW),
    ]
    labels.update(eperm=len(prog), enosys=len(prog) + 1, kill=len(prog) + 2)
    prog += [
        (_RET, None, None, _RET_ERRNO | errno.EPERM),
        (_RET, None, None, _RET_ERRNO | errno.ENOSYS),
        (_RET, None, None, _RET_KILL_PROCESS),
    ]
    out = bytearray()
    for i, (code, jt, jf, k) in enumerate(prog):
        offsets = [0 if lab is None else labels[lab] - i - 1 for lab in (jt, jf)]
        if not all(0 <= o <= 255 for o in offsets):
            raise HardeningError("seccomp: filter jump out of range")  # a bug in the table, not the host
        out += struct.pack("<HBBI", code, offsets[0], offsets[1], k)
    return bytes(out)


# ---------------------------------------------------------------- limits


@dataclass(frozen=True)
class TreeLimits:
    """Limits of one answer's whole process tree and its files.

    With a cgroup, ``memory_bytes`` bounds everything the tree charges (process memory, tmpfs files,
    kernel memory) and ``processes`` every task. Without one, the same totals are split so they sum
    correctly: ``RLIMIT_NPROC`` (per user namespace: the sandbox's tasks) caps the tree at
    ``processes`` tasks, each with an ``RLIMIT_AS`` of ``per_process_bytes``, and
    ``processes * per_process_bytes + tmpfs <= memory``."""

    memory_bytes: int
    processes: int
    cpu_s: float
    tmp_bytes: int
    shm_bytes: int
    per_process_bytes: int
    cgroup: bool


TRUSTED_TASKS = 8
"""Tasks of the harness's own side: bubblewrap's init, the harness, the tester and their output threads."""


def tree_limits(memory_mb: int, max_processes: int, cpu_s: float, tmpfs_mb: int, cgroup: bool) -> TreeLimits:
    memory = memory_mb << 20
    files = tmpfs_mb << 20
    shm = max(1 << 20, files // 4)
    if files >= memory or files < (2 << 20):
        raise HardeningError(f"tmpfs_mb={tmpfs_mb} must be at least 2 and below memory_mb={memory_mb}")
    if cgroup:
        procs = max_processes + TRUSTED_TASKS
        per_process = memory  # the cgroup is the bound; the rlimit only stops one huge mapping early
    else:
        # Every task (threads too) takes an RLIMIT_NPROC slot and, at worst, is a process with a full
        # RLIMIT_AS: procs * per_process + files <= memory. Fewer processes than with a cgroup.
        procs = max(TRUSTED_TASKS, min(max_processes + TRUSTED_TASKS, (memory - files) // (32 << 20)))
        per_process = (memory - files) // procs
        if per_process < (24 << 20):
            raise HardeningError(
                f"memory_mb={memory_mb} is too small to split over {procs} processes without a cgroup "
                f"({per_process >> 20} MiB each, an interpreter needs 24): raise memory_mb or use a cgroup"
            )
    return TreeLimits(memory, procs, cpu_s, files - shm, shm, per_process, cgroup)


# ---------------------------------------------------------------- cgroups

_CONTROLLERS_V1 = ("memory", "pids", "cpuacct")
_NAME = re.compile(r"rollart-sbx-(\d+)-\d+$")


def _mounts() -> list[tuple[str, str, set[str]]]:
    out = []
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 4 and parts[2] in ("cgroup", "cgroup2"):
                out.append((parts[1], parts[2], set(parts[3].split(","))))
    return out


def _own_paths() -> dict[str, str]:
    """controller (``""`` for cgroup v2) -> this process's cgroup path."""
    out = {}
    with open("/proc/self/cgroup") as f:
        for line in f:
            _, controllers, path = line.rstrip("\n").split(":", 2)
            for c in controllers.split(",") if controllers else [""]:
                out[c] = path
    return out


def _write(path: str, value: str) -> None:
    with open(path, "w") as f:
        f.write(value)


def _read(path: str) -> str:
    with open(path) as f:
        return f.read()


class Cgroup:
    """One run's cgroup (v2, else v1 memory + pids + cpuacct [+ cpu]), made below this process's own
    cgroup (or below ``parent``, a path inside each hierarchy), removed by :meth:`remove`."""

    _counter = itertools.count(1)  # next() is atomic: concurrent runs create cgroups from threads

    def __init__(self, dirs: dict[str, str], version: int) -> None:
        self.dirs, self.version = dirs, version

    @classmethod
    def create(cls, limits: TreeLimits, parent: str | None = None, cpus: float = 1.0) -> Cgroup:
        if os.geteuid() != 0 and parent is None:
            raise HardeningError("cgroup: not root and no delegated cgroup given (cgroup_parent)")
        name = f"rollart-sbx-{os.getpid()}-{next(cls._counter)}"
        mounts, own = _mounts(), _own_paths()
        v2 = [m for m in mounts if m[1] == "cgroup2"]
        v1 = {c: m[0] for m in mounts if m[1] == "cgroup" for c in (*_CONTROLLERS_V1, "cpu") if c in m[2]}
        errors = []
        if v2 and "" in own:
            base = v2[0][0] + (parent if parent is not None else own[""])
            try:
                return cls._make_v2(base, name, limits, cpus)
            except (OSError, HardeningError) as exc:
                errors.append(f"v2 at {base}: {exc}")
        if all(c in v1 for c in _CONTROLLERS_V1):
            bases = {c: v1[c] + (parent if parent is not None else own.get(c, "/")) for c in v1}
            try:
                return cls._make_v1(bases, name, limits, cpus)
            except (OSError, HardeningError) as exc:
                errors.append(f"v1: {exc}")
        else:
            errors.append(f"v1: controllers {sorted(set(_CONTROLLERS_V1) - set(v1))} not mounted")
        raise HardeningError("cgroup: cannot make a memory + pids + cpu cgroup: " + "; ".join(errors))

    @classmethod
    def _make_v2(cls, base: str, name: str, limits: TreeLimits, cpus: float) -> Cgroup:
        if not os.path.isdir(base):
            raise HardeningError(f"{base} does not exist")
        enabled = set(_read(os.path.join(base, "cgroup.subtree_control")).split())
        missing = {"memory", "pids", "cpu"} - enabled
        available = set(_read(os.path.join(base, "cgroup.controllers")).split())
        if missing - available:
            raise HardeningError(f"controllers {sorted(missing - available)} not available in {base}")
        if missing:  # only possible where `base` holds no processes (cgroup v2's no-internal-process rule)
            _write(os.path.join(base, "cgroup.subtree_control"), " ".join(f"+{c}" for c in sorted(missing)))
        _sweep(base)
        d = os.path.join(base, name)
        os.mkdir(d)
        cg = cls({"": d}, 2)
        try:
            _write(f"{d}/memory.max", str(limits.memory_bytes))
            if os.path.exists(f"{d}/memory.swap.max"):
                _write(f"{d}/memory.swap.max", "0")
            _write(f"{d}/pids.max", str(limits.processes))
            _write(f"{d}/cpu.max", f"{int(cpus * 100_000)} 100000")
            _write(f"{d}/cpu.weight", str(_weight(100, 1, 10_000)))
        except OSError:
            cg.remove()
            raise
        return cg

    @classmethod
    def _make_v1(cls, bases: dict[str, str], name: str, limits: TreeLimits, cpus: float) -> Cgroup:
        dirs: dict[str, str] = {}
        cg = cls(dirs, 1)
        try:
            for c, base in bases.items():
                if not os.path.isdir(base):
                    raise HardeningError(f"{base} does not exist")
                d = os.path.join(base, name)
                if d not in dirs.values():  # controllers mounted together (cpu,cpuacct) share one dir
                    _sweep(base)
                    os.mkdir(d)
                dirs[c] = d
            mem = dirs["memory"]
            _write(f"{mem}/memory.limit_in_bytes", str(limits.memory_bytes))
            if os.path.exists(f"{mem}/memory.memsw.limit_in_bytes"):
                _write(f"{mem}/memory.memsw.limit_in_bytes", str(limits.memory_bytes))
            _write(f"{dirs['pids']}/pids.max", str(limits.processes))
            if "cpu" in dirs:
                period = int(_read(f"{dirs['cpu']}/cpu.cfs_period_us"))
                _write(f"{dirs['cpu']}/cpu.cfs_quota_us", str(int(cpus * period)))
                _write(f"{dirs['cpu']}/cpu.shares", str(_weight(1024, 2, 262_144)))
        except (OSError, HardeningError):
            cg.remove()
            raise
        return cg

    def procs_files(self) -> list[str]:
        """The ``cgroup.procs`` files a process writes its pid into to join (every hierarchy)."""
        return sorted({os.path.join(d, "cgroup.procs") for d in self.dirs.values()})

    def _dir(self, controller: str) -> str:
        return self.dirs["" if self.version == 2 else controller]

    def cpu_seconds(self) -> float:
        if self.version == 2:
            for line in _read(f"{self.dirs['']}/cpu.stat").splitlines():
                if line.startswith("usage_usec "):
                    return int(line.split()[1]) / 1e6
            return 0.0
        return int(_read(f"{self.dirs['cpuacct']}/cpuacct.usage")) / 1e9

    def oom_kills(self) -> int:
        text = _read(
            f"{self._dir('memory')}/{'memory.events' if self.version == 2 else 'memory.oom_control'}"
        )
        for line in text.splitlines():
            if line.startswith("oom_kill "):
                return int(line.split()[1])
        return 0

    def peak_bytes(self) -> int:
        name = "memory.peak" if self.version == 2 else "memory.max_usage_in_bytes"
        try:
            return int(_read(f"{self._dir('memory')}/{name}"))
        except (OSError, ValueError):
            return 0

    def pids(self) -> list[int]:
        d = self.dirs.get("" if self.version == 2 else "pids")
        try:
            return [int(p) for p in _read(f"{d}/cgroup.procs").split()] if d else []
        except OSError:
            return []

    def kill(self) -> None:
        """SIGKILL every process in the cgroup (``pids.max`` bounds how many can appear meanwhile)."""
        if self.version == 2:
            try:
                _write(f"{self.dirs['']}/cgroup.kill", "1")
                return
            except OSError:
                pass
        for _ in range(100):
            pids = self.pids()
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass

    def remove(self, timeout_s: float = 5.0) -> None:
        """Kill what is left and remove the cgroup (waits for the killed tasks to be reaped)."""
        self.kill()
        deadline = time.monotonic() + timeout_s
        for d in sorted(set(self.dirs.values())):
            while os.path.isdir(d):
                try:
                    os.rmdir(d)
                except OSError as exc:
                    if exc.errno != errno.EBUSY or time.monotonic() > deadline:
                        break
                    self.kill()
                    time.sleep(0.005)  # the killed tasks are being torn down: poll the condition


def _weight(default: int, low: int, high: int) -> int:
    """The cgroup's CPU weight at this process's nice level (the kernel's 1.25x per nice step): a
    cgroup is scheduled as one entity, and at the default weight a sandbox started by a ``nice 19``
    caller would outweigh every nice-0 process on the host."""
    nice = os.getpriority(os.PRIO_PROCESS, 0)
    return max(low, min(high, round(default / 1.25**nice)))


def _sweep(base: str) -> None:
    """Remove the cgroups of dead rollart processes under ``base`` (left by a crashed host process)."""
    try:
        names = os.listdir(base)
    except OSError:
        return
    for n in names:
        m = _NAME.match(n)
        if m and not os.path.exists(f"/proc/{m.group(1)}"):
            d = os.path.join(base, n)
            try:
                for pid in _read(os.path.join(d, "cgroup.procs")).split():
                    os.kill(int(pid), signal.SIGKILL)
                os.rmdir(d)
            except OSError:
                pass


def tree_cpu_seconds(root: int) -> float:
    """CPU seconds used by ``root`` and its descendants, living and reaped (utime + stime of each live
    task plus the cutime + cstime it collected from the children it waited for)."""
    children: dict[int, list[int]] = {}
    times: dict[int, int] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                fields = f.read().rpartition(")")[2].split()
        except OSError:
            continue
        pid = int(entry)
        children.setdefault(int(fields[1]), []).append(pid)
        times[pid] = sum(int(x) for x in fields[11:15])
    total, todo = 0, [root]
    while todo:
        pid = todo.pop()
        total += times.get(pid, 0)
        todo += children.get(pid, [])
    return total / os.sysconf("SC_CLK_TCK")
