"""`reproduce ITEM --check`: do the committed results still hold? Nothing under --out is written.

Two kinds of check, each a `Finding`:

- **Rerun** (the items whose rows are simulated or estimated: fig3, fig5, table3, table4, offload, alst):
  the item runs again into a temporary folder and each of its rows is compared with the committed row of
  the same key (`ResultRow.key`): same status, and the same value within `RTOL` (the simulator is
  deterministic, so any move is a change in the code or its libraries). A committed row the rerun no
  longer produces, or a rerun row the committed file lacks, is a finding too. The measured items
  (table1, table6: CPU or GPU timings and float rounding) are not measured again: their rows are only read.
- **Data**: what the committed numbers claim. Table 4's checkpoint column under DeepSpeed ZeRO-2 within
  ±15 % of the paper at 4-8 GPUs (`table4.checkpoint_agreement`); every GPU self-check file under
  <out>/gpu/ with its gradient rows passed and its simulated peaks within the self-check's tolerance of
  the allocator's (`selfcheck.check.WORKSPACE_TOLERANCE`).
"""

from __future__ import annotations

import math
import tempfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

import pandas as pd

from streambp_bench.results import ResultRow, ResultsFile, SchemaError

RTOL = 1e-6
"""Relative difference below which a rerun value equals the committed one (float formatting only)."""
MEASURED_ITEMS = ("table1", "table6")
"""Items whose rows are measurements: read, not rerun."""


@dataclass(frozen=True)
class Finding:
    """One check's outcome, in a line."""

    item: str
    check: str
    """'rerun' or 'data'."""
    ok: bool
    detail: str


def compare(item: str, committed: Iterable[ResultRow], fresh: Iterable[ResultRow]) -> list[Finding]:
    """Findings of a rerun: each fresh row against the committed row of its key (value within RTOL, same
    status), then the committed simulated or estimated rows the rerun did not produce. One ok finding
    with the count when everything agrees."""
    committed = list(committed)
    old = {row.key(): row for row in committed}
    new = {row.key(): row for row in fresh}
    problems = [f"{_point(row)}: {count} committed rows of one point (a file holds one row per point)"
                for row, count in duplicates(committed)]
    problems += [f"{_point(row)}: a {row.source} row in a simulated item's file (a rerun can neither "
                 "produce nor confirm it)" for row in committed if row.source.startswith("measured")]
    for key, row in new.items():
        before = old.get(key)
        if before is None:
            problems.append(f"{_point(row)}: not in the committed file (rerun gives {_value(row)})")
        elif before.status != row.status or not _close(before.value, row.value):
            problems.append(f"{_point(row)}: committed {_value(before)}, rerun {_value(row)}")
    stale = [row for key, row in old.items()
             if key not in new and row.source in ("simulated", "estimated")]
    problems += [f"{_point(row)}: committed {_value(row)}, no longer produced" for row in stale]
    if problems:
        return [Finding(item, "rerun", False, text) for text in problems]
    return [Finding(item, "rerun", True, f"{len(new)} rows equal to the committed ones")]


def rerun(item: str, out: Path, run: Callable[[Path], list[Path]]) -> list[Finding]:
    """Run the item into a temporary folder with `run(folder)` (the files it writes besides its CSV) and
    `compare` each CSV it wrote with the file of that name under `out`."""
    findings = []
    with tempfile.TemporaryDirectory(prefix=f"streambp-check-{item}-") as folder:
        written = [Path(folder) / f"{item}.csv", *run(Path(folder))]
        for path in dict.fromkeys(p for p in written if p.suffix == ".csv" and p.exists()):
            committed = out / path.name
            if not committed.exists():
                findings.append(Finding(item, "rerun", False, f"{committed} does not exist"))
                continue
            findings += compare(path.stem, ResultsFile(committed).rows(), ResultsFile(path).rows())
    return findings


def measured(item: str, out: Path) -> list[Finding]:
    """A measured item's committed file read (its schema checked), not rerun."""
    path = out / f"{item}.csv"
    if not path.exists():
        return [Finding(item, "rerun", False, f"{path} does not exist")]
    rows = ResultsFile(path).rows()
    problems = [f"{_point(row)}: status {row.status}" for row in rows if row.status != "ok"]
    problems += consistency(rows)
    detail = f"{len(rows)} measured rows read, not measured again (provenance present, one row per point)"
    if problems:
        return [Finding(item, "data", False, text) for text in problems]
    return [Finding(item, "rerun", True, detail)]


PROVENANCE = ("device_name", "torch_version", "transformers_version", "package_version")
"""The provenance a measured row must carry (git_sha may read unknown: an installed package has none)."""


def duplicates(rows: Iterable[ResultRow]) -> list[tuple[ResultRow, int]]:
    """(first row, count) of each point (`ResultRow.key`) more than one row holds: a duplicate before the
    true row would otherwise be read in its place, or beside it."""
    counts: dict[tuple, list[ResultRow]] = {}
    for row in rows:
        counts.setdefault(row.key(), []).append(row)
    return [(same[0], len(same)) for same in counts.values() if len(same) > 1]


