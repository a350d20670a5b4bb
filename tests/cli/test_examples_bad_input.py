"""Every example script on bad input: one `error:` line on stderr, exit 2, before a model is loaded."""

from __future__ import annotations

import importlib
import json
import sys
from pathlib import Path

import pytest

from streambp_core.models.load import PRESET_DIR
from tests.cli.errors import error_line

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
SCRIPTS = {"train_sft": "text", "train_dpo": "chosen", "train_grpo": "answer", "train_trainer": "text"}


@pytest.fixture
def inputs(tmp_path: Path) -> dict[str, Path]:
    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text((PRESET_DIR / "tiny--qwen3.json").read_text())
    good = tmp_path / "good.jsonl"
    good.write_text(json.dumps({"text": "a", "prompt": "b", "completion": "c", "chosen": "d",
                                "rejected": "e", "answer": "f"}) + "\n")
    unrelated = tmp_path / "unrelated.jsonl"
    unrelated.write_text(json.dumps({"other": 1}) + "\n")
    broken = tmp_path / "broken.jsonl"
    broken.write_text('{"text": "a"\n')
    return {"model": model, "good": good, "unrelated": unrelated, "broken": broken, "out": tmp_path / "o"}


def _main(name: str):
    sys.path.insert(0, str(EXAMPLES))
    try:
        return importlib.import_module(name).main
    finally:
        sys.path.remove(str(EXAMPLES))


CASES = {
    "partition-size-0": (["--partition-size", "0"], "good", "model", "--partition-size"),
    "max-length-1": (["--max-length", "1"], "good", "model", "--max-length"),
    "no-such-option": (["--no-such-option"], "good", "model", "--no-such-option"),
    "missing-field": ([], "unrelated", "model", "needs JSON lines"),
    "bad-json": ([], "broken", "model", "not valid JSON"),
    "missing-data": ([], "missing", "model", "no such file"),
    "missing-model": ([], "good", "missing", "--model"),
}


@pytest.mark.parametrize("case", sorted(CASES))
@pytest.mark.parametrize("script", sorted(SCRIPTS))
def test_bad_input_is_one_error_line(script: str, case: str, inputs, capsys) -> None:
    extra, data, model, words = CASES[case]
    data_path = inputs.get(data, inputs["out"] / "missing.jsonl")
    model_path = inputs.get(model, inputs["out"] / "missing-model")
    argv = ["--model", str(model_path), "--data", str(data_path), "--output-dir", str(inputs["out"]), *extra]
    with pytest.raises(SystemExit) as exit_info:
        _main(script)(argv)
    assert exit_info.value.code == 2
    error_line(capsys.readouterr().err, words)
