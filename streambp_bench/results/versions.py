"""What produced a results row: how its numbers were obtained (source), on which device, the versions of
torch, transformers and this package and the checkout's git sha ("unknown" where one cannot be found,
read once per process), and when."""

from __future__ import annotations

import functools
import importlib
import subprocess
from datetime import datetime, timezone
from pathlib import Path

from streambp_bench.results.row import SOURCES, require_one_of


@functools.cache
def versions() -> dict[str, str]:
    """torch_version, transformers_version, package_version and git_sha, as results columns."""
    modules = {"torch": "torch", "transformers": "transformers", "package": "streambp_core"}
    found = {f"{key}_version": _module_version(name) for key, name in modules.items()}
    return {**found, "git_sha": _git_sha()}


def _module_version(module_name: str) -> str:
    try:
        return str(importlib.import_module(module_name).__version__)
    except Exception:  # any failure to import means the version is unknown
        return "unknown"


def _git_sha() -> str:
    """Short sha of the checkout this package lives in, or "unknown" (no git, not a checkout)."""
    command = ["git", "rev-parse", "--short", "HEAD"]
    try:
        done = subprocess.run(command, cwd=Path(__file__).parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    return done.stdout.strip() if done.returncode == 0 and done.stdout.strip() else "unknown"


def provenance(source: str, device_name: str) -> dict[str, str]:
    """Provenance columns of a new row: source, device, versions, git sha ("unknown" if unfound), UTC time."""
    require_one_of("source", source, SOURCES)
    timestamp = datetime.now(timezone.utc).isoformat(timespec="seconds")
    return {"source": source, "device_name": device_name, **versions(), "timestamp": timestamp}
