"""The package layering, checked on the import graph of the sources (parsed with ``ast``, nothing imported).

Every ``import`` / ``from ... import`` counts, also inside functions and ``if TYPE_CHECKING:`` blocks;
only the cycle check leaves the type-only ones out (they are the usual way to break a runtime cycle).
Relative imports are resolved to absolute ``flowrl.*`` names; the top-level folders ``samplers/``,
``rewards/`` and ``kernels/`` are ``flowrl.samplers``, ``flowrl.rewards`` and ``flowrl.kernels`` (the
pyproject package-dir mapping). A "subpackage" is the first level under ``flowrl``: ``flowrl.models``
(with everything below it), or a top-level module such as ``flowrl.trainer``.

The layers, bottom up::

    flowrl.samplers   pure step functions (torch only)
    flowrl.kernels    fused versions of samplers (may import flowrl.samplers)
    flowrl.rewards    a standalone reward library (may import the root package: version, asset path)
    flowrl.models     adapters (must not import the training side)
    flowrl.objectives losses (must not import the trainer, the recipe or the CLI)
    ...               trainer, recipe; flowrl.cli on top, imported by flowrl.__main__ only
"""

from __future__ import annotations

import ast
from collections import defaultdict
from functools import lru_cache
from pathlib import Path
from typing import NamedTuple

import pytest
import tomllib

ROOT = Path(__file__).resolve().parents[1]
# source folder -> the import name it installs as (pyproject [tool.setuptools] package-dir)
SOURCES = {"flowrl": "flowrl", "samplers": "flowrl.samplers", "rewards": "flowrl.rewards", "kernels": "flowrl.kernels"}

# Subpackage cycles that exist today, each with its edges. The test fails on any other cycle, and
# on a listed cycle that no longer exists (then delete it here, so it cannot come back).
#   flowrl.models -> flowrl.prompts: models/digits/prompts.py builds flowrl.prompts.files.Prompt;
#       models/digits/report.py types its sampler with Prompt
#   flowrl.prompts -> flowrl.models: prompts/sets.py serves the digits sets (models/digits/prompts.py);
#       prompts/cache.py types and calls flowrl.models.adapter (Cond, ModelAdapter)
KNOWN_CYCLES: list[frozenset[str]] = [frozenset({"flowrl.models", "flowrl.prompts"})]


class Module(NamedTuple):
    """A source file and the module name it installs as."""

    name: str
    path: Path
    is_package: bool


class Edge(NamedTuple):
    """One imported flowrl module (or name) of one import statement."""

    source: str  # importing module
    target: str  # imported module: the submodule when ``from pkg import submodule``
    name: str | None  # the imported attribute for ``from module import name``, else None
    path: Path
    line: int
    statement: str
    type_only: bool  # inside ``if TYPE_CHECKING:``

    def where(self) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line}: {self.statement}"


def subpackage(module: str) -> str:
    """``flowrl.models.digits.report`` -> ``flowrl.models``; the root package stays ``flowrl``."""
    return ".".join(module.split(".")[:2])


@lru_cache(maxsize=1)
def modules() -> dict[str, Module]:
    """Every .py file of the four source folders, by installed module name."""
    out = {}
    for folder, package in SOURCES.items():
        for path in sorted((ROOT / folder).rglob("*.py")):
            parts = list(path.relative_to(ROOT / folder).with_suffix("").parts)
            is_package = parts[-1] == "__init__"
            name = ".".join([package, *(parts[:-1] if is_package else parts)])
            out[name] = Module(name, path, is_package)
    return out


def _resolve_from(module: Module, node: ast.ImportFrom) -> str:
    """Absolute module name of ``from <node.module> import ...`` (relative or not)."""
    if not node.level:
        return node.module or ""
    package = module.name.split(".") if module.is_package else module.name.split(".")[:-1]
    if node.level - 1 >= len(package):
        where = f"{module.path.relative_to(ROOT)}:{node.lineno}"
        raise ValueError(f"{where}: relative import goes above the flowrl package")
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _type_checking_nodes(tree: ast.AST) -> set[int]:
    """ids of the nodes inside ``if TYPE_CHECKING:`` / ``if typing.TYPE_CHECKING:`` bodies."""
    inside: set[int] = set()
    for node in ast.walk(tree):
        test = node.test if isinstance(node, ast.If) else None
        name = test.id if isinstance(test, ast.Name) else test.attr if isinstance(test, ast.Attribute) else None
        if name == "TYPE_CHECKING":
            inside.update(id(child) for stmt in node.body for child in ast.walk(stmt))
    return inside


