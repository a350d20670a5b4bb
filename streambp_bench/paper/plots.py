"""Figures from results DataFrames (the CSV schema of `streambp_bench.results`); nothing here measures.

Each function takes rows of results CSVs and returns a `Figure` on an Agg canvas (no pyplot state);
`save` writes a PNG. `error` rows are left out; `oom` rows become an x at the first length that ran out
of memory. Every title names the sources of its numbers (simulated / measured-cuda / measured-cpu).
Lengths are in k tokens with k = 1000 (the paper's unit; the axes say so); memory in GiB = 2**30 bytes,
or MiB = 2**20 bytes when every value of a panel is below 1 GiB.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator, Sequence
from pathlib import Path

import pandas as pd
from matplotlib.axes import Axes
from matplotlib.backends.backend_agg import FigureCanvasAgg
from matplotlib.figure import Figure
from matplotlib.lines import Line2D
from matplotlib.patches import Patch

from streambp_core.measure.units import memory_unit

KINDS = ("memory", "time", "ablation", "maxlen")
"""Figure kinds, in the order `available_kinds` lists them."""
METHOD_ORDER = ("plain", "checkpoint", "mst", "streambp")
METHOD_COLORS = {"plain": "tab:red", "checkpoint": "tab:blue", "mst": "tab:green", "streambp": "tab:orange"}
VARIANT_COLUMNS = (
    "source", "objective", "dtype", "lora_rank", "optimizer", "attn", "protocol", "grads", "batch_size",
    "device_name", "offload",
)  # fmt: skip
"""Columns that split a method's rows into separate lines when they vary within the method."""
WITHIN_METHOD_COLUMNS = ("head_mode",)
"""Columns of one method's setting (empty for the others) that split lines and bar groups only when they
vary within a method."""
PARTITION_COLUMNS = ("partition_size", "head_partition_size")
DPI = 150
TOKENS_PER_K = 1000
"""Tokens per `k` on every length axis and bar label (the paper's unit)."""
LENGTH_LABEL = "sequence length (k tokens, k = 1000)"
_PREFIXES = dict(
    partition_size="ps ", head_partition_size="ps-head ", batch_size="batch ", lora_rank="LoRA r",
    attn="attn ", protocol="protocol ", grads="grads ", offload="offload ", head_mode="head ",
)  # fmt: skip


def memory_vs_length(
    df: pd.DataFrame, budget_gib: float | None = None, weights_grads_gib: float | None = None
) -> Figure:
    """Peak memory (GiB, or MiB below 1 GiB) vs sequence length (k tokens), one line per method and one
    panel per model.

    Draws the memory budget (default: the rows' `budget_gib`) and the weights + grads floor (default:
    the median of `weights_gib + grads_gib` over the model's ok rows) as horizontal lines, and an x at
    each method's first out-of-memory length, on the budget line.
    """
    data = _select(df, ("peak_memory",))
    fig, axes = _figure(data["model"].nunique())
    for ax, (model, rows) in zip(axes, data.groupby("model", sort=False), strict=True):
        budget = budget_gib if budget_gib is not None else _first(rows["budget_gib"])
        floor = weights_grads_gib if weights_grads_gib is not None else _weights_grads(rows)
        scale, unit = memory_unit([*rows["value"].dropna(), *(v for v in (budget, floor) if v is not None)])
        _draw_methods(ax, rows, scale=scale, oom_y=None if budget is None else budget * scale)
        if budget is not None:
            ax.axhline(budget * scale, color="black", linestyle="--", linewidth=1.2,
                       label=f"budget {budget * scale:g} {unit}")
        if floor is not None:
            ax.axhline(floor * scale, color="gray", linestyle=":", linewidth=1.5,
                       label=f"weights + grads {floor * scale:.1f} {unit}")
        oom = rows["status"].eq("oom").any()
        _finish(ax, _panel_title(model, rows, data), f"peak memory ({unit})", oom=oom)
    fig.suptitle(f"Peak memory vs sequence length ({_sources(data)})")
    return fig


