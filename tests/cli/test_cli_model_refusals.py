"""Models that cannot run are refused by name, exit 2, before any work, by every command: one geometry
check (`streambp_core.models.config_file.check_geometry`) sits behind every way a config is loaded."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from streambp_bench.cli import app
from streambp_core.config import ConfigError
from streambp_core.models.load import PRESET_DIR, build_model, tiny_config
from tests.cli.errors import one_line_error

QWEN3 = json.loads((PRESET_DIR / "tiny--qwen3.json").read_text())
MOE = json.loads((PRESET_DIR / "tiny--qwen3-moe.json").read_text())
SLIDING = ["sliding_attention", "full_attention"]
REPO = Path(__file__).parents[2]

BROKEN = {
    "sliding-null": ({**QWEN3, "layer_types": SLIDING, "sliding_window": None}, "sliding_window"),
    "sliding-off": (
        {**QWEN3, "layer_types": SLIDING, "sliding_window": 16, "use_sliding_window": False},
        "use_sliding_window",
    ),
    "kv-heads-0": ({**QWEN3, "num_key_value_heads": 0}, "num_key_value_heads"),
    "head-dim-0": ({**QWEN3, "head_dim": 0}, "head_dim"),
    "head-dim-1": ({**QWEN3, "head_dim": 1}, "head_dim"),
    "experts-per-token": ({**MOE, "num_experts_per_tok": 8}, "num_experts_per_tok"),
    "window-0": ({**QWEN3, "sliding_window": 0, "use_sliding_window": True}, "sliding_window"),
    "activation": ({**QWEN3, "hidden_act": "nonsense"}, "hidden_act"),
    "sparse-step-0": ({**MOE, "decoder_sparse_step": 0}, "decoder_sparse_step"),
}

COMMANDS = {
    "verify": ["verify", "-T", "8"],
    "verify-nproc": ["verify", "fsdp", "-T", "8", "--nproc", "2"],
    "max-len": ["max-len", "--budget-gib", "1"],
    "sweep": ["sweep", "--seq-len", "64", "--device", "sim", "--budget-gib", "1"],
}


def _model_dir(tmp_path: Path, values: dict) -> Path:
    folder = tmp_path / "model"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(values))
    return folder


CASES_PER_COMMAND = [(case, "max-len") for case in sorted(BROKEN)] + [
    (case, command) for case in ("sliding-off", "kv-heads-0", "experts-per-token") for command in COMMANDS
    if command != "max-len"
]


@pytest.mark.parametrize(("case", "command"), CASES_PER_COMMAND)
def test_every_command_refuses_a_model_that_cannot_run(tmp_path: Path, case: str, command: str) -> None:
    values, key = BROKEN[case]
    folder = _model_dir(tmp_path, values)
    out = ["--out", str(tmp_path / "o.csv")] if command == "sweep" else []
    result = CliRunner().invoke(app, [*COMMANDS[command], "-m", str(folder), *out])
    one_line_error(result, key)
    assert not (tmp_path / "o.csv").exists()


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_build_model_refuses_the_same_configs(case: str) -> None:
    values, key = BROKEN[case]
    family = "qwen3-moe" if values["model_type"] == "qwen3_moe" else "qwen3"
    base = MOE if family == "qwen3-moe" else QWEN3
    overrides = {name: value for name, value in values.items() if base.get(name, object()) != value}
    with pytest.raises(ConfigError, match=key):
        build_model(tiny_config(family, **overrides) if key != "use_sliding_window" else _direct(values))


def _direct(values: dict):
    from transformers import Qwen3Config

    return Qwen3Config(**values)


def test_valid_sliding_layers_still_load() -> None:
    config = tiny_config("qwen3", layer_types=SLIDING, sliding_window=16, use_sliding_window=True)
    assert config.layer_types == SLIDING and config.sliding_window == 16


PRECHECK = """
import sys
from streambp_core.config import ConfigError
from streambp_core.models.config_file import precheck_model
for folder in sys.argv[1:]:
    try:
        precheck_model(folder)
    except ConfigError as error:
        print(error)
    else:
        print("accepted", folder)
print("torch imported" if "torch" in sys.modules or "transformers" in sys.modules else "light")
"""
PRECHECKED = ["kv-heads-0", "head-dim-1", "experts-per-token", "sliding-null", "sliding-off"]


@pytest.fixture(scope="module")
def prechecked(tmp_path_factory) -> tuple[dict[str, str], str]:
    """The cheap model check on each `PRECHECKED` case's directory, in one fresh interpreter: its message
    per case, and whether torch or transformers got imported along the way."""
    folders = [_model_dir(tmp_path_factory.mktemp(case), BROKEN[case][0]) for case in PRECHECKED]
    done = subprocess.run([sys.executable, "-c", PRECHECK, *map(str, folders)], capture_output=True,
                          text=True, check=True, env={**os.environ, "PYTHONPATH": str(REPO)})
    *messages, weight = done.stdout.strip().splitlines()
    assert len(messages) == len(PRECHECKED), done.stdout
    return dict(zip(PRECHECKED, messages, strict=True)), weight


@pytest.mark.parametrize("case", PRECHECKED)
def test_a_broken_config_is_refused_without_importing_torch(prechecked, case: str) -> None:
    """The cheap model check every command runs first refuses these, so the error takes well under a
    second (torch and transformers alone take seconds to import)."""
    messages, weight = prechecked
    assert BROKEN[case][1] in messages[case] and weight == "light", (messages[case], weight)
