"""`presets --families` lists every causal LM of the installed transformers with the path serving it,
derived from transformers' causal-LM map, so a family a new release adds is listed as baselines only or
refused with its reason, never a crash; docs/models.md's family list is its `--markdown` output."""

from __future__ import annotations

import json
from pathlib import Path

from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES
from typer.testing import CliRunner

from streambp_bench.cli import app
from streambp_bench.commands.presets import families_markdown, family_rows
from streambp_core.models import catalogue
from streambp_core.models.families import SUPPORTED_FAMILIES, TEXT_WRAPPERS

ROOT = Path(__file__).resolve().parents[2]


def test_families_json_lists_every_causal_lm_of_transformers_with_its_path():
    result = CliRunner().invoke(app, ["presets", "--families", "--json"])
    assert result.exit_code == 0, result.output
    rows = json.loads(result.output)
    assert [row["model_type"] for row in rows] == sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)
    by_path = {path: {row["model_type"] for row in rows if row["path"] == path}
               for path in ("engine", "baselines", "refused")}
    assert sum(map(len, by_path.values())) == len(rows)
    wrappers = {wrapper for wrapper, _ in TEXT_WRAPPERS}
    assert {"llama", "qwen3", "gemma3"} <= by_path["engine"] <= set(SUPPORTED_FAMILIES) | wrappers
    assert {"gpt2", "cohere", "mamba"} <= by_path["baselines"]
    assert {"bart", "bert", "fuyu"} <= by_path["refused"]
    assert all(bool(row["reason"]) == (row["path"] == "refused") for row in rows)
    bart = next(row for row in rows if row["model_type"] == "bart")
    assert bart["serves"].startswith("refused: an encoder-decoder")


def test_a_family_a_new_transformers_adds_is_baselines_or_refused_by_name(monkeypatch):
    names = (catalogue.CAUSAL_LM, *catalogue.MULTIMODAL, *catalogue.ENCODER_DECODER, *catalogue.ENCODER)
    maps = {name: dict(catalogue.auto_map(name)) for name in names}
    maps[catalogue.CAUSAL_LM] |= {"brand_new": "BrandNewForCausalLM",
                                  "brand_new_vl": "BrandNewVLForConditionalGeneration"}
    monkeypatch.setattr(catalogue, "auto_map", lambda name: maps.get(name, {}))
    rows = {row["model_type"]: row for row in family_rows()}
    assert rows["brand_new"]["path"] == "baselines"
    assert rows["brand_new"]["serves"].startswith("baselines (plain, checkpoint")
    assert rows["brand_new_vl"]["path"] == "refused"
    assert rows["brand_new_vl"]["reason"].startswith(
        "a multimodal model (BrandNewVLForConditionalGeneration)")
    assert "brand_new" in families_markdown(list(rows.values()))


def test_the_docs_family_list_is_the_presets_markdown_output():
    docs = (ROOT / "docs" / "models.md").read_text(encoding="utf-8")
    start = docs.index("<!-- families: streambp-bench presets --families --markdown -->\n")
    block = docs[docs.index("\n", start) + 1:docs.index("<!-- /families -->")]
    result = CliRunner().invoke(app, ["presets", "--families", "--markdown"])
    assert result.exit_code == 0
    assert block == result.output == families_markdown(family_rows())
    assert block.count("\n- ") == 2 and "`gpt2`" in block and "`bart` (an encoder-decoder" in block


def test_markdown_without_families_is_refused_on_one_line():
    result = CliRunner().invoke(app, ["presets", "--markdown"])
    assert result.exit_code == 2
    assert "--markdown prints the family list: give --families with it" in result.output