def _module_edges(module: Module) -> list[Edge]:
    known = modules()
    tree = ast.parse(module.path.read_text(encoding="utf-8"), str(module.path))
    type_only = _type_checking_nodes(tree)
    edges = []
    for node in ast.walk(tree):
        if not isinstance(node, (ast.Import, ast.ImportFrom)):
            continue
        here = (module.path, node.lineno, ast.unparse(node), id(node) in type_only)
        if isinstance(node, ast.Import):
            edges += [Edge(module.name, alias.name, None, *here) for alias in node.names]
            continue
        base = _resolve_from(module, node)
        for alias in node.names:
            sub = f"{base}.{alias.name}"
            target, name = (sub, None) if sub in known else (base, alias.name)
            edges.append(Edge(module.name, target, name, *here))
    return edges


@lru_cache(maxsize=1)
def all_edges() -> tuple[Edge, ...]:
    """Every import edge of the sources (flowrl and third-party alike)."""
    return tuple(edge for module in modules().values() for edge in _module_edges(module))


def flowrl_edges() -> list[Edge]:
    """Edges whose target is flowrl (the root package or anything below it)."""
    return [e for e in all_edges() if e.target == "flowrl" or e.target.startswith("flowrl.")]


def _within(module: str, packages: tuple[str, ...]) -> bool:
    return any(module == p or module.startswith(p + ".") for p in packages)


def no_offenders(bad: list[Edge], rule: str) -> None:
    """Fail with the rule and one ``file:line: statement`` line per offending import."""
    if bad:
        pytest.fail(f"{rule}:\n  " + "\n  ".join(dict.fromkeys(e.where() for e in bad)), pytrace=False)


# -- sanity of the scan -----------------------------------------------------------------------------


def test_scan_finds_the_packages():
    names = set(modules())
    expected = {"flowrl", "flowrl.trainer", "flowrl.samplers.flow_sde", "flowrl.rewards.registry", "flowrl.kernels"}
    assert expected <= names
    assert any(e.source == "flowrl.trainer" and e.target == "flowrl.advantages.group" for e in flowrl_edges())


def test_every_flowrl_import_resolves_to_a_module():
    known = modules()
    bad = [e for e in flowrl_edges() if e.target not in known]
    no_offenders(bad, "imports of flowrl modules that do not exist (stale after a move?)")


def test_no_import_of_the_source_folders_by_their_folder_name():
    # `samplers`, `rewards` and `kernels` are installed only as flowrl.samplers, ...; a bare `kernels` is HF's package
    bad = [e for e in all_edges() if e.target.split(".")[0] in ("samplers", "rewards", "kernels")]
    no_offenders(bad, "import these as flowrl.samplers / flowrl.rewards / flowrl.kernels (or relatively)")


# -- layering rules ---------------------------------------------------------------------------------

# (importer, allowed flowrl packages or None, forbidden flowrl packages, why)
RULES = [
    ("flowrl.samplers", ("flowrl.samplers",), (), "samplers are pure functions on torch tensors"),
    ("flowrl.kernels", ("flowrl.kernels", "flowrl.samplers"), (), "kernels only replace sampler math"),
    (
        "flowrl.rewards",
        ("flowrl.rewards",),
        (),
        "rewards are a standalone library (besides the root package `flowrl`, for __version__ and the asset path)",
    ),
    (
        "flowrl.models",
        None,
        ("flowrl.trainer", "flowrl.recipe", "flowrl.objectives", "flowrl.rollouts", "flowrl.tree", "flowrl.cli"),
        "model adapters must not depend on the training side",
    ),
    (
        "flowrl.objectives",
        None,
        ("flowrl.trainer", "flowrl.recipe", "flowrl.cli"),
        "objectives are driven by the trainer, not the other way round",
    ),
]


@pytest.mark.parametrize("importer, allowed, forbidden, why", RULES, ids=[r[0] for r in RULES])
def test_layering(importer, allowed, forbidden, why):
    edges = [e for e in flowrl_edges() if _within(e.source, (importer,))]
    if allowed is not None:
        root_ok = importer == "flowrl.rewards"
        bad = [e for e in edges if not _within(e.target, allowed) and not (root_ok and e.target == "flowrl")]
    else:
        bad = [e for e in edges if _within(e.target, forbidden)]
    no_offenders(bad, f"{importer}: {why}; these imports break it")


