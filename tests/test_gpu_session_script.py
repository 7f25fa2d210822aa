"""bench/gpu_session.sh names only things that exist: its flags, overrides and tests are checked on the CPU.

A device call is minutes of a scarce budget; a renamed flag or test would waste it. Each ``step`` line of
the script is parsed as the shell would (continuation lines joined, ``shlex`` split), then:

- ``python3 -m bench.X ARGS``: the bench's own ``main()`` parses ``ARGS`` with its real argparse parser and
  is stopped right after parsing, so every flag and choice is checked and nothing is measured;
- ``python3 -m flowrl train KEY=VALUE ...``: the overrides go through :func:`flowrl.config.load_config`;
- ``python3 -m pytest ... PATH[::TEST]``: each path exists and each named test is defined in it.
"""

from __future__ import annotations

import argparse
import importlib
import re
import shlex
import sys
from pathlib import Path

import pytest

from flowrl.config import load_config

ROOT = Path(__file__).resolve().parents[1]
SCRIPT = ROOT / "bench" / "gpu_session.sh"


class Parsed(Exception):
    """Raised by the patched ``parse_args`` once a bench's arguments parsed."""


def steps() -> list[tuple[str, list[str]]]:
    """(name, command words) of every ``step NAME CAP COMMAND...`` line of the script."""
    text = SCRIPT.read_text().replace("\\\n", " ")
    out = []
    for line in text.splitlines():
        words = shlex.split(line, comments=True)
        if len(words) > 3 and words[0] == "step":
            out.append((words[1], words[3:]))
    return out


def test_the_script_has_steps_of_each_kind():
    runners = {command[2].split(".")[0] for _, command in steps() if command[:2] == ["python3", "-m"]}
    assert runners == {"bench", "flowrl", "pytest"}, runners


@pytest.mark.parametrize("name,command", [s for s in steps() if s[1][2].startswith("bench.")], ids=lambda v: v)
def test_a_bench_step_parses_with_the_bench_s_own_parser(name, command, monkeypatch):
    module = importlib.import_module(command[2])
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise Parsed

    monkeypatch.setattr(argparse.ArgumentParser, "parse_args", parse_then_stop)
    monkeypatch.setattr(sys, "argv", [command[2], *command[3:]])
    with pytest.raises(Parsed):
        module.main()


@pytest.mark.parametrize("name,command", [s for s in steps() if s[1][2] == "flowrl"], ids=lambda v: v)
def test_a_training_step_s_overrides_are_valid_config(name, command):
    if command[3] != "train":
        raise ValueError(f"step {name}: only `flowrl train` is checked, got {command[3:]}")
    overrides = [word for word in command[4:] if "=" in word]
    files = [word for word in command[4:] if "=" not in word]
    load_config(files or None, overrides)


@pytest.mark.parametrize("name,command", [s for s in steps() if s[1][2] == "pytest"], ids=lambda v: v)
def test_a_test_step_names_existing_tests(name, command):
    targets = [word for word in command[3:] if word.startswith("tests/")]
    assert targets, command
    for target in targets:
        path, _, test = target.partition("::")
        source = (ROOT / path).read_text()
        if test:
            assert re.search(rf"^def {re.escape(test)}\(", source, re.MULTILINE), f"{target} is not defined"