def time_vs_length(df: pd.DataFrame) -> Figure:
    """Step time (s) vs sequence length (k tokens), one line per method and one panel per model."""
    data = _select(df, ("step_time",))
    fig, axes = _figure(data["model"].nunique())
    for ax, (model, rows) in zip(axes, data.groupby("model", sort=False), strict=True):
        _draw_methods(ax, rows, scale=1e-3)
        _finish(ax, _panel_title(model, rows, data), "step time (s)", oom=rows["status"].eq("oom").any())
    fig.suptitle(f"Step time vs sequence length ({_sources(data)})")
    return fig


def partition_ablation(df: pd.DataFrame) -> Figure:
    """Memory and/or step time vs length, one line per partition size (methods run at several sizes)."""
    data = _ablation_rows(df)
    metrics = [m for m in ("peak_memory", "step_time") if data["metric"].eq(m).any()]
    fig, axes = _figure(len(metrics))
    for ax, metric in zip(axes, metrics, strict=True):
        rows = data[data["metric"] == metric]
        scale, ylabel = (1.0, "peak memory (GiB)") if metric == "peak_memory" else (1e-3, "step time (s)")
        for index, (label, _, series) in enumerate(_series(rows, ("model",), always=PARTITION_COLUMNS[:1])):
            _draw_line(ax, series, label, f"C{index}", scale=scale, oom_y=None)
        _finish(ax, " / ".join(rows["model"].unique()), ylabel, oom=rows["status"].eq("oom").any())
    fig.suptitle(f"Partition-size ablation ({_sources(data)})")
    return fig


def max_length_bars(df: pd.DataFrame, paper: pd.DataFrame | None = None) -> Figure:
    """Maximum trainable length (k tokens): bars grouped by model (and variant), one bar per method.

    `paper`: optional published values, columns `model`, `method`, `value` (tokens) and any of
    `objective`, `lora_rank`, `optimizer` to match on; each is drawn as a hatched bar beside ours.
    """
    data = _select(df, ("max_len",))
    data = data[data["status"] == "ok"]
    groups = list(_groups(data))
    methods = sorted(set(data["method"]), key=lambda method: _order((method,)))
    bars_per_method = 1 if paper is None else 2
    fig, (ax,) = _figure(1, width_in=max(6.5, 0.45 * len(groups) * len(methods) * bars_per_method))
    width = 0.8 / (len(methods) * bars_per_method)
    for g_index, (_, rows) in enumerate(groups):
        for m_index, method in enumerate(methods):
            x = g_index - 0.4 + width * (m_index * bars_per_method + 0.5)
            color = METHOD_COLORS.get(method, f"C{m_index}")
            ours = rows.loc[rows["method"] == method, "value"]
            theirs = _paper_value(paper, rows, method)
            if not ours.empty:
                bar = ax.bar(x, ours.max() / TOKENS_PER_K, width, color=color)
                ax.bar_label(bar, fmt="%.1f", fontsize=7)
            if theirs is not None:
                bar = ax.bar(x + width, theirs / TOKENS_PER_K, width, color=color, alpha=0.35, hatch="//",
                             edgecolor=color)
                ax.bar_label(bar, fmt="%.1f", fontsize=7)
    ax.set_xticks(range(len(groups)), [label for label, _ in groups])
    handles = [Patch(color=METHOD_COLORS.get(m, f"C{i}"), label=m) for i, m in enumerate(methods)]
    if paper is not None:
        handles.append(Patch(facecolor="white", edgecolor="black", hatch="//", label="paper"))
    ax.legend(handles=handles, fontsize=8)
    ax.set(ylabel="max sequence length (k tokens, k = 1000)")
    ax.grid(axis="y", alpha=0.3)
    fig.suptitle(f"Maximum trainable length ({_sources(data)}{'' if paper is None else '; hatched: paper'})")
    return fig


def available_kinds(df: pd.DataFrame) -> list[str]:
    """The figure kinds the rows have data for, in KINDS order."""
    metrics = set(df.loc[df["status"] != "error", "metric"])
    has = {
        "memory": "peak_memory" in metrics,
        "time": "step_time" in metrics,
        "ablation": not _ablation_rows(df).empty,
        "maxlen": ((df["metric"] == "max_len") & (df["status"] == "ok")).any(),
    }
    return [kind for kind in KINDS if has[kind]]


