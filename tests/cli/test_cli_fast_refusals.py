"""A broken model (preset, directory or config.json) and a bad --out are refused by every command before
torch or transformers is imported: one `error:` line, exit 2, in well under a second (the two imports
alone take seconds). Each case runs the CLI in a fresh interpreter and then looks at its modules."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from streambp_core.models.load import PRESET_DIR

REPO = Path(__file__).parents[2]
QWEN3 = json.loads((PRESET_DIR / "tiny--qwen3.json").read_text())
RUN = """
import json, sys
sys.argv = ["streambp-bench", *sys.argv[1:]]
from streambp_bench.cli import main
code = 0
try:
    main()
except SystemExit as exit_:
    code = exit_.code
heavy = sorted(name for name in ("torch", "transformers") if name in sys.modules)
print(json.dumps({"code": code, "heavy": heavy}), file=sys.__stdout__)
"""
MODELS = {
    "no-config": (None, "has no config.json"),
    "no-model-type": ({k: v for k, v in QWEN3.items() if k != "model_type"}, "no model_type"),
    "bart": ({**QWEN3, "model_type": "bart"}, "architecture 'bart' is not supported: an encoder-decoder"),
    "activation": ({**QWEN3, "hidden_act": "nonsense"}, "hidden_act 'nonsense'"),
    "rope-type": ({**QWEN3, "rope_scaling": {"rope_type": "bogus", "factor": 2.0}}, "rope_type 'bogus'"),
    "pad-token": ({**QWEN3, "vocab_size": 50, "pad_token_id": 100}, "pad_token_id must be a token id"),
}
COMMANDS = {
    "max-len": ["max-len", "--budget-gib", "1"],
    "verify": ["verify", "-T", "8"],
    "sweep": ["sweep", "--seq-len", "64", "--device", "sim", "--budget-gib", "1"],
}


def _cli(args: list[str]) -> tuple[dict, str]:
    done = subprocess.run([sys.executable, "-c", RUN, *args], capture_output=True, text=True, timeout=120,
                          env={**os.environ, "PYTHONPATH": str(REPO), "COLUMNS": "200"}, cwd=REPO)
    return json.loads(done.stdout.strip().splitlines()[-1]), done.stderr


def _model(tmp_path: Path, values: dict | None) -> str:
    folder = tmp_path / "model"
    folder.mkdir()
    if values is not None:
        (folder / "config.json").write_text(json.dumps(values))
    return str(folder)


CASES = [(case, "max-len") for case in MODELS] + [("no-config", "verify"), ("rope-type", "sweep"),
                                                   ("bart", "verify"), ("pad-token", "verify")]
DEFAULT_CASES = (("bart", "max-len"), ("no-config", "verify"), ("rope-type", "sweep"))
"""One case a command in the default run (a fresh interpreter each); every case under -m slow."""


@pytest.mark.parametrize(("case", "command"), [
    pytest.param(*case, marks=() if case in DEFAULT_CASES else pytest.mark.slow) for case in CASES])
def test_a_broken_model_is_refused_before_torch_is_imported(tmp_path: Path, case: str, command: str) -> None:
    values, message = MODELS[case]
    args = [*COMMANDS[command], "--model", _model(tmp_path, values)]
    if command == "sweep":
        args += ["--out", str(tmp_path / "s.csv")]
    outcome, stderr = _cli(args)
    assert outcome == {"code": 2, "heavy": []}, stderr
    assert stderr.startswith("error: ") and message in stderr and stderr.count("\n") == 1, stderr


@pytest.mark.parametrize("case", ["rope-type", "pad-token"])
def test_the_full_check_refuses_them_when_the_config_loads(tmp_path: Path, case: str) -> None:
    """The check behind every load refuses them too (building the model raised a KeyError inside
    transformers, an AssertionError inside torch's embedding)."""
    from streambp_core.config import ConfigError
    from streambp_core.models.load import build_model, load_config

    values, message = MODELS[case]
    with pytest.raises(ConfigError, match=message):
        build_model(load_config(_model(tmp_path, values)), device="meta")


def _foreign_csv(folder: Path, name: str) -> None:
    folder.mkdir(exist_ok=True)
    (folder / name).write_text("kernel,speed\nrms,1\n")


@pytest.mark.parametrize("name", ["selfcheck.csv", pytest.param("selfcheck-cpu-dry-run.csv",
                                                                  marks=pytest.mark.slow)])
def test_selfcheck_refuses_an_out_holding_another_csv_before_torch(tmp_path: Path, name: str) -> None:
    _foreign_csv(tmp_path / "out", name)
    outcome, stderr = _cli(["selfcheck", "--out", str(tmp_path / "out")])
    assert outcome == {"code": 2, "heavy": []}, stderr
    assert "is not a streambp-bench results CSV" in stderr and stderr.count("\n") == 1


@pytest.mark.parametrize("command", [["selfcheck"], ["reproduce", "fig3", "--quick"]])
def test_an_out_that_is_a_file_is_refused_before_torch(tmp_path: Path, command: list[str]) -> None:
    target = tmp_path / "file.csv"
    target.write_text("x\n")
    outcome, stderr = _cli([*command, "--out", str(target)])
    assert outcome == {"code": 2, "heavy": []}, stderr
    assert "not a folder" in stderr


def test_an_unknown_selfcheck_item_is_refused_before_torch() -> None:
    outcome, stderr = _cli(["selfcheck", "--skip", "nope"])
    assert outcome == {"code": 2, "heavy": []}, stderr
    assert "unknown item nope" in stderr
