"""`streambp-bench plot`: PNG figures from results CSVs alone (nothing is measured)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape

from streambp_bench.errors import user_errors
from streambp_bench.specs import writable_folder
from streambp_core.config import ConfigError, check_budget_gib

if TYPE_CHECKING:
    import pandas as pd


class Kind(str, Enum):
    """Which figures to draw; auto draws every kind the rows' `metric` column has data for."""

    auto = "auto"
    memory = "memory"
    time = "time"
    ablation = "ablation"
    maxlen = "maxlen"


class PlotInputError(ConfigError):
    """A CSV argument that cannot be plotted (missing, unreadable, empty, another schema, no such data)."""


def read_results(paths: list[Path]) -> pd.DataFrame:
    """The rows of every CSV, concatenated; PlotInputError when a file is missing, empty or foreign."""
    import pandas as pd

    from streambp_bench.results import ResultsFile

    frames = []
    for path in paths:
        frame = ResultsFile(path).load()  # SchemaError, OSError: one line from `user_errors`
        if frame.empty:
            raise PlotInputError(f"{path} has a header but no rows")
        frames.append(frame)
    return pd.concat(frames, ignore_index=True)


def undrawn_note(df: pd.DataFrame) -> str | None:
    """A line saying how many ok rows were not drawn because their value is not a finite number (inf,
    nan or empty: no point to place), and which; None when every ok row has one."""
    import numpy as np

    values = df["value"].astype(float)
    bad = df[(df["status"] == "ok") & ~np.isfinite(values)]
    if bad.empty:
        return None
    where = ", ".join(f"{r.method} {r.model} {r.metric} T={int(r.seq_len_tokens):,} value {r.value}"
                      for r in bad.head(3).itertuples())
    more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
    rows = f"{len(bad)} ok row{'s' if len(bad) != 1 else ''}"
    return f"not drawn: {rows} without a finite value ({where}{more})"


def choose_kinds(df: pd.DataFrame, kind: Kind) -> list[str]:
    """The figure kinds to draw: all available ones for auto, else `kind` if the rows support it."""
    from streambp_bench.paper import plots

    available = plots.available_kinds(df)
    metrics = ", ".join(sorted(set(df["metric"]))) or "none"
    if kind is Kind.auto:
        if not available:
            raise PlotInputError(
                f"nothing to plot: no ok/oom rows of a plottable metric (metrics: {metrics})"
            )
        return available
    if kind.value not in available:
        hint = "rows of one method at several partition sizes" if kind is Kind.ablation else "matching rows"
        raise PlotInputError(f"no data for --kind {kind.value}: it needs {hint} (metrics: {metrics})")
    return [kind.value]


def paper_reference(df: pd.DataFrame) -> pd.DataFrame | None:
    """The paper's published max lengths for the max_len rows of `df` that are the paper's cells (same
    model, LoRA rank, objective, optimizer, budget, no offload), or None when no row is one."""
    import pandas as pd

    from streambp_bench.paper import published

    columns = ["model", "lora_rank", "objective", "optimizer", "budget_gib", "offload", "method"]
    published = pd.DataFrame(published.max_len_records())
    ours = df.loc[(df["metric"] == "max_len") & (df["status"] == "ok"), columns].drop_duplicates()
    ours = ours.astype({"lora_rank": "float64"})
    matched = published.astype({"lora_rank": "float64"}).merge(ours, on=columns)
    return None if matched.empty else published


