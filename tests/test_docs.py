"""The docs say only what is true of the code: their commands parse, their layout names files that exist.

Every shell command in README.md, ARCHITECTURE.md, gallery/README.md and docs/*.md (fenced ``bash`` blocks and
inline code) that starts ``flowrl``, ``python -m bench.X`` or ``accelerate launch ... -m flowrl`` is checked as a
user would run it, without running it:

- ``flowrl ...``: parsed by the CLI's own parser; for ``train`` and ``sample`` every ``configs/`` file exists and
  the config files and ``key=value`` overrides load (:func:`flowrl.config.load_config`); a training batch splits
  over the launch's processes (``--processes N``, or an ``accelerate launch`` config's ``num_processes``);
- ``python -m bench.X ARGS``: the bench's ``main()`` parses ``ARGS`` with its real parser and is stopped there.

Commands with placeholders (``CONFIG``, ``<run>``, ``...``, ``[--flag]``, ``$VAR``) are left out. Every ``yaml``
block loads as a config file on its own. The ``Layout`` blocks of README.md and ARCHITECTURE.md name each package
folder and the files in it; both are checked against the tree, and every ``flowrl`` subpackage must appear in both.
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import re
import shlex
import sys
from pathlib import Path

import pytest
import tomllib
import yaml

from flowrl.cli import build_parser, parse_command_line
from flowrl.config import load_config
from flowrl.config_files import split_config_args
from flowrl.local_launch import check_split

ROOT = Path(__file__).resolve().parents[1]
DOCS = [
    ROOT / "README.md",
    ROOT / "ARCHITECTURE.md",
    ROOT / "gallery" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
PLACEHOLDER = re.compile(r"^[A-Z][A-Z_]*(\.yaml)?$|[<>\[\]$]|\.\.\.|^-$")
# commands the docs show as history, each with the reason it no longer runs as written
HISTORICAL = {
    ("python", "-m", "bench.alignment", "--data"): "the 16x16 study's script, kept in runs/issue14-16x16/",
    ("python", "-m", "bench.alignment", "--seeds", "10"): "the 16x16 study's script, kept in runs/issue14-16x16/",
}


def _fenced(text: str) -> tuple[list[tuple[str, str]], str]:
    """(language, body) of each fenced block, and the text outside the blocks."""
    blocks, outside, lang, body = [], [], None, []
    for line in text.splitlines():
        if line.lstrip().startswith("```"):
            if lang is None:
                lang, body = line.strip()[3:].strip(), []
            else:
                blocks.append((lang, "\n".join(body)))
                lang = None
        elif lang is None:
            outside.append(line)
        else:
            body.append(line)
    return blocks, "\n".join(outside)


def _command(text: str) -> list[str] | None:
    """The words of one shell command (leading VAR=value, time and venv paths dropped), or None."""
    try:
        words = shlex.split(text, comments=True)
    except ValueError:
        return None
    while words and (re.match(r"^[A-Z_]+=", words[0]) or words[0] in ("time", "/usr/bin/time", "-v")):
        words = words[1:]
    if not words:
        return None
    words[0] = re.sub(r"^(\.venv/bin/|\.venv-openclip/bin/)", "", words[0])
    if words[0] == "python3":
        words[0] = "python"
    if words[0] == "flowrl" and len(words) > 1:
        return words
    if words[:2] == ["python", "-m"] and len(words) > 2 and words[2].startswith("bench."):
        return words
    if words[:2] == ["accelerate", "launch"] and "-m" in words:
        return words
    return None


def doc_commands() -> list[tuple[str, list[str], bool]]:
    """(doc name, command words, whole) of every command the docs show; ``whole``: a code block's full line.

    Inline code may name a command without its required arguments (`flowrl train --resume`).
    """
    found: dict[tuple[str, ...], tuple[str, bool]] = {}
    for doc in DOCS:
        blocks, outside = _fenced(doc.read_text())
        lines = [
            (line, True)
            for lang, body in blocks
            if lang in ("", "bash", "sh", "shell", "console")
            for line in body.replace("\\\n", " ").splitlines()
        ]
        for paragraph in outside.split("\n\n"):
            lines += [(span, False) for span in re.findall(r"`([^`]+)`", paragraph.replace("\n", " "))]
        for line, whole in lines:
            for part in re.split(r"&&|;|\|", line):
                words = _command(part.strip())
                if words and not any(PLACEHOLDER.search(w) for w in words) and tuple(words) not in HISTORICAL:
                    doc_name, was_whole = found.get(tuple(words), (doc.name, False))
                    found[tuple(words)] = (doc_name, was_whole or whole)
    return [(doc, list(words), whole) for words, (doc, whole) in found.items()]


COMMANDS = doc_commands()


class ArgumentError(Exception):
    """argparse's error message, raised instead of printing the usage and exiting."""


