"""User-facing documents cite only files that ship with the repository."""

from __future__ import annotations

import re
from pathlib import Path

from streambp_bench.paper import readme

REPO = Path(__file__).resolve().parents[2]


def _cited_markdown(text: str) -> set[str]:
    return set(re.findall(r"\b([\w./-]+\.md)\b", text))


def test_readmes_cite_only_markdown_files_in_the_repository():
    shipped = {path.name for path in REPO.rglob("*.md") if ".git" not in path.parts}
    texts = {
        "README.md": (REPO / "README.md").read_text(),
        "results/README.md": (REPO / "results" / "README.md").read_text(),
        "readme.render": readme.render(REPO / "results"),
    }
    texts.update({f"docs/{page.name}": page.read_text() for page in (REPO / "docs").glob("*.md")})
    for where, text in texts.items():
        missing = {name for name in _cited_markdown(text) if Path(name).name not in shipped}
        assert not missing, f"{where} cites {sorted(missing)}, which the repository does not have"


PACKAGES = ("streambp_core", "streambp_bench")
NOT_MODULES = frozenset({
    # attributes of objects the text names, not modules of the project: a DeepSpeed engine's, a
    # transformers config's, a Tiers value's, a model output's
    "engine.module", "engine.step", "engine.backward", "engine.coalesce_grad_reduction",
    "config.layer_types", "config.model_type", "config.offload.optimizer", "tiers.optimizer",
    "output.loss.backward",
})
"""Backticked names that start like a module of the project but name another object's attribute."""
_DOTTED = re.compile(r"`([A-Za-z_]\w*(?:\.[A-Za-z_]\w*)+)(?:\(\))?`")
_FILE_NAME = re.compile(r"\.(py|json|csv|md|png|toml|yaml|yml|sh|txt)$")


def _top_names() -> dict[str, list[str]]:
    """Each first-level module or package name of the two packages -> the packages that hold it."""
    tops: dict[str, list[str]] = {}
    for package in PACKAGES:
        for path in sorted((REPO / package).iterdir()):
            if path.suffix == ".py" and path.stem != "__init__" or (path / "__init__.py").exists():
                tops.setdefault(path.stem, []).append(package)
    return tops


def _resolves(dotted: str, tops: dict[str, list[str]]) -> bool:
    """Whether `dotted` (absolute, or relative to either package) is a module, or a module's attribute."""
    import importlib

    parts = dotted.split(".")
    candidates = [parts] if parts[0] in PACKAGES else [[package, *parts] for package in tops[parts[0]]]
    for candidate in candidates:
        for cut in range(len(candidate), 0, -1):
            try:
                found = importlib.import_module(".".join(candidate[:cut]))
            except ModuleNotFoundError:
                continue
            for attribute in candidate[cut:]:
                # a field a class declares (a ClassVar or dataclass annotation) exists without a value
                declared = attribute in getattr(found, "__annotations__", {})
                found = getattr(found, attribute, attribute if declared else None)
            if found is not None:
                return True
            break
    return False


def _texts() -> dict[str, str]:
    """Every docstring and string statement of the two packages, and every document, by where it is."""
    import ast

    texts = {str(page.relative_to(REPO)): page.read_text()
             for page in [REPO / "README.md", *sorted((REPO / "docs").glob("*.md"))]}
    for package in PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            strings = [node.value.value for node in ast.walk(ast.parse(path.read_text()))
                       if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
                       and isinstance(node.value.value, str)]
            texts[str(path.relative_to(REPO))] = "\n".join(strings)
    return texts


def test_every_backticked_module_name_resolves():
    """A docstring or document that names a module of the project (`engine.host.checkpoints`,
    `streambp_core.step.estimate.roofline.GpuModel`) names one that exists: moved modules leave no stale
    names."""
    tops = _top_names()
    stale = sorted(
        f"{where}: `{dotted}`"
        for where, text in _texts().items()
        for dotted in {match.group(1) for match in _DOTTED.finditer(text)}
        if (dotted.split(".")[0] in tops or dotted.split(".")[0] in PACKAGES)
        and dotted not in NOT_MODULES and not _FILE_NAME.search(dotted) and not _resolves(dotted, tops))
    assert not stale, "names of modules that do not exist:\n" + "\n".join(stale)


def test_the_name_check_finds_a_stale_name():
    tops = _top_names()
    assert _resolves("engine.host.checkpoints.HostChain", tops)
    assert _resolves("streambp_core.step.estimate.roofline", tops)
    assert not _resolves("engine.offload.HostChain", tops)
    assert not _resolves("engine.host.checkpoints.NoSuchThing", tops)
