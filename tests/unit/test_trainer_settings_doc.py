"""docs/trainers.md's trainer section and `stream_trainer`'s refusals agree: every refused setting it lists is
refused, naming it, for exactly the methods it lists; every supported setting it lists is accepted; and
`verify trainer` checks a trainer from the command line."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", minversion="1.15")
pytest.importorskip("peft")
pytest.importorskip("datasets")

from streambp_core.config import ConfigError  # noqa: E402
from streambp_core.integrations import stream_trainer  # noqa: E402
from streambp_core.models.load import tiny_config  # noqa: E402
from streambp_core.verify.trainer_setup import ParitySetup, trainer_factory  # noqa: E402

pytestmark = pytest.mark.usefixtures("one_thread")  # tiny models, one thread

TRAINERS_DOC = Path(__file__).resolve().parents[2] / "docs" / "trainers.md"
METHODS = ("checkpoint", "mst", "streambp")
REFUSED = {  # docs name -> what sets it on a built transformers Trainer
    "label_smoothing_factor": lambda t: setattr(t.args, "label_smoothing_factor", 0.1),
    "compute_loss_func": lambda t: setattr(t, "compute_loss_func", lambda *a, **k: 0.0),
    "compute_metrics": lambda t: setattr(t, "compute_metrics", lambda *a: {}),
    "preprocess_logits_for_metrics": lambda t: setattr(t, "preprocess_logits_for_metrics", lambda *a: a[0]),
    "model_init": lambda t: setattr(t, "model_init", lambda: None),
    "fsdp": lambda t: setattr(t.args, "fsdp", "full_shard"),
    "deepspeed": lambda t: setattr(t.args, "deepspeed", "ds_config.json"),
    "bf16": lambda t: setattr(t.args, "bf16", True),
    "fp16": lambda t: setattr(t.args, "fp16", True),
}
SUPPORTED = {  # docs name -> (trainer kind, a value other than the default)
    "per_device_train_batch_size": ("trainer", 3), "gradient_accumulation_steps": ("trainer", 3),
    "learning_rate": ("trainer", 1e-3), "lr_scheduler_type": ("trainer", "cosine"),
    "weight_decay": ("trainer", 0.1), "max_grad_norm": ("trainer", 0.1), "optim": ("trainer", "adamw_torch"),
    "max_steps": ("trainer", 2), "seed": ("trainer", 3), "gradient_checkpointing": ("trainer", True),
    "save_strategy": ("trainer", "steps"), "save_steps": ("trainer", 2), "bf16": ("trainer", True),
    "max_length": ("sft", 12), "completion_only_loss": ("sft", False), "beta": ("dpo", 0.2),
    "num_generations": ("grpo", 2), "max_completion_length": ("grpo", 3), "peft_config": ("sft", 4),
    "packing": ("sft", True),
}

NOT_SETTINGS = {"stream_trainer", "AutoModelForCausalLM", "Trainer", "sgd", "adamw_torch"}
"""Other names in backticks in docs/trainers.md's 'Supported' paragraph."""


def trainer_section() -> str:
    text = TRAINERS_DOC.read_text()
    start = text.index("## Train at that length")
    end = text.find("\n## ", start + 1)
    return text[start:end if end != -1 else len(text)]


def readme_refusals() -> dict[str, set[str]]:
    """{setting: methods it is refused for} from docs/trainers.md's table."""
    rows = re.findall(r"^\| `(\w+)` \| ([^|]+) \|", trainer_section(), flags=re.MULTILINE)
    return {name: set(METHODS) if who.strip() == "every method" else {m.strip() for m in who.split(",")}
            for name, who in rows}


def readme_supported() -> set[str]:
    paragraph = trainer_section().split("**Supported**", 1)[1].split("\n\n", 1)[0]
    return set(re.findall(r"`(\w+)`", paragraph)) - NOT_SETTINGS


def build(kind: str = "trainer", dtype=torch.float64, lora_rank: int = 0, **settings):
    setup = ParitySetup(trainer=kind, model=tiny_config("llama"), dtype=dtype, lora_rank=lora_rank,
                        settings=settings)
    return trainer_factory(setup, "unused-output-dir")()


def test_trainers_doc_lists_exactly_the_tested_settings():
    assert set(readme_refusals()) == set(REFUSED)
    assert readme_supported() == set(SUPPORTED)


@pytest.mark.parametrize("name", REFUSED)
def test_each_refusal_names_its_setting_for_its_methods(name):
    refused_for = readme_refusals()[name]
    for method in METHODS:
        trainer = build()
        REFUSED[name](trainer)
        if method in refused_for:
            with pytest.raises(ConfigError) as refused:
                stream_trainer(trainer, method)
            assert name.lower() in str(refused.value).lower() and "\n" not in str(refused.value)
        else:
            stream_trainer(trainer, method).close()


@pytest.mark.parametrize("name", SUPPORTED)
def test_each_supported_setting_is_accepted(name):
    kind, value = SUPPORTED[name]
    if name == "peft_config":
        trainer = build(kind, lora_rank=value)
    elif name == "bf16":
        trainer = build(kind, dtype=torch.bfloat16, bf16=True)
    else:
        trainer = build(kind, **{name: value})
    assert getattr(trainer.args, name, value) == value or name == "optim"
    stream_trainer(trainer, "streambp").close()


def test_verify_trainer_prints_each_group(runner):
    from streambp_bench.cli import app

    args = ["verify", "trainer", "sft", "-m", "tiny/qwen3", "--dtype", "float64", "-b", "2",
            "--method", "streambp", "--ps", "5", "--ps-head", "7", "--set", "weight_decay=0.1",
            "--set", "max_steps=2", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert report["source"] == "measured-cpu" and report["settings"]["weight_decay"] == 0.1
    (streambp,) = report["results"]
    assert streambp["ok"] and streambp["tolerance"] == 1e-10
    groups = {g["group"]: g for g in streambp["groups"]}
    assert set(groups) == {"embedding = lm_head (tied)", "attention", "mlp", "norms"}
    assert all(g["rel_error"] <= 1e-10 and g["plain_update_norm"] > 0 for g in groups.values())


@pytest.mark.parametrize(("args", "named"), [
    (["sft", "--set", "no_such_setting=1"], "unknown SFTConfig setting(s): no_such_setting"),
    (["sft", "--set", "weight_decay"], "--set takes NAME=VALUE"),
    (["dpo", "--objective", "grpo"], "No such option: --objective"),
    (["trainer", "--method", "streambp", "--set", "label_smoothing_factor=0.1"],
     "label_smoothing_factor cannot train a streambp model"),
    (["sft", "--dtype", "bfloat16"], "no parity tolerance for bfloat16"),
])
def test_verify_trainer_bad_input_is_one_error_line(runner, args, named):
    from streambp_bench.cli import app

    kind, *options = args
    result = runner.invoke(app, ["verify", "trainer", kind, "-m", "tiny/llama", *options])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.stderr.splitlines() if line.strip()]
    assert lines[-1].startswith("error: ") and named in lines[-1], result.stderr