FRAGMENT_ERRORS = ("expected one argument", "the following arguments are required")


def _parse(argv: list[str], whole: bool) -> argparse.Namespace | None:
    """The CLI's parse of ``argv``; None for an inline fragment that leaves out a required argument."""

    def error(self, message):
        raise ArgumentError(f"{self.prog}: {message}")

    original = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = error
    try:
        return parse_command_line(build_parser(), argv)
    except ArgumentError as err:
        if not whole and any(e in str(err) for e in FRAGMENT_ERRORS):
            return None
        raise
    finally:
        argparse.ArgumentParser.error = original


def _check_flowrl(argv: list[str], whole: bool = True, processes: int = 1) -> None:
    """Check ``flowrl ARGV``; ``processes``: the launch's process count, over which a training batch must split."""
    if argv[0] == "pretrain-digits":
        from flowrl.models.digits.pretrain import main as pretrain_main

        _check_bench_main(lambda: pretrain_main(argv[1:]), [])
        return
    ns = _parse(argv, whole)
    if ns is None:
        return
    if argv[0] in ("train", "sample"):
        files, overrides = split_config_args(ns.args)
        for name in files or []:
            if name.startswith("configs/"):
                assert (ROOT / name).is_file(), f"{name} does not exist"
        existing = [name for name in files or [] if (ROOT / name).is_file()]
        if existing or not files:  # a file the doc writes first (printf ... > ink.yaml) is not here
            cfg = load_config(existing or None, overrides)
            if argv[0] == "train" and getattr(ns, "processes", None) not in (None, "auto"):
                processes = int(ns.processes)
            if argv[0] == "train" and processes > 1:  # what every rank checks at start
                check_split(cfg, processes)


class Parsed(Exception):
    """Raised by the patched ``parse_args`` once a bench's arguments parsed."""


def _check_bench_main(run, argv: list[str], name: str = "bench") -> None:
    original = argparse.ArgumentParser.parse_args

    def parse_then_stop(self, args=None, namespace=None):
        original(self, args, namespace)
        raise Parsed

    argparse.ArgumentParser.parse_args = parse_then_stop
    saved = sys.argv
    sys.argv = [name, *argv]
    try:
        run()
    except Parsed:
        return
    finally:
        argparse.ArgumentParser.parse_args = original
        sys.argv = saved
    assert not argv, f"{name} takes no arguments but the docs pass {argv}"


@pytest.mark.parametrize("doc,command,whole", COMMANDS, ids=[f"{d}: {' '.join(c)}"[:120] for d, c, _ in COMMANDS])
def test_a_documented_command_parses(doc, command, whole, monkeypatch):
    monkeypatch.chdir(ROOT)
    if command[0] == "flowrl":
        _check_flowrl(command[1:], whole)
    elif command[0] == "python":
        module = importlib.import_module(command[2])
        _check_bench_main(module.main, command[3:], command[2])
    else:  # accelerate launch [launcher flags] -m flowrl train ...
        from accelerate.commands.launch import launch_command_parser

        launch_command_parser().parse_args(command[2:])  # the launcher's own flags
        at = command.index("-m")
        processes = 1
        for i, word in enumerate(command[:at]):
            if word == "--config_file":
                assert (ROOT / command[i + 1]).is_file(), f"{command[i + 1]} does not exist"
                processes = int(yaml.safe_load((ROOT / command[i + 1]).read_text()).get("num_processes", 1))
        for i, word in enumerate(command[:at]):
            if word == "--num_processes":
                processes = int(command[i + 1])
        if command[at + 1] == "flowrl":
            _check_flowrl(command[at + 2 :], whole, processes)


def test_the_docs_show_commands_of_every_kind():
    kinds = {c[0] if c[0] != "python" else "bench" for _, c, _ in COMMANDS}
    assert kinds == {"flowrl", "bench", "accelerate"}, kinds
    subcommands = {c[1] for _, c, whole in COMMANDS if c[0] == "flowrl" and whole}
    assert {"train", "sample", "export", "eval", "gallery", "demo", "serve-reward"} <= subcommands, subcommands