def make_figure(
    kind: str, df: pd.DataFrame, *, budget_gib: float | None = None, paper: pd.DataFrame | None = None
) -> Figure:
    """The figure of `kind` (one of KINDS) for `df`; `paper`: published max lengths (`max_length_bars`)."""
    if kind == "memory":
        return memory_vs_length(df, budget_gib=budget_gib)
    if kind == "maxlen":
        return max_length_bars(df, paper)
    builders = {"time": time_vs_length, "ablation": partition_ablation, "maxlen": max_length_bars}
    if kind not in builders:
        raise ValueError(f"unknown figure kind {kind!r}; choose from {', '.join(KINDS)}")
    return builders[kind](df)


def save(fig: Figure, path: str | Path) -> Path:
    """Write `fig` as a PNG at DPI dots per inch (making parent directories), then release it."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=DPI, bbox_inches="tight")
    fig.clear()
    return path


# --- selection ----------------------------------------------------------------------------------------


def _select(df: pd.DataFrame, metrics: Sequence[str]) -> pd.DataFrame:
    """Rows of `metrics` that did not fail; ValueError when there are none."""
    rows = df[df["metric"].isin(metrics) & (df["status"] != "error")]
    if rows.empty:
        raise ValueError(f"no rows with metric {' or '.join(metrics)} (and status ok or oom) to plot")
    return rows


def _ablation_rows(df: pd.DataFrame) -> pd.DataFrame:
    """Memory/time rows of the methods that ran at more than one partition size."""
    rows = df[df["metric"].isin(("peak_memory", "step_time")) & (df["status"] != "error")]
    sizes = rows.groupby("method")["partition_size"].nunique()
    return rows[rows["method"].isin(sizes[sizes > 1].index)]


def _varying(rows: pd.DataFrame, columns: Sequence[str], within: Sequence[str]) -> list[str]:
    """The `columns` that take more than one value inside some group of `within`."""
    counts = rows.groupby(list(within), dropna=False)[list(columns)].nunique(dropna=False)
    return [column for column in columns if (counts[column] > 1).any()]


def _series(
    rows: pd.DataFrame, extra: Sequence[str], always: Sequence[str] = ()
) -> Iterator[tuple[str, str, pd.DataFrame]]:
    """(label, method, rows) per line: by method, `always`, and the variant and `extra` columns that vary."""
    keys = ["method", *always, *_varying(rows, [*VARIANT_COLUMNS, *_within(rows), *extra], ["method"])]
    groups = rows.groupby(keys, dropna=False, sort=False)
    for values, series in sorted(groups, key=lambda group: _order(group[0])):
        yield _join(" ", keys, values), values[0], series


def _within(rows: pd.DataFrame) -> list[str]:
    """The WITHIN_METHOD_COLUMNS that `rows` have."""
    return [column for column in WITHIN_METHOD_COLUMNS if column in rows.columns]


def _order(values: tuple) -> tuple:
    """Sort key of a group: methods in METHOD_ORDER, then numbers by size, empty cells first."""
    method_rank = METHOD_ORDER.index(values[0]) if values[0] in METHOD_ORDER else len(METHOD_ORDER)
    rest = tuple(
        (0, 0.0, "") if pd.isna(v) else (1, float(v), "") if isinstance(v, numbers.Real) else (2, 0.0, str(v))
        for v in values[1:]
    )
    return (method_rank, str(values[0]), *rest)


def _groups(data: pd.DataFrame) -> Iterator[tuple[str, pd.DataFrame]]:
    """(label, rows) per bar group: a model plus the variant columns that vary anywhere in `data`."""
    keys = ["model", *(column for column in VARIANT_COLUMNS if data[column].nunique(dropna=False) > 1),
            *_varying(data, _within(data), ["model", "method"])]
    for values, rows in data.groupby(keys, dropna=False, sort=False):
        yield _join("\n", keys, values), rows


def _join(separator: str, columns: Sequence[str], values: Sequence[object]) -> str:
    """The non-empty `_describe` labels of these column values, joined."""
    labels = (_describe(column, value) for column, value in zip(columns, values, strict=True))
    return separator.join(label for label in labels if label)


def _describe(column: str, value: object) -> str:
    """A short, readable label for one column value ('ps 500', 'LoRA r32', 'batch 2')."""
    if pd.isna(value) or value == "":
        return "full" if column == "lora_rank" else ""
    prefix = _PREFIXES.get(column, "")
    if column in PARTITION_COLUMNS and int(value) % 1000 == 0:
        return f"{prefix}{int(value) // 1000}k"
    return f"{prefix}{value}"


PAPER_MATCH_COLUMNS = {"model", "objective", "lora_rank", "optimizer", "budget_gib", "offload"}
"""Columns a published value is matched on, those of them the published frame has."""


def _paper_value(paper: pd.DataFrame | None, rows: pd.DataFrame, method: str) -> float | None:
    """The published value for this group and method, matched on the columns `paper` has."""
    if paper is None:
        return None
    match = paper["method"] == method
    for column in PAPER_MATCH_COLUMNS & set(paper.columns):
        ours = rows[column].iloc[0]
        match &= paper[column].isna() if pd.isna(ours) else paper[column] == ours
    values = paper.loc[match, "value"]
    return None if values.empty else float(values.iloc[0])


def _first(values: pd.Series) -> float | None:
    values = values.dropna()
    return None if values.empty else float(values.iloc[0])


def _weights_grads(rows: pd.DataFrame) -> float | None:
    ok = rows[rows["status"] == "ok"]
    total = (ok["weights_gib"] + ok["grads_gib"]).dropna()
    return None if total.empty else float(total.median())


def _sources(data: pd.DataFrame) -> str:
    return " + ".join(sorted(set(data["source"])))


def _panel_title(model: str, rows: pd.DataFrame, data: pd.DataFrame) -> str:
    """The model, and the panel's sources when the figure mixes several."""
    return model if data["source"].nunique() == 1 else f"{model} ({_sources(rows)})"