def test_root_package_imports_no_flowrl_modules():
    # the root package is allowed above because flowrl/__init__.py imports nothing; keep it that way
    root = modules()["flowrl"]
    imported = [e for e in _module_edges(root) if e.target == "flowrl" or e.target.startswith("flowrl.")]
    no_offenders(imported, "flowrl/__init__.py must not import flowrl modules (flowrl.rewards relies on it)")


def test_only_main_imports_the_cli():
    allowed = ("flowrl.cli", "flowrl.__main__")
    bad = [e for e in flowrl_edges() if _within(e.target, ("flowrl.cli",)) and e.source not in allowed]
    no_offenders(bad, "flowrl.cli is the top layer; only flowrl.__main__ may import it")


def _private(part: str) -> bool:
    return part.startswith("_") and not (part.startswith("__") and part.endswith("__"))


def test_no_private_names_across_subpackages():
    bad = [
        e
        for e in flowrl_edges()
        if subpackage(e.source) != subpackage(e.target)
        and (any(_private(p) for p in e.target.split(".")) or (e.name is not None and _private(e.name)))
    ]
    no_offenders(bad, "private modules or names used from another subpackage; make them public there")


# -- cycles between subpackages -------------------------------------------------------------------


def subpackage_graph() -> dict[str, dict[str, list[Edge]]]:
    """subpackage -> imported subpackage -> the runtime import edges behind it (no self-edges)."""
    graph: dict[str, dict[str, list[Edge]]] = defaultdict(lambda: defaultdict(list))
    for e in flowrl_edges():
        src, dst = subpackage(e.source), subpackage(e.target)
        if src != dst and not e.type_only:
            graph[src][dst].append(e)
    return graph


