"""``flowrl reward new NAME``: scaffold an installable reward plugin package.

The package registers its factory in the ``flowrl.rewards`` entry-point group, so after
``pip install`` the reward can be named in any config (``rewards: {NAME: {weight: 1.0}}``) and
shows in ``flowrl rewards list``. Its test runs the conformance kit.
"""

from __future__ import annotations

import keyword
import re
import shutil
from pathlib import Path

PYPROJECT = """[build-system]
requires = ["setuptools>=61"]
build-backend = "setuptools.build_meta"

[project]
name = "flowrl-reward-{dash}"
version = "0.1.0"
description = "A flowrl reward plugin: {name}"
requires-python = ">=3.10"
dependencies = ["torch"]  # add the libraries your scorer needs; flowrl itself is the host

[project.entry-points."flowrl.rewards"]
{name} = "{package}.reward:{name}"

[tool.setuptools]
packages = ["{package}"]
"""

TEMPLATE_NAMES = ("torch", "annotations", "check_reward", "test_conformance")  # module-level names of the templates
REWARD = '''"""The {name} reward for flowrl.

Contract: ``reward(images (B, 3, H, W) in [0, 1], prompts, **metadata) -> Tensor (B,) float32``.
Return NaN for a sample the reward does not apply to (and set ``allows_nan = True``).
"""

from __future__ import annotations

from typing import Any, Sequence

import torch
from torch import Tensor


def {name}(target: float = 0.5) -> Any:
    """Build the reward (replace the body with your scorer; load weights here, lazily).

    Args:
        target: example option, settable from a config: ``rewards: {{{name}: {{target: 0.3}}}}``.
    """

    @torch.no_grad()
    def score(images: Tensor, prompts: Sequence[str], **metadata: Any) -> Tensor:
        brightness = images.float().mean(dim=tuple(range(1, images.ndim)))
        return -(brightness - target).abs()  # example: closeness of the mean brightness to target

    return score


{name}.offline = True  # this reward downloads nothing
'''

TEST = """from flowrl.rewards.testing import check_reward

from {package}.reward import {name}


def test_conformance():
    check_reward({name})
"""

README = """# flowrl-reward-{dash}

A reward plugin for flowrl.

    pip install -e .                 # registers `{name}` in the flowrl.rewards entry-point group
    flowrl rewards list              # shows {name}
    pytest tests                     # runs flowrl's conformance kit on it

Use it in a config:

    rewards:
      {name}: {{weight: 1.0, target: 0.5}}

Edit `{package}/reward.py`: the factory takes the config options and returns
`score(images, prompts, **metadata) -> Tensor (B,) float32`. For scorers with heavy or clashing
dependencies, run them behind a server process and call it from the factory.
"""


def _check_not_builtin(name: str) -> None:
    """Refuse a built-in reward's name: the built-in wins, so a config naming it would never reach the plugin.

    Raises:
        ValueError: ``name`` is a built-in reward's.
    """
    from .rewards.registry import builtin_reward_names

    if name in builtin_reward_names():
        raise ValueError(
            f"reward name {name!r} is a built-in reward's, which would shadow the plugin; choose e.g. 'my_{name}'"
        )


def scaffold_reward(name: str, directory: str | Path = ".") -> Path:
    """Write the plugin package ``<directory>/flowrl-reward-<name>/``.

    Args:
        name: reward name, a lowercase Python identifier (it is also the factory's name).
        directory: parent folder.

    Returns:
        The package folder.

    Raises:
        ValueError: an invalid name, or the name of a built-in reward (which would shadow the plugin).
        FileExistsError: the folder exists already.
        ValueError: the folder cannot be written (``directory`` missing, read-only or not a folder).
    """
    if not re.fullmatch(r"[a-z](?:[a-z0-9_]*[a-z0-9])?", name):  # a trailing _ makes a project name pip refuses
        raise ValueError(
            f"reward name {name!r} must be a lowercase identifier like 'my_reward' (letters, digits, _; "
            "not ending in _)"
        )
    if keyword.iskeyword(name) or keyword.issoftkeyword(name) or name in TEMPLATE_NAMES:
        raise ValueError(
            f"reward name {name!r} is a Python keyword or a name the plugin's module uses; choose e.g. '{name}_reward'"
        )
    _check_not_builtin(name)
    dash, package = name.replace("_", "-"), f"flowrl_reward_{name}"
    root = Path(directory) / f"flowrl-reward-{dash}"
    if root.exists():
        raise FileExistsError(f"{root} already exists; choose another name or remove it")
    values = {"name": name, "dash": dash, "package": package}
    files = {
        "pyproject.toml": PYPROJECT,
        f"{package}/__init__.py": '"""flowrl reward plugin {name}."""\n',
        f"{package}/reward.py": REWARD,
        "tests/test_reward.py": TEST,
        "README.md": README,
    }
    try:
        for rel, template in files.items():
            path = root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(template.format(**values))
    except OSError as err:
        shutil.rmtree(root, ignore_errors=True)  # it did not exist before: leave nothing half-written
        reason = err.strerror or str(err)
        raise ValueError(
            f"cannot write the plugin under {directory} ({reason}); pass --dir a writable folder"
        ) from None
    return root
