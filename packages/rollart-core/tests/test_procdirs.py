"""rollart_core.procdirs: a killed process's socket directory is swept by the next one made."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

from rollart_core.procdirs import owned_tempdir, sweep_orphans

MAKE_AND_WAIT = (
    "import time; from rollart_core.procdirs import owned_tempdir; "
    "p = owned_tempdir('rollart-test-'); open(p + '/s', 'w').close(); print(p, flush=True); time.sleep(120)"
)

pytestmark = pytest.mark.skipif(not os.path.exists("/proc/self/ns/pid"), reason="needs Linux /proc")


def _child(tmp: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-c", MAKE_AND_WAIT],
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "TMPDIR": str(tmp)},
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def test_a_killed_owners_directory_goes_a_live_ones_stays(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    killed, killed_dir = _child(tmp_path)
    live, live_dir = _child(tmp_path)
    try:
        killed.send_signal(signal.SIGKILL)
        killed.wait(10)
        assert os.path.isdir(killed_dir) and os.listdir(killed_dir) == ["s"]  # nothing ran on its way out
        # not ours to judge: another PID namespace, another prefix, a plain file with a dead PID's name
        ns = os.stat("/proc/self/ns/pid").st_ino
        foreign = tmp_path / f"rollart-test-{ns + 1}-{killed.pid}-abc"
        other_prefix = tmp_path / f"rollart-other-{ns}-{killed.pid}-abc"
        plain_file = tmp_path / f"rollart-test-{ns}-{killed.pid}-file"
        foreign.mkdir()
        other_prefix.mkdir()
        plain_file.write_text("")

        mine = owned_tempdir("rollart-test-")  # sweeps first

        assert Path(mine).parent == tmp_path and oct(os.stat(mine).st_mode & 0o777) == "0o700"
        assert Path(mine).name.startswith(f"rollart-test-{ns}-{os.getpid()}-")
        assert not os.path.exists(killed_dir)
        assert os.path.isdir(live_dir)
        assert foreign.is_dir() and other_prefix.is_dir() and plain_file.is_file()
        assert sweep_orphans("rollart-test-") == []  # this process's own directory is alive
    finally:
        live.kill()
        live.wait(10)
    # once its owner is gone, the live one's directory is swept too
    assert sweep_orphans("rollart-test-") == [live_dir]