def consistency(rows: list[ResultRow]) -> list[str]:
    """What a measured file's rows can be checked for without measuring again: one row per point, and
    each measured row's provenance (`PROVENANCE` present; a measured-cuda row's torch a CUDA build)."""
    problems = [f"{_point(row)}: {count} rows of one point (a file holds one row per point)"
                for row, count in duplicates(rows)]
    for row in (row for row in rows if row.source.startswith("measured")):
        missing = [name for name in PROVENANCE if getattr(row, name) in ("", "unknown")]
        if missing:
            problems.append(f"{_point(row)}: {row.source} row without {', '.join(missing)}")
        elif row.source == "measured-cuda" and row.torch_version.endswith("+cpu"):
            problems.append(f"{_point(row)}: measured-cuda row from a CPU build of torch "
                            f"({row.torch_version})")
    return problems


def data_checks(item: str, out: Path) -> list[Finding]:
    """The claims the committed numbers of `item` carry (module docstring); [] for an item without."""
    if item == "table4" and (out / "table4.csv").exists():
        return [table4_agreement(pd.read_csv(out / "table4.csv"))]
    if item == "table1":
        return [gpu_fit(path) for path in sorted((out / "gpu").glob("selfcheck-*.csv"))]
    return []


def table4_agreement(frame: pd.DataFrame) -> Finding:
    """Table 4's checkpoint cells under DeepSpeed ZeRO-2 within AGREEMENT of the paper at AGREEMENT_GPUS."""
    from streambp_bench.paper.table4 import AGREEMENT, AGREEMENT_GPUS, checkpoint_agreement

    ratios = checkpoint_agreement(frame)
    missing = [gpus for gpus in AGREEMENT_GPUS if gpus not in ratios]
    outside = {gpus: ratios[gpus] for gpus in AGREEMENT_GPUS if gpus in ratios
               and abs(ratios[gpus] - 1) > AGREEMENT}
    text = ", ".join(f"{gpus} GPUs {ratio:.2f}" for gpus, ratio in sorted(ratios.items())
                     if gpus in AGREEMENT_GPUS)
    if missing:
        return Finding("table4", "data", False, f"no checkpoint ZeRO-2 cell at {missing} GPUs")
    if outside:
        return Finding("table4", "data", False, f"checkpoint/paper outside ±{AGREEMENT:.0%}: {text}")
    return Finding("table4", "data", True, f"checkpoint/paper within ±{AGREEMENT:.0%}: {text}")


def gpu_fit(path: Path) -> Finding:
    """A GPU self-check file: its gradient rows passed and each simulated peak within the self-check's
    tolerance of the allocator's peak at the same method and length."""
    from streambp_bench.selfcheck.check import WORKSPACE_TOLERANCE

    name = f"gpu/{path.name}"
    try:
        problems = consistency(ResultsFile(path).rows())
    except SchemaError as error:
        return Finding("gpu", "data", False, f"{name}: {error}")
    if problems:
        return Finding("gpu", "data", False, f"{name}: {'; '.join(problems)}")
    frame = pd.read_csv(path)
    grads = frame[frame.metric == "grad_rel_err"]
    if (grads.status != "ok").any():
        failed = grads[grads.status != "ok"]
        return Finding("gpu", "data", False, f"{name}: gradient rows not ok: {', '.join(failed.method)}")
    memory = frame[(frame.metric == "peak_memory") & (frame.status == "ok")]
    pairs = memory.pivot_table(index=["method", "seq_len_tokens"], columns="source", values="value")
    if not {"simulated", "measured-cuda"} <= set(pairs.columns):
        return Finding("gpu", "data", False, f"{name}: no simulated and measured-cuda peak pairs")
    unpaired = pairs[pairs["simulated"].isna() & pairs["measured-cuda"].notna()]
    if len(unpaired):
        return Finding("gpu", "data", False, f"{name}: measured-cuda peaks without a simulated twin: "
                       + ", ".join(f"{method} T={length:,}" for method, length in unpaired.index))
    ratios = (pairs["simulated"] / pairs["measured-cuda"]).dropna()
    worst = float((ratios - 1).abs().max())
    ok = worst <= WORKSPACE_TOLERANCE
    return Finding("gpu", "data", ok, f"{name}: {len(ratios)} simulated/measured peak pairs, worst "
                   f"{worst:.1%} ({'within' if ok else 'outside'} {WORKSPACE_TOLERANCE:.0%}); "
                   f"{len(grads)} gradient rows ok")


def _close(a: float | None, b: float | None) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    return math.isclose(a, b, rel_tol=RTOL, abs_tol=1e-12)


def _value(row: ResultRow) -> str:
    value = "empty" if row.value is None else f"{row.value:,.6g}"
    return value if row.status == "ok" else f"{value} ({row.status})"


def _point(row: ResultRow) -> str:
    """A row's point in a few words: method, model, objective, length or metric, and what sets it apart."""
    parts = [row.method, row.model, row.objective, row.metric]
    if row.seq_len_tokens:
        parts.append(f"T={row.seq_len_tokens:,}")
    if row.gpus and row.gpus > 1:
        parts.append(f"{row.gpus} GPUs {row.shard}")
    if row.offload and row.offload != "none":
        parts.append(f"offload {row.offload}")
    if row.partition_size:
        parts.append(f"ps={row.partition_size}")
    if row.lora_rank:
        parts.append(f"LoRA r{row.lora_rank}")
    return " ".join(str(part) for part in parts)
