"""`streambp-bench presets`: the shipped model presets with their sizes."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from streambp_bench import options as opt
from streambp_bench.errors import user_errors
from streambp_bench.output import emit
from streambp_core.config import ConfigError

HELP = (
    "List the model presets usable as [bold]--model[/], with their shapes and parameter counts.\n\n"
    "Parameter counts come from building each model on the meta device (no memory, no weights). "
    "A local directory with a config.json works as --model too.\n\n"
    "[bold]--families[/]: every model_type of the installed transformers' causal-LM map instead, with the "
    "path that serves it: engine (every method), baselines (plain and checkpoint, streambp through the "
    "model's own decoder layers, mst where its MLP is token-wise) or refused, with the reason. "
    "[bold]--markdown[/] prints that list as docs/models.md "
    "holds it."
)

EPILOG = """[bold]Examples[/]

[cyan]streambp-bench presets[/]

[cyan]streambp-bench presets --json[/]

[cyan]streambp-bench presets --families[/]

[cyan]streambp-bench presets --families --json[/]
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
                "kv_heads": _global_value(config, "num_key_value_heads"),
                "vocab": config.vocab_size,
                "tied": bool(config.tie_word_embeddings),
                "params": count_parameters(build_model(config, device="meta")),
            }
        )
    return rows


def _global_value(config, name: str):
    """`config.<name>`, or its config.json value where transformers refuses the attribute because it varies
    by layer (Gemma 4's key/value heads, global and sliding)."""
    try:
        return getattr(config, name)
    except RuntimeError:  # transformers' AmbiguousGlobalPerLayerAttributeError
        return config.to_dict().get(name)


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


def family_rows() -> list[dict]:
    """One dict per model_type of transformers' causal-LM map: model_type, path (engine, baselines,
    refused), serves (the path in words) and reason (why a refused one is refused; '' otherwise)."""
    from streambp_core.models.catalogue import family_servings

    return [{"model_type": found.model_type, "path": found.path, "serves": found.label,
             "reason": found.reason} for found in family_servings()]


def render_families(rows: list[dict]) -> Table:
    """The families as a rich table."""
    table = Table(title="causal-LM families of the installed transformers, and the path serving each",
                  title_justify="left")
    table.add_column("model_type", no_wrap=True, min_width=max((len(row["model_type"]) for row in rows),
                                                               default=10))
    table.add_column("served by")
    for row in rows:
        table.add_row(row["model_type"], row["serves"])
    return table


FAMILY_HEADINGS = {
    "engine": "engine (every method; streambp through the engine's own layer math)",
    "baselines": "baselines (plain and checkpoint: transformers' own forward and activation checkpointing; "
                 "mst where every decoder layer has a token-wise MLP and the logits are `lm_head`'s alone; "
                 "streambp through the model's own decoder layers on CPU and CUDA, and simulated under the "
                 "engine's attention, refused by name where a layer cannot be streamed)",
    "refused": "refused by name, listing what each method accepts",
}
"""How docs/models.md's generated family list heads each path."""


def families_markdown(rows: list[dict]) -> str:
    """The family list as docs/models.md holds it: one bullet per path, its families in order (a refused
    one with its reason)."""
    lines = []
    for path, heading in FAMILY_HEADINGS.items():
        names = [f"`{row['model_type']}`" + (f" ({row['reason']})" if row["reason"] else "")
                 for row in rows if row["path"] == path]
        joined = ("; " if path == "refused" else ", ").join(names)
        lines.append(f"- {heading}, {len(names)}: {joined}.")
    return "\n".join(lines) + "\n"


@user_errors
def presets(
    as_json: opt.Json = False,
    families: Annotated[bool, typer.Option(
        "--families", help="List every causal-LM family of transformers with the path serving it.")] = False,
    markdown: Annotated[bool, typer.Option(
        "--markdown", help="With --families: the list as docs/models.md holds it.")] = False,
) -> None:
    """Print the presets (or, with --families, the families) as a table or JSON (help text: `HELP`)."""
    if markdown and not families:
        raise ConfigError("--markdown prints the family list: give --families with it")
    if families:
        rows = family_rows()
        if markdown:
            typer.echo(families_markdown(rows), nl=False)
            return
        emit(rows, as_json, lambda console: console.print(render_families(rows)))
        return
    rows = preset_rows()
    emit(rows, as_json, lambda console: console.print(render_table(rows)))