def figure_paths(out: Path | None, kinds: list[str], name: str) -> list[Path]:
    """Where each kind's PNG goes: `<out>/<name>-<kind>.png` (out: a folder, default the current one),
    or `out` itself when it names a .png file and one figure is drawn; checked before drawing."""
    if name != Path(name).name or name in (".", ".."):
        raise ConfigError(f"--name {name!r} must be a file-name prefix, not a path (--out names the folder)")
    if out is not None and out.suffix.lower() == ".png":
        if len(kinds) != 1:
            raise ConfigError(
                f"--out {out} names one PNG, but {len(kinds)} figures would be drawn ({', '.join(kinds)}): "
                "pick one with --kind, or give a folder"
            )
        writable_folder(out.parent)
        if out.is_dir():
            raise ConfigError(f"--out {out} is a folder; give a .png file name or a folder")
        return [out]
    folder = writable_folder(out if out is not None else Path("."))
    return [folder / f"{name}-{kind}.png" for kind in kinds]


def write_figures(
    df: pd.DataFrame, kinds: list[str], paths: list[Path], budget_gib: float | None
) -> list[Path]:
    """Draw each kind and save it at its path; return the paths written (existing files are replaced)."""
    from streambp_bench.paper import plots

    reference = paper_reference(df) if "maxlen" in kinds else None
    return [
        plots.save(plots.make_figure(kind, df, budget_gib=budget_gib, paper=reference), path)
        for kind, path in zip(kinds, paths, strict=True)
    ]


@user_errors
def plot(
    csv: Annotated[
        list[Path],
        typer.Argument(
            metavar="CSV",
            help="Results CSVs (from sweep, max-len, reproduce); their rows are concatenated.",
        ),
    ],
    out: Annotated[
        Path | None,
        typer.Option(
            "--out", "-o",
            help="Folder for the PNGs (default: the current folder), or a .png file for one figure.",
        ),
    ] = None,
    kind: Annotated[
        Kind, typer.Option("--kind", help="Figure to draw; auto: every one the data has.")
    ] = Kind.auto,
    name: Annotated[
        str | None, typer.Option("--name", help="File-name prefix (default: the CSV's stem, or 'combined').")
    ] = None,
    budget_gib: Annotated[
        float | None,
        typer.Option(
            "--budget-gib", help="Budget line of the memory figure (default: the rows' budget_gib)."
        ),
    ] = None,
) -> None:
    """Draw PNG figures from results CSVs alone: nothing is measured, so figures can be redrawn any time.

    Kinds, picked by the rows' [bold]metric[/] column (each title says simulated / measured-cuda / -cpu):
    [bold]memory[/]    peak GiB vs length per method, budget and weights+grads lines, x = OOM
    [bold]time[/]      step time vs length per method
    [bold]ablation[/]  memory and time vs length, one line per partition size
    [bold]maxlen[/]    maximum trainable length, bars per model and method

    Files are written as <out>/<name>-<kind>.png (an existing PNG of that name is replaced) and listed;
    nothing is written next to the CSVs unless --out says so. A max-length figure of the paper's cells
    (Fig. 3, Table 3: same model, LoRA rank, objective, optimizer, 80 GiB) shows the paper's values as
    hatched bars, as [bold]reproduce[/] draws it.

    [bold]Examples[/]

    [cyan]streambp-bench plot results/fig3.csv[/]  (every figure its rows support, in the current folder)

    [cyan]streambp-bench plot results/sim.csv results/gpu/measured.csv --out results/figures[/]

    [cyan]streambp-bench plot results/fig5.csv --kind ablation --out ablation.png[/]

    [cyan]streambp-bench plot results/fig3.csv --kind memory --budget-gib 40 --name fig3-40g[/]
    """
    check_budget_gib(budget_gib)
    df = read_results(csv)
    kinds = choose_kinds(df, kind)
    stem = name or (csv[0].stem if len(csv) == 1 else "combined")
    written = write_figures(df, kinds, figure_paths(out, kinds, stem), budget_gib)
    console = Console(highlight=False)
    console.print(f"wrote {len(written)} figure{'s' if len(written) != 1 else ''}:")
    for path in written:
        console.print(f"  {escape(str(path))}", soft_wrap=True)
    if (note := undrawn_note(df)) is not None:
        console.print(escape(note), soft_wrap=True)
