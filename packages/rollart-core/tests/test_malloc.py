"""rollart_core.malloc on this (glibc) machine: the arena limit is accepted, trimming answers, a bad
limit is refused."""

from __future__ import annotations

import subprocess
import sys

import pytest

from rollart_core.malloc import limit_arenas, release_free_memory


def test_arena_limit_and_trim_on_glibc() -> None:
    # in a child: the limit stays for the life of the process that sets it
    code = (
        "from rollart_core.malloc import limit_arenas, release_free_memory\n"
        "import torch\n"
        "assert limit_arenas(2) is True\n"
        "x = [torch.ones(16_000) for _ in range(2_000)]\n"
        "del x\n"
        "print(release_free_memory())\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() in ("True", "False")
    assert isinstance(release_free_memory(), bool)


def test_a_limit_below_one_is_refused() -> None:
    with pytest.raises(ValueError, match="at least 1 arena"):
        limit_arenas(0)