def strongly_connected(graph: dict[str, dict[str, list[Edge]]]) -> list[frozenset[str]]:
    """Tarjan's strongly connected components with more than one node."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    out: list[frozenset[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in graph.get(node, {}):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            component = set()
            while True:
                member = stack.pop()
                component.add(member)
                if member == node:
                    break
            if len(component) > 1:
                out.append(frozenset(component))

    for node in list(graph):
        if node not in index:
            visit(node)
    return out


def shortest_cycle(component: frozenset[str], graph: dict[str, dict[str, list[Edge]]]) -> list[str]:
    """A shortest cycle through the component, as ``[a, b, ..., a]`` (BFS from each member)."""
    best: list[str] = []
    for start in sorted(component):
        parents: dict[str, str] = {}
        frontier = [start]
        while frontier and start not in parents:
            nxt = []
            for node in frontier:
                for dst in sorted(set(graph.get(node, {})) & component):
                    if dst not in parents:
                        parents[dst] = node
                        nxt.append(dst)
            frontier = nxt
        path = [start]
        while path[-1] != start or len(path) == 1:
            path.append(parents[path[-1]])
        path.reverse()
        if not best or len(path) < len(best):
            best = path
    return best


def describe_cycle(component: frozenset[str], graph: dict[str, dict[str, list[Edge]]]) -> str:
    """``a -> b -> a`` and, under each hop, the import statements behind it."""
    cycle = shortest_cycle(component, graph)
    lines = [" -> ".join(cycle) + f" (strongly connected: {', '.join(sorted(component))})"]
    for src, dst in zip(cycle, cycle[1:]):
        lines.append(f"  {src} -> {dst}:")
        lines += [f"      {where}" for where in dict.fromkeys(e.where() for e in graph[src][dst])]
    return "\n  ".join(lines)


def test_no_new_cycles_between_subpackages():
    graph = subpackage_graph()
    new = [c for c in strongly_connected(graph) if not any(c <= known for known in KNOWN_CYCLES)]
    if new:
        cycles = "\n  ".join(describe_cycle(c, graph) for c in new)
        pytest.fail(f"import cycles between subpackages (break one edge):\n  {cycles}", pytrace=False)


def test_known_cycles_still_exist():
    found = strongly_connected(subpackage_graph())
    gone = [sorted(known) for known in KNOWN_CYCLES if not any(known <= c for c in found)]
    assert not gone, f"cycles {gone} are gone; delete them from KNOWN_CYCLES in tests/test_layout.py"


# -- packaging ------------------------------------------------------------------------------------


def _setuptools() -> dict:
    return tomllib.loads((ROOT / "pyproject.toml").read_text(encoding="utf-8"))["tool"]["setuptools"]


def package_folders() -> dict[str, Path]:
    """Installed package name -> folder, for every folder with an __init__.py."""
    out = {}
    for folder, package in SOURCES.items():
        for init in sorted((ROOT / folder).rglob("__init__.py")):
            parts = init.parent.relative_to(ROOT / folder).parts
            out[".".join([package, *parts])] = init.parent
    return out


def test_every_package_is_in_the_wheel():
    setuptools = _setuptools()
    listed = set(setuptools["packages"])
    missing = sorted(set(package_folders()) - listed)
    assert not missing, f"pyproject.toml [tool.setuptools] packages lacks {missing}; the wheel would leave them out"
    stale = sorted(listed - set(package_folders()))
    assert not stale, f"pyproject.toml [tool.setuptools] packages lists {stale}: no folder with an __init__.py"
    mapped = {name: folder for name, folder in setuptools["package-dir"].items() if name != ""}
    expected = {package: folder for folder, package in SOURCES.items()}
    assert mapped == expected, f"pyproject.toml package-dir is {mapped}; SOURCES here expects {expected}"


def test_every_source_folder_is_a_package():
    # a folder of .py files without __init__.py would be a namespace package, silently left out of the wheel
    folders = {path.parent for folder in SOURCES for path in (ROOT / folder).rglob("*.py")}
    bad = sorted(str(f.relative_to(ROOT)) for f in folders if not (f / "__init__.py").is_file())
    assert not bad, f"folders with .py files but no __init__.py: {bad}"


def test_test_module_basenames_are_unique():
    """pytest imports test files by basename (no __init__.py): two test_x.py in different folders collide."""
    seen: dict[str, Path] = {}
    for path in sorted((ROOT / "tests").rglob("test_*.py")):
        if path.name in seen:
            other = seen[path.name].relative_to(ROOT)
            pytest.fail(f"{path.relative_to(ROOT)} and {other} share a basename; rename one")
        seen[path.name] = path


def launches_without_a_free_port(source: str) -> list[int]:
    """Lines of ``source`` that build an ``accelerate launch`` command they run without ``--main_process_port``.

    A run command names the executable through a variable (``ACCELERATE``, ``accelerate``, ``str(accelerate)``);
    the literal string ``"accelerate"`` is only parsed (tests/scale/test_geometry.py), never run. A run command
    must pass ``--main_process_port`` (``*FREE_PORT``, tests/scale/test_launch.py): on accelerate's default 29500,
    two launches at once (two pytest-xdist workers, two suites on one host) refuse each other.
    """
    bad = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.List) or len(node.elts) < 2:
            continue
        head, verb = node.elts[:2]
        if not (isinstance(verb, ast.Constant) and verb.value == "launch") or isinstance(head, ast.Constant):
            continue
        port = any(isinstance(e, ast.Constant) and e.value == "--main_process_port" for e in node.elts) or any(
            isinstance(e, ast.Starred) and isinstance(e.value, ast.Name) and e.value.id == "FREE_PORT"
            for e in node.elts
        )
        if not port:
            bad.append(node.lineno)
    return bad


def test_launches_without_a_free_port_are_found():
    source = 'a = [ACCELERATE, "launch", "-m", "flowrl"]\nb = [str(x), "launch", "--main_process_port", "0"]\n'
    source += 'c = [ACCELERATE, "launch", *FREE_PORT]\nd = ["accelerate", "launch", "--cpu"]\ne = [x, "launch", y]\n'
    assert launches_without_a_free_port(source) == [1, 5]


def test_every_accelerate_launch_the_tests_and_benches_run_takes_a_free_port():
    files = sorted([*(ROOT / "tests").rglob("*.py"), *(ROOT / "bench").glob("*.py")])
    bad = [f"{f.relative_to(ROOT)}:{n}" for f in files for n in launches_without_a_free_port(f.read_text())]
    assert not bad, f"accelerate launch without --main_process_port 0 (FREE_PORT in tests/scale/test_launch.py): {bad}"
