"""The architecture as a checked contract: the import-linter contracts in pyproject.toml (the core's floors,
the bench above the core, no CLI, table or plotting library in the core) and no import cycle between the
files or between the rooms of either package (the core, the bench). Every import counts, those inside
functions too."""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

import grimp
import pytest
from importlinter.cli import lint_imports

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = ROOT / "pyproject.toml"
CORE = "streambp_core"
BENCH = "streambp_bench"


@pytest.fixture(scope="module")
def graph() -> grimp.ImportGraph:
    """The core's import graph, function-level imports included (grimp reads every import statement)."""
    return grimp.build_graph(CORE, cache_dir=None)


def test_the_import_contracts_are_kept() -> None:
    """`lint-imports` passes: on failure the captured output names each broken contract and import."""
    assert lint_imports(config_filename=str(PYPROJECT), no_cache=True) == 0


def test_the_contracts_count_every_import() -> None:
    """No contract ignores an import, and imports under TYPE_CHECKING are not left out."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    settings = tomllib.loads(PYPROJECT.read_text())["tool"]["importlinter"]
    assert not settings.get("exclude_type_checking_imports", False)
    contracts = settings["contracts"]
    assert {c["type"] for c in contracts} == {"layers", "forbidden"}
    assert not any(c.get("ignore_imports") for c in contracts)
    floors = next(c for c in contracts if c.get("containers") == [CORE])
    assert floors["exhaustive"] and floors["layers"][-5].startswith("config")
    assert floors["layers"][-4] == "stream_config"  # a step's engine settings, which StepSpec holds
    # the checks of what a user names (presets, budgets) and the rules the settings are checked by
    assert floors["layers"][-3] == "inputs | rules"
    # above the bottom: the offload tiers' rules, which config validates with, the precision rule, the
    # user-input error and the settings' choices
    assert floors["layers"][-2] == "tiers | dtypes | errors | choices"
    # under it, the methods by name (what each partitions, streams, accepts, costs), which the tier rules,
    # the choices and the step's validation ask
    assert floors["layers"][-1] == "registry"


def test_the_method_choice_names_the_registry_s_methods() -> None:
    from typing import get_args

    from streambp_core.choices import Method
    from streambp_core.registry import METHODS

    assert get_args(Method) == METHODS


def test_a_function_level_import_is_in_the_graph(graph: grimp.ImportGraph) -> None:
    """The graph sees imports placed inside functions: `parallel.memory` imports `step.search.probe`."""
    probe = f"{CORE}.step.search.probe"
    assert graph.direct_import_exists(importer=f"{CORE}.parallel.memory", imported=probe)
    lines = [d["line_contents"] for d in graph.get_import_details(
        importer=f"{CORE}.parallel.memory", imported=f"{CORE}.step.search.probe")]
    assert any(line.startswith("from") for line in lines)


@pytest.fixture(scope="module", params=[CORE, BENCH])
def house(request: pytest.FixtureRequest) -> tuple[str, grimp.ImportGraph]:
    """Each package of the house (the core, the bench) with its import graph."""
    return request.param, grimp.build_graph(request.param, cache_dir=None)


def direct_imports(graph: grimp.ImportGraph, package: str = CORE) -> list[tuple[str, str]]:
    """Every (importer, imported) pair of modules inside `package`."""
    return sorted((module, imported) for module in graph.modules
                  for imported in graph.find_modules_directly_imported_by(module)
                  if imported == package or imported.startswith(package + "."))


def test_no_import_cycle_between_files(house: tuple[str, grimp.ImportGraph]) -> None:
    """No file of the core or the bench reaches itself through its imports (a cycle is an import a -> b
    with a chain b -> ... -> a)."""
    package, graph = house
    cycles = []
    for importer, imported in direct_imports(graph, package):
        back = graph.find_shortest_chain(importer=imported, imported=importer)
        if back is not None:
            cycles.append(" -> ".join((importer, *back)))
    assert not cycles, "import cycles between files:\n" + "\n".join(cycles)


def room(module: str) -> str:
    """The room a module lives in: its package's top-level subpackage or module (the package itself:
    the package)."""
    parts = module.split(".")
    return ".".join(parts[:2])


def test_no_import_cycle_between_rooms(house: tuple[str, grimp.ImportGraph]) -> None:
    """The rooms (the core's config, models, measure, engine, methods, step, ...; the bench's commands,
    maxlen, results, paper, selfcheck, ...) import one another without a cycle."""
    package, graph = house
    edges: dict[str, set[str]] = defaultdict(set)
    for importer, imported in direct_imports(graph, package):
        if room(importer) != room(imported):
            edges[room(importer)].add(room(imported))
    cycles = [f"{a} -> {b} -> ... -> {a}" for a in sorted(edges) for b in sorted(edges[a])
              if reaches(edges, b, a)]
    assert not cycles, "import cycles between rooms:\n" + "\n".join(cycles)
    assert len({room(module) for module in graph.modules if module.startswith(package)}) >= 10


def reaches(edges: dict[str, set[str]], start: str, goal: str) -> bool:
    """Whether `goal` is reachable from `start` along `edges`."""
    seen, todo = set(), [start]
    while todo:
        node = todo.pop()
        if node == goal:
            return True
        if node not in seen:
            seen.add(node)
            todo.extend(edges.get(node, ()))
    return False