BENCHES = sorted(p.stem for p in (ROOT / "bench").glob("*.py") if "\ndef main(" in p.read_text())


@pytest.mark.parametrize("name", BENCHES)
def test_every_bench_answers_help_without_running(name, monkeypatch, capsys):
    """``python -m bench.X --help`` prints its usage and exits 0 (bench.gpu_plan ran its whole plan instead)."""
    module = importlib.import_module(f"bench.{name}")
    monkeypatch.setattr(sys, "argv", [f"bench.{name}", "--help"])
    with pytest.raises(SystemExit) as stop:
        module.main()
    assert stop.value.code == 0 and "usage:" in capsys.readouterr().out


def test_a_documented_command_with_a_missing_flag_fails_the_check():
    with pytest.raises(ArgumentError, match="unrecognized arguments: --merged"):
        _check_flowrl(["export", "--merged", "runs/x", "--out", "x"], whole=False)
    with pytest.raises(ArgumentError, match="expected one argument"):
        _check_flowrl(["train", "--resume"])
    _check_flowrl(["train", "--resume"], whole=False)
    with pytest.raises(AssertionError, match="does not exist"):
        _check_flowrl(["train", "configs/grpo/no_such.yaml"])
    with pytest.raises(ValueError, match="does not split into whole groups over 8 processes"):
        _check_flowrl(["train", "configs/grpo/sd3.5m_pickscore.yaml"], processes=8)


# -- the Layout blocks -----------------------------------------------------------------------------


def _layout(doc: str) -> list[tuple[Path, str]]:
    """(folder, line) for each line of the doc's ``## Layout`` block; the folder is the one the line is under."""
    text = (ROOT / doc).read_text()
    block = re.search(r"## Layout\n+```text\n(.*?)```", text, re.S).group(1)
    stack: list[tuple[int, Path]] = []
    out = []
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip())
        head = re.match(r"^ {0,4}([\w.-]+)(/?)\s", line + " ")
        if head:  # an entry: a folder (pushed) or a file of the folder above it
            while stack and stack[-1][0] >= indent:
                stack.pop()
            if head.group(2):
                stack.append((indent, (stack[-1][1] if stack else ROOT) / head.group(1)))
        out.append((stack[-1][1] if stack else ROOT, line))
    return out


@pytest.mark.parametrize("doc", ["README.md", "ARCHITECTURE.md"])
def test_the_layout_names_folders_and_files_that_exist(doc):
    missing = []
    for folder, line in _layout(doc):
        if not folder.is_dir():
            missing.append(f"{folder.relative_to(ROOT)}/ | {line.strip()}")
        for name in re.findall(r"(?<![\w/.])([\w*]+\.py)\b", line):
            if not list(folder.glob(name)):
                missing.append(f"{folder.relative_to(ROOT)}/{name} | {line.strip()}")
        for path in re.findall(r"\b((?:flowrl|models|samplers|rewards|kernels|bench)/[\w/]+\.py)\b", line):
            if not ((ROOT / path).is_file() or (ROOT / "flowrl" / path).is_file()):
                missing.append(f"{path} | {line.strip()}")
    assert not missing, f"{doc}'s Layout names what is not there:\n  " + "\n  ".join(missing)


@pytest.mark.parametrize("doc", ["README.md", "ARCHITECTURE.md"])
def test_the_layout_lists_every_flowrl_subpackage(doc):
    listed = {folder for folder, _ in _layout(doc)}
    packages = {p.parent for p in (ROOT / "flowrl").glob("*/__init__.py")}
    left_out = sorted(str(p.relative_to(ROOT)) for p in packages - listed)
    assert not left_out, f"{doc}'s Layout leaves out {left_out}"


def test_the_readme_lists_every_extra():
    extras = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    line = next(line for _, line in _layout("README.md") if line.startswith("pyproject.toml"))
    assert set(re.findall(r"\[(\w+)\]", line)) == set(extras), line


def _yaml_blocks() -> list[tuple[str, str]]:
    return [(doc.name, body) for doc in DOCS for lang, body in _fenced(doc.read_text())[0] if lang in ("yaml", "yml")]


@pytest.mark.parametrize("doc,body", _yaml_blocks(), ids=lambda v: v if v.endswith(".md") else v.split(":")[0])
def test_a_documented_config_block_loads(doc, body, tmp_path):
    path = tmp_path / "block.yaml"
    path.write_text(body)
    load_config(path)


