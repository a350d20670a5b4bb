"""`streambp-bench presets`: the shipped model presets with their sizes."""

from __future__ import annotations

from rich.table import Table

from streambp_bench import options as opt
from streambp_bench.errors import user_errors
from streambp_bench.output import emit

HELP = (
    "List the model presets usable as [bold]--model[/], with their shapes and parameter counts.\n\n"
    "Parameter counts come from building each model on the meta device (no memory, no weights). "
    "A local directory with a config.json works as --model too."
)

EPILOG = """[bold]Examples[/]

[cyan]streambp-bench presets[/]

[cyan]streambp-bench presets --json[/]
"""


def preset_rows() -> list[dict]:
    """One dict per preset: name, family, layers, hidden, heads, kv heads, vocab, tied, parameter count."""
    from streambp_core.models import build_model, count_parameters, list_presets, load_config

    rows = []
    for name in list_presets():
        config = load_config(name)
        rows.append(
            {
                "name": name,
                "model_type": config.model_type,
                "layers": config.num_hidden_layers,
                "hidden": config.hidden_size,
                "heads": config.num_attention_heads,
                "kv_heads": config.num_key_value_heads,
                "vocab": config.vocab_size,
                "tied": bool(config.tie_word_embeddings),
                "params": count_parameters(build_model(config, device="meta")),
            }
        )
    return rows


def _human(count: int) -> str:
    return f"{count / 1e9:.2f}B" if count >= 1e8 else f"{count / 1e6:.2f}M"


def render_table(rows: list[dict]) -> Table:
    """The presets as a rich table."""
    table = Table(title="model presets (config only, no weights)", title_justify="left")
    name_width = max((len(row["name"]) for row in rows), default=4)
    table.add_column("name", no_wrap=True, min_width=name_width)
    for column in ("family", "layers", "hidden", "heads/kv", "vocab", "tied", "params"):
        table.add_column(column, justify="left" if column in ("family", "tied") else "right")
    for row in rows:
        table.add_row(
            row["name"],
            row["model_type"],
            str(row["layers"]),
            str(row["hidden"]),
            f"{row['heads']}/{row['kv_heads']}",
            str(row["vocab"]),
            "yes" if row["tied"] else "no",
            _human(row["params"]),
        )
    return table


@user_errors
def presets(as_json: opt.Json = False) -> None:
    """Print the presets as a table or JSON (help text: `HELP`)."""
    rows = preset_rows()
    emit(rows, as_json, lambda console: console.print(render_table(rows)))