# --- drawing ------------------------------------------------------------------------------------------


def _figure(panels: int, width_in: float = 6.5) -> tuple[Figure, list[Axes]]:
    """A Figure with an Agg canvas and `panels` side-by-side axes."""
    fig = Figure(figsize=(width_in * panels, 4.6), layout="constrained")
    FigureCanvasAgg(fig)
    return fig, list(fig.subplots(1, panels, squeeze=False)[0])


def _draw_methods(ax: Axes, rows: pd.DataFrame, *, scale: float = 1.0, oom_y: float | None = None) -> None:
    """One line per method (and per varying setting); a method's own colour when it has one line."""
    lines = list(_series(rows, PARTITION_COLUMNS))
    one_per_method = len(lines) == rows["method"].nunique()
    for index, (label, method, series) in enumerate(lines):
        color = METHOD_COLORS.get(method, f"C{index}") if one_per_method else f"C{index}"
        _draw_line(ax, series, label, color, scale=scale, oom_y=oom_y)


def _draw_line(
    ax: Axes, series: pd.DataFrame, label: str, color: str, *, scale: float, oom_y: float | None
) -> None:
    """The ok points as a line, and an x at the shortest OOM length (at `oom_y`, else the top edge)."""
    ok = series[series["status"] == "ok"].sort_values("seq_len_tokens")
    x, y = ok["seq_len_tokens"] / TOKENS_PER_K, ok["value"] * scale
    ax.plot(x, y, marker="o", markersize=4, color=color, label=label)
    oom = series.loc[series["status"] == "oom", "seq_len_tokens"]
    if oom.empty:
        return
    # x in data units; y on the budget line, else at the top edge (axes units)
    y, transform = (oom_y, ax.transData) if oom_y is not None else (0.97, ax.get_xaxis_transform())
    x_oom = oom.min() / TOKENS_PER_K
    ax.scatter([x_oom], [y], marker="x", s=70, color=color, zorder=3, linewidths=2, transform=transform)


def _finish(ax: Axes, title: str, ylabel: str, *, oom: bool) -> None:
    """Axis labels, title, grid and a legend (with an entry explaining the OOM marker when one is drawn)."""
    ax.set(title=title, xlabel=LENGTH_LABEL, ylabel=ylabel)
    ax.set_ylim(bottom=0)
    ax.set_xlim(left=0)
    ax.grid(alpha=0.3)
    handles, _ = ax.get_legend_handles_labels()
    if oom:
        handles.append(Line2D([], [], color="black", marker="x", linestyle="none", label="first OOM length"))
    ax.legend(handles=handles, fontsize=8)
