"""A launched process leaves without interpreter finalization (torch's gloo threads may still be live).

``flowrl.distributed.exit_launched_process`` runs the ``atexit`` handlers, flushes the streams and
ends with ``os._exit``; the command line takes that exit in every process of a multi-process launch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
FINALIZED = """
class Finalized:
    def __del__(self):
        print("finalized", flush=True)

witness = Finalized()  # a module global: collected only when the interpreter finalizes
"""


def run_python(code: str, **env: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_ADDR")}
    return subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        env={**base, "HF_HUB_OFFLINE": "1", **env},
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_exit_runs_exit_handlers_flushes_and_skips_finalization():
    code = FINALIZED + (
        "import atexit, sys\n"
        "from flowrl.distributed import exit_launched_process\n"
        "atexit.register(print, 'handler ran')\n"
        "sys.stdout.write('buffered, no newline; ')\n"
        "exit_launched_process(3)\n"
    )
    result = run_python(code)
    assert result.returncode == 3, result.stderr
    assert result.stdout == "buffered, no newline; handler ran\n"  # nothing from finalization


def test_the_command_line_of_a_launched_process_leaves_that_way():
    code = FINALIZED + (
        "import atexit, sys\n"
        "from flowrl.cli import main\n"
        "atexit.register(print, 'handler ran')\n"
        "sys.argv = ['flowrl', 'train', 'configs/grpo/digits.yaml']\n"
        "main()\n"
    )
    launched = run_python(code, WORLD_SIZE="2", FLOWRL_NO_SUPERVISOR="1")
    assert launched.returncode == 2  # the user error's code, through os._exit
    assert "WORLD_SIZE=2 but no launcher set MASTER_ADDR" in launched.stderr
    assert launched.stdout == "handler ran\n"
    alone = run_python(code.replace("main()\n", "sys.exit(main(['rewards', 'list']))\n"), WORLD_SIZE="2")
    assert alone.returncode == 0 and alone.stdout.endswith("handler ran\nfinalized\n")  # an explicit argv returns


def test_a_rank_whose_peer_ended_says_so_in_one_line():
    """gloo's 'Connection closed by peer' after another rank failed: one line, not a traceback burying that rank's."""
    code = (
        "import sys\n"
        "import flowrl.cli as cli\n"
        "def train(ns):\n"
        "    raise RuntimeError('[gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:4482. This is "
        "typically caused by a remote worker crashing.')\n"
        "cli.cmd_train = train\n"
        "sys.argv = ['flowrl', 'train']\n"
        "cli.main()\n"
    )
    peer = run_python(code, WORLD_SIZE="2", RANK="0", FLOWRL_NO_SUPERVISOR="1")
    assert peer.returncode == 1
    assert peer.stderr.splitlines() == [
        "flowrl: error: rank 0 stopped because another process of the launch ended during a collective; "
        "that process's error line (or the launcher's exitcode line, for a killed one) says why"
    ]
    late = "[gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting 4000ms for recv operation to complete"
    waited_code = code.replace("[gloo/transport/tcp/pair.cc:553] Connection closed by peer", late)
    waited = run_python(waited_code, WORLD_SIZE="2", RANK="1", FLOWRL_NO_SUPERVISOR="1")
    assert waited.returncode == 1
    assert waited.stderr.splitlines() == [
        "flowrl: error: rank 1 waited longer than train.collective_timeout_s for another process of the launch; "
        "raise it if rank 0's evaluation or checkpoint takes that long, else that process's error says why"
    ]
    own = run_python(code.replace("Connection closed by peer", "an error of its own"), WORLD_SIZE="2")
    assert own.returncode == 1 and "Traceback" in own.stderr  # any other error keeps its traceback