def _hf_commands() -> list[list[str]]:
    """Every ``hf ...`` line of README.md and the config headers (the weights to download)."""
    lines = [line for _, body in _fenced((ROOT / "README.md").read_text())[0] for line in body.splitlines()]
    for path in sorted((ROOT / "configs").rglob("*.yaml")):
        lines += [line.lstrip("# ") for line in path.read_text().splitlines()]
    return [shlex.split(line, comments=True) for line in lines if re.match(r"^hf\s", line.strip())]


def test_the_weight_download_commands_parse_with_the_installed_hub_cli():
    """The pinned huggingface_hub installs ``hf`` (no ``huggingface-cli``); ``--include`` takes one pattern a flag."""
    import typer
    from huggingface_hub.cli.download import download
    from typer.main import get_command

    assert Path(sys.executable).with_name("hf").is_file(), "the pinned huggingface_hub installs the hf command"
    app = typer.Typer()
    app.command()(download)
    command = get_command(app)
    commands = _hf_commands()
    assert len(commands) > 20, commands
    files = [*DOCS, *(ROOT / "configs").rglob("*.yaml")]
    stale = [str(p.relative_to(ROOT)) for p in files if "huggingface-cli" in p.read_text()]
    assert not stale, f"huggingface-cli is not installed by the pinned huggingface_hub; use hf: {stale}"
    for words in commands:
        if words[1] == "download":
            params = command.make_context("hf download", words[2:]).params
            assert params["local_dir"] and not params["filenames"], words
        else:
            assert words[1:3] == ["auth", "login"], words


@pytest.mark.parametrize("command", ["train", "sample"])
def test_the_help_says_config_files_stack(command, capsys):
    """README and the config headers stack a recipe and a preset; ``--help`` says several files are taken."""
    with pytest.raises(SystemExit):
        build_parser().parse_args([command, "--help"])
    out = capsys.readouterr().out
    assert "[CONFIG.yaml ...]" in out
    if command == "train":  # --resume alone reads the run's config.yaml (docs/reliability.md)
        assert "run's own config.yaml" in " ".join(out.split())


# -- key | default tables ------------------------------------------------------------------------------


def _defaults(doc: str) -> dict[str, object]:
    """The defaults a ``| key | default | meaning |`` table of ``doc`` documents, from the code."""
    cfg = load_config(None, [])
    if doc == "solrl.md":
        return {f"solrl.{k}": v for k, v in vars(cfg.solrl).items()}
    if doc == "trees.md":
        return dict(vars(cfg.sampler.tree))
    if doc == "sage-grpo.md":
        return dict(load_config(None, ["objective={name: sage_grpo}"]).objective)
    if doc == "rewards.md":  # the remote client's options (url and token have no fixed default)
        import inspect

        from flowrl.rewards.remote import RemoteReward

        params = inspect.signature(RemoteReward.__init__).parameters
        return {k: p.default for k, p in params.items() if k not in ("self", "url", "token")}
    from flowrl.guard_spec import GuardSpec

    return {f.name: f.default for f in dataclasses.fields(GuardSpec) if f.name in ("tolerance", "relative", "on_trip")}


def _value(text: str) -> object:
    """A table cell's value: a number, true/false/null, a [list], else the text (backticks dropped)."""
    text = text.strip().strip("`")
    try:
        return float(text) if re.search(r"[.e]", text) else int(text)
    except ValueError:
        pass
    if text in ("true", "false", "null") or text.startswith("["):
        return yaml.safe_load(text)
    return text


@pytest.mark.parametrize("doc", ["solrl.md", "trees.md", "sage-grpo.md", "alignment.md", "rewards.md"])
def test_a_key_default_table_states_the_code_s_defaults(doc):
    code = _defaults(doc)
    rows = re.findall(r"^\| (`[^|]+`) \| ([^|]+) \|", (ROOT / "docs" / doc).read_text(), re.M)
    checked = 0
    for keys, values in rows:
        names = re.findall(r"`([\w.]+)`", keys)
        if not names or not all(n in code for n in names):
            continue
        said = [_value(v) for v in values.split(", ")] if len(names) > 1 else [_value(values)]
        expected = [code[n] for n in names]
        assert said == expected, f"docs/{doc}: {keys} says {values.strip()}; the code has {expected}"
        checked += len(names)
    assert checked >= 3, f"docs/{doc}: no key | default rows found"
