"""Worst-case answers against the host: N concurrent sandboxed answers (memory bomb, fork bomb, file bomb,
output flood, in turn), and what the host keeps meanwhile.

    nice -n 19 uv run --no-sync python integration/bench/sandbox_bombs.py [--answers 8] [--memory-mb 64]
        [--max-processes 8] [--timeout-s 6] [--out sandbox_bombs.json]

Measured: the host's ``MemAvailable`` (``/proc/meminfo``) before the answers and its minimum while they
run (polled every 20 ms), and how late a 10 ms sleep of this process wakes at worst meanwhile (a
stand-in for "every other stage keeps running"). Per answer: how it ended (``killed_reason``), its
whole-tree memory peak (from its cgroup, where one is used) and its duration. The whole-tree limits
bound the memory every answer can take, processes and files together, to ``--memory-mb``; the
drop in available memory must stay below ``answers x memory_mb`` plus the harness's own interpreters
outside the limit (none: they are inside it).

The defaults are small on purpose (the machine is shared): 8 x 64 MB. Prints a table and writes JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time

from rollart_reward.sandbox import run_python_async

BOMBS = {
    # Touches its pages: 1 MB at a time until the limit stops it.
    "memory": "blocks = []\nwhile True:\n    blocks.append(bytearray(b'\\x01') * (1 << 20))\n",
    # Forks until it cannot, every child sleeping, then the parent spins.
    "fork": (
        "import os, time\nwhile True:\n    try:\n        if os.fork() == 0:\n            time.sleep(60)\n"
        "            os._exit(0)\n    except OSError:\n        break\nwhile True:\n    pass\n"
    ),
    # Files of 1 MB in /tmp and /dev/shm until both are full, then holds them.
    "file": (
        "import time\nn = 0\nfor d in ('/tmp', '/dev/shm'):\n    try:\n        while True:\n"
        "            with open(f'{d}/f{n}', 'wb') as f:\n                f.write(b'x' * (1 << 20))\n"
        "            n += 1\n    except OSError:\n        pass\ntime.sleep(60)\n"
    ),
    # Writes to stdout as fast as it can.
    "output": "import sys\nwhile True:\n    sys.stdout.write('x' * 65536)\n",
}


def mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) << 10
    raise RuntimeError("no MemAvailable in /proc/meminfo")


async def main(args: argparse.Namespace) -> dict[str, object]:
    kinds = list(BOMBS)
    before = mem_available()
    low = before
    late = 0.0
    stop = asyncio.Event()

    async def watch() -> None:
        nonlocal low, late
        while not stop.is_set():
            t = time.perf_counter()
            await asyncio.sleep(0.01)
            late = max(late, time.perf_counter() - t - 0.01)
            low = min(low, mem_available())

    watcher = asyncio.ensure_future(watch())
    t0 = time.perf_counter()
    results = await asyncio.gather(
        *(
            run_python_async(
                BOMBS[kinds[i % len(kinds)]],
                "",
                timeout_s=args.timeout_s,
                memory_mb=args.memory_mb,
                max_processes=args.max_processes,
                max_output_bytes=65536,
            )
            for i in range(args.answers)
        )
    )
    wall = time.perf_counter() - t0
    stop.set()
    await watcher
    after = mem_available()
    rows = [
        {
            "bomb": kinds[i % len(kinds)],
            "passed": r.passed,
            "killed_reason": r.killed_reason,
            "limits": r.limits,
            "peak_mb": None if r.memory_peak_bytes is None else round(r.memory_peak_bytes / 2**20, 1),
            "duration_s": round(r.duration_s, 2),
        }
        for i, r in enumerate(results)
    ]
    bound = args.answers * args.memory_mb
    return {
        "date": time.strftime("%Y-%m-%d", time.gmtime()),
        "answers": args.answers,
        "memory_mb": args.memory_mb,
        "max_processes": args.max_processes,
        "timeout_s": args.timeout_s,
        "wall_s": round(wall, 2),
        "mem_available_before_mb": before >> 20,
        "mem_available_min_mb": low >> 20,
        "mem_available_after_mb": after >> 20,
        "drop_mb": (before - low) >> 20,
        "bound_mb": bound,
        "max_wakeup_late_ms": round(late * 1000, 1),
        "rows": rows,
    }


def print_table(report: dict[str, object]) -> None:
    print(f"{'bomb':8} {'killed_reason':14} {'limits':8} {'peak_mb':>8} {'duration_s':>10}")
    for row in report["rows"]:  # type: ignore[attr-defined]
        peak = "-" if row["peak_mb"] is None else f"{row['peak_mb']:.1f}"
        print(
            f"{row['bomb']:8} {row['killed_reason']!s:14} {row['limits']:8} {peak:>8} {row['duration_s']:>10}"
        )
    print(
        f"MemAvailable: {report['mem_available_before_mb']} MB before, {report['mem_available_min_mb']} MB at "
        f"the lowest (drop {report['drop_mb']} MB; bound {report['bound_mb']} MB), "
        f"{report['mem_available_after_mb']} MB after; worst wake-up {report['max_wakeup_late_ms']} ms late; "
        f"wall {report['wall_s']} s"
    )


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--answers", type=int, default=8)
    parser.add_argument("--memory-mb", type=int, default=64)
    parser.add_argument("--max-processes", type=int, default=8)
    parser.add_argument("--timeout-s", type=float, default=6.0)
    parser.add_argument("--out", default="")
    args = parser.parse_args()
    report = asyncio.run(main(args))
    print_table(report)
    print(json.dumps(report))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(report, f, indent=2)
