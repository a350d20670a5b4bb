"""`streambp-bench plot`: PNG figures from results CSVs alone (nothing is measured)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Annotated

import typer
from rich.console import Console
from rich.markup import escape

from streambp_bench.errors import user_errors
from streambp_core.config import ConfigError

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


def choose_kinds(df: pd.DataFrame, kind: Kind) -> list[str]:
    """The figure kinds to draw: all available ones for auto, else `kind` if the rows support it."""
    from streambp_bench import plots

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


def write_figures(
    df: pd.DataFrame, kinds: list[str], out_dir: Path, name: str, budget_gib: float | None
) -> list[Path]:
    """Draw and save each kind as `<out_dir>/<name>-<kind>.png`; return the paths written."""
    from streambp_bench import plots

    return [
        plots.save(plots.make_figure(kind, df, budget_gib=budget_gib), out_dir / f"{name}-{kind}.png")
        for kind in kinds
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
        Path | None, typer.Option("--out", "-o", help="Directory for the PNGs (default: the first CSV's).")
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

    Files are written as <out>/<name>-<kind>.png and listed.

    [bold]Examples[/]

    [cyan]streambp-bench plot results/fig3.csv[/]  (every figure its rows support, next to the CSV)

    [cyan]streambp-bench plot results/sim.csv results/gpu/measured.csv --out results/figures[/]

    [cyan]streambp-bench plot results/fig5.csv --kind ablation[/]

    [cyan]streambp-bench plot results/fig3.csv --kind memory --budget-gib 40 --name fig3-40g[/]
    """
    df = read_results(csv)
    kinds = choose_kinds(df, kind)
    out_dir = out if out is not None else csv[0].parent
    stem = name or (csv[0].stem if len(csv) == 1 else "combined")
    written = write_figures(df, kinds, out_dir, stem, budget_gib)
    console = Console(highlight=False)
    console.print(f"wrote {len(written)} figure{'s' if len(written) != 1 else ''}:")
    for path in written:
        console.print(f"  {escape(str(path))}", soft_wrap=True)
