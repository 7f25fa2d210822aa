"""flowrl/console.py: a launch's ranks share one stderr; their lines must arrive whole."""

from __future__ import annotations

import subprocess
import sys

WRITER = (
    "from flowrl.console import stderr_line\n"
    "for i in range(3000):\n"
    "    stderr_line(f'flowrl: error: rank {RANK} line {i} ' + 'x' * 80)\n"
)


def test_lines_of_two_unbuffered_processes_on_one_pipe_never_interleave():
    """Two ``python -u`` writers (as torch's launcher starts the ranks) on the same stderr pipe."""
    read, write = subprocess.os.pipe()
    procs = [
        subprocess.Popen([sys.executable, "-u", "-c", WRITER.replace("{RANK}", str(rank))], stderr=write)
        for rank in (0, 1)
    ]
    subprocess.os.close(write)
    with open(read, encoding="utf-8") as stream:
        lines = stream.read().splitlines()
    assert [p.wait(timeout=60) for p in procs] == [0, 0]
    expected = {f"flowrl: error: rank {r} line {i} " + "x" * 80 for r in (0, 1) for i in range(3000)}
    assert len(lines) == 6000 and set(lines) == expected
