"""Cheap checks of a command's arguments, before any heavy import or work: step specs and output paths.

Everything here imports neither torch nor transformers, so bad input is refused at once.
"""

from __future__ import annotations

import os
from pathlib import Path

from streambp_bench import options as opt
from streambp_core.config import METHODS, ConfigError, StepSpec, check_model


def method_list(methods: str) -> tuple[str, ...]:
    """'all' -> every method; else the comma list, each checked (ConfigError)."""
    chosen = METHODS if methods.strip() == "all" else opt.split_list(methods)
    if not chosen:
        raise ConfigError("give at least one method, or 'all'")
    for method in chosen:
        StepSpec(model="-", method=method)
    return tuple(dict.fromkeys(chosen))


def step_specs(model: str, methods: str, **fields: object) -> tuple[StepSpec, ...]:
    """One validated `StepSpec` per method of `methods` on `model` (checked to exist)."""
    check_model(model)
    return tuple(StepSpec(model=model, method=method, **fields) for method in method_list(methods))


def writable_results(out: Path | None) -> Path | None:
    """`out` after checking, before any work, that results can be written there: not a directory, its
    folder writable, and an existing file a results CSV of this schema (SchemaError otherwise)."""
    if out is None:
        return None
    if out.is_dir():
        raise ConfigError(f"--out {out} is a directory; give a CSV file path")
    folder = out.parent if str(out.parent) else Path(".")
    existing = next((p for p in (folder, *folder.parents) if p.exists()), Path("."))
    if not os.access(existing, os.W_OK) or (out.exists() and not os.access(out, os.W_OK)):
        raise ConfigError(f"--out {out}: not writable")
    if out.exists():
        from streambp_bench.results import ResultsFile

        ResultsFile(out).rows()
    return out
