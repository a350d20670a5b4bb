"""Names transformers accepts in a config (activations, RoPE types), read from its source files without
importing it, so a config naming another is refused before torch is imported.

The names are the keys of a dict literal (`ACT2CLS` in `transformers/activations.py`,
`ROPE_INIT_FUNCTIONS` in `transformers/modeling_rope_utils.py`). When a transformers release spells them
otherwise the answer is None, and the check is left to the config's full load, which imports them.
"""

from __future__ import annotations

import ast
import importlib.util
from functools import cache
from pathlib import Path

ACTIVATIONS = ("activations.py", "ACT2CLS")
ROPE_TYPES = ("modeling_rope_utils.py", "ROPE_INIT_FUNCTIONS")


@cache
def transformers_names(source: tuple[str, str]) -> frozenset[str] | None:
    """The string keys of the dict literal `source[1]` in transformers' file `source[0]`; None when the
    file or a dict literal of that name is not there (transformers is not imported)."""
    spec = importlib.util.find_spec("transformers")
    if spec is None or spec.origin is None:
        return None
    file, variable = source
    try:
        tree = ast.parse((Path(spec.origin).parent / file).read_text(encoding="utf-8"))
    except (OSError, SyntaxError, UnicodeDecodeError):
        return None
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else (
            node.targets[0] if isinstance(node, ast.Assign) and len(node.targets) == 1 else None)
        if isinstance(target, ast.Name) and target.id == variable and isinstance(node.value, ast.Dict):
            keys = [key.value for key in node.value.keys if isinstance(key, ast.Constant)]
            return frozenset(key for key in keys if isinstance(key, str)) or None
    return None


def rope_types(values: dict | object) -> list[object]:
    """The `rope_type` (or older `type`) entries of a config's RoPE tables: `rope_parameters` or
    `rope_scaling`, a table or one table per layer type (Gemma 3)."""
    get = values.get if isinstance(values, dict) else (lambda name: getattr(values, name, None))
    found = []
    for name in ("rope_parameters", "rope_scaling"):
        table = get(name)
        if not isinstance(table, dict):
            continue
        tables = [inner for inner in table.values() if isinstance(inner, dict)] or [table]
        found += [inner.get("rope_type", inner.get("type")) for inner in tables
                  if inner.get("rope_type", inner.get("type")) is not None]
    return found
