"""`--packing DOCS` of max-len and sweep: a note beside their figures, for packed rows of each length
(`streambp_core.step.estimate.packed`): the same peak memory, less attention work (estimated)."""

from __future__ import annotations

from typing import Annotated

import typer
from rich.table import Table

from streambp_bench.tokens import parse_tokens
from streambp_core.config import ConfigError, packing_problem

PackingOption = Annotated[
    str | None,
    typer.Option("--packing", metavar="DOCS", help="Also report packed rows of each length: a document count "
                 "(3: random lengths) or lengths (100,37,250): peak memory as unpacked, attention FLOPs the "
                 "sum of squared document lengths (estimated time saved with --gpu-model)."),
]


def check_packing(text: str | None, most_tokens: int, specs: tuple = ()) -> str | None:
    """`--packing` text as plain digits ('1k' -> '1000', '0.1k,50' -> '100,50'), checked without building
    any documents (O(number of lengths) in time and memory, whatever the count): ConfigError for text that
    is neither a document count nor lengths, or for more documents (or a longer total) than `most_tokens`,
    the longest row the command can reach, or for steps of `specs` that cannot run packed rows
    (`packing_problem`: the objective, sequence parallelism)."""
    if not text:
        return text
    for spec in specs:
        problem = packing_problem(spec.objective, spec.sp)
        if problem:
            raise ConfigError(problem)
    parts = [part.strip() for part in text.split(",")]
    try:
        lengths = [parse_tokens(part, "--packing") for part in parts]
    except ConfigError:
        raise ConfigError(f"--packing takes a document count or lengths like 100,37,250 (k = 1000), got "
                          f"{text!r}") from None
    total = lengths[0] if len(lengths) == 1 else sum(lengths)
    if total > most_tokens:
        what = f"{total:,} documents" if len(lengths) == 1 else f"lengths summing to {total:,} tokens"
        raise ConfigError(f"--packing {text}: {what} do not fit in the longest row here, {most_tokens:,} "
                          "tokens (a document has at least one token)")
    return ",".join(map(str, lengths))


def packing_notes(text: str | None, specs: list, gpu=None, resolved: dict | None = None) -> list:
    """One `PackedAttention` per distinct (model, method, length) of `specs` that the documents fit; []
    without `--packing`. `resolved`: the models the command resolved already, by name
    (`step.parts.resolved.ResolvedModel`); another model of `specs` is resolved here, once."""
    if not text:
        return []
    from streambp_core.step.estimate.packed import packed_attention
    from streambp_core.step.parts.batch import document_lengths
    from streambp_core.step.parts.resolved import ResolvedModel

    notes, models = [], dict(resolved or {})
    for spec in dict.fromkeys(specs):
        try:
            documents = document_lengths(text, spec.seq_len_tokens, spec.batch_size, spec.seed)
        except ConfigError:  # the documents are longer than this length
            continue
        if gpu is not None and spec.model not in models:
            models[spec.model] = ResolvedModel(spec.model)
        notes.append((spec, packed_attention(spec, documents, gpu, models.get(spec.model))))
    return notes


def to_dict(notes: list) -> list[dict]:
    """JSON entries: each point's method, model and packed attention figures."""
    return [{"model": spec.model, "method": spec.method, **note.to_dict()} for spec, note in notes]


def render_table(notes: list) -> Table:
    """The notes as a table."""
    table = Table(title="packed rows (estimated): peak memory as for an unpacked row of the same length "
                  "(plus a chunk's document mask); attention FLOPs = sum of squared document lengths",
                  title_justify="left")
    columns = ("method", "length", "documents (row 1)", "attention FLOPs vs unpacked", "attention ms",
               "saved ms")
    for column in columns:
        table.add_column(column, justify="left" if column in ("method", "documents (row 1)") else "right")
    for spec, note in notes:
        docs = ",".join(map(str, note.documents[0]))
        ms = ("-", "-") if note.attention_ms is None else (f"{note.attention_ms:.1f}", f"{note.saved_ms:.1f}")
        table.add_row(spec.method, f"{note.seq_len_tokens:,}", docs, f"{note.attention_flops_fraction:.1%}",
                      *ms)
    return table
