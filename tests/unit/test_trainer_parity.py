"""`stream_trainer` trains what plain training trains: transformers' Trainer and TRL's SFT, DPO and GRPO
trainers, models built by `AutoModelForCausalLM.from_config` (tiny Llama and Qwen3, float64), SGD, every
trainable parameter's update after 3 optimizer steps within 1e-10 of plain's, for checkpoint, mst and
streambp.

Axes: trainer (4), tied embeddings, weight decay, clipping (max_grad_norm), gradient accumulation 1/3,
data (text / prompt-completion; GRPO trains on prompts), LoRA / full. The default run takes 8 cells that
cover every pair of axis values (`test_default_cells_cover_every_pair`); the full cross product (224 cells,
about 20 minutes on 2 cores) runs when STREAMBP_TRAINER_MATRIX=full is set.
"""

from __future__ import annotations

import itertools
import os
from typing import NamedTuple

import pytest
import torch

pytest.importorskip("trl", minversion="1.15")
pytest.importorskip("peft")
pytest.importorskip("datasets")

from streambp_core.config import ConfigError  # noqa: E402
from streambp_core.models.load import tiny_config  # noqa: E402
from streambp_core.verify.trainer_parity import (  # noqa: E402
    BrokenReference,
    MethodParity,
    check_reference,
    group_errors,
    trainer_parity,
    update_tolerance,
)
from streambp_core.verify.trainer_setup import (  # noqa: E402
    ParitySetup,
    build_user_model,
    run_parity,
    trainer_factory,
)

STREAM = {"partition_size": 5, "head_partition_size": 7}  # several chunks per layer and head at these lengths
WEIGHT_DECAY, MAX_GRAD_NORM, LORA_RANK = 0.1, 0.1, 4


class Cell(NamedTuple):
    trainer: str
    tied: bool
    decay: bool
    clip: bool
    accumulation: int
    data: str
    lora: bool


PC = "prompt-completion"
DEFAULT_CELLS = (
    Cell("trainer", False, False, False, 1, "text", False),
    Cell("trainer", True, True, True, 3, PC, True),
    Cell("sft", False, False, False, 1, PC, True),
    Cell("sft", True, True, True, 3, "text", False),
    Cell("dpo", False, False, True, 3, "text", True),
    Cell("dpo", True, True, False, 1, PC, False),
    Cell("grpo", False, True, False, 3, PC, False),
    Cell("grpo", True, False, True, 1, PC, True),
)
"""Every value of every axis meets every value of every other axis in at least one cell."""
AXES = {"trainer": ("trainer", "sft", "dpo", "grpo"), "tied": (False, True), "decay": (False, True),
        "clip": (False, True), "accumulation": (1, 3), "data": ("text", PC), "lora": (False, True)}
ALL_CELLS = tuple(Cell(*values) for values in itertools.product(*AXES.values())
                  if values[0] != "grpo" or values[5] == PC)


pytestmark = pytest.mark.usefixtures("one_thread")


def setup_of(cell: Cell, family: str, **settings) -> ParitySetup:
    settings = {"weight_decay": WEIGHT_DECAY if cell.decay else 0.0,
                "max_grad_norm": MAX_GRAD_NORM if cell.clip else 0.0,
                "gradient_accumulation_steps": cell.accumulation, **settings}
    if cell.trainer == "grpo" and cell.lora:
        settings["beta"] = 0.1  # the KL term scores the reference (the adapter disabled) too
    return ParitySetup(trainer=cell.trainer, model=tiny_config(family, tie_word_embeddings=cell.tied),
                       data=cell.data, lora_rank=LORA_RANK if cell.lora else 0, settings=settings)


def assert_parity(results: list[MethodParity], tolerance: float) -> None:
    """Every method within `tolerance` in every group, and every group moved in the plain run."""
    assert [r.method for r in results] == ["checkpoint", "mst", "streambp"]
    for result in results:
        assert result.tolerance == tolerance
        for group in result.groups:
            assert group.plain_update_norm > 0, f"{group.group} never moved: the comparison means nothing"
            assert group.rel_error <= tolerance, (
                f"{result.method} {group.group}: {group.rel_error:.2e} (worst {group.worst_parameter})")


def run_cell(cell: Cell, family: str, tmp_path, **settings) -> list[MethodParity]:
    return trainer_parity(trainer_factory(setup_of(cell, family, **settings), tmp_path), **STREAM)


@pytest.mark.slow
@pytest.mark.parametrize("cell", DEFAULT_CELLS, ids=str)
def test_sgd_parity(cell, tmp_path):
    family = ("llama", "qwen3")[DEFAULT_CELLS.index(cell) % 2]
    results = run_cell(cell, family, tmp_path)
    assert_parity(results, 1e-10)
    groups = {g.group for g in results[0].groups}
    assert ("embedding = lm_head (tied)" in groups) == (cell.tied and not cell.lora)
    assert any(g.startswith("lora") for g in groups) == cell.lora


@pytest.mark.slow
@pytest.mark.skipif(os.environ.get("STREAMBP_TRAINER_MATRIX") != "full",
                    reason="the full trainer matrix runs with STREAMBP_TRAINER_MATRIX=full (~20 min)")
@pytest.mark.parametrize("cell", ALL_CELLS, ids=str)
def test_sgd_parity_every_cell(cell, tmp_path):
    assert_parity(run_cell(cell, "qwen3", tmp_path), 1e-10)


@pytest.mark.slow
@pytest.mark.parametrize("cell", [DEFAULT_CELLS[3], DEFAULT_CELLS[1]], ids=str)
def test_adam_parity(cell, tmp_path):
    """AdamW within `update_tolerance` (1e-6 in float64: Adam's normalisation amplifies the rounding of
    near-zero gradients, see `streambp_core.verify.trainer_parity`)."""
    results = run_cell(cell, "llama", tmp_path, optim="adamw_torch")
    assert_parity(results, update_tolerance("adamw_torch", torch.float64))


def test_default_cells_cover_every_pair():
    for (a, values_a), (b, values_b) in itertools.combinations(AXES.items(), 2):
        seen = {(getattr(c, a), getattr(c, b)) for c in DEFAULT_CELLS}
        wanted = {(x, y) for x in values_a for y in values_b}
        if (a, b) == ("trainer", "data"):
            wanted.discard(("grpo", "text"))  # GRPO trains on prompts only
        assert wanted <= seen, f"{a} x {b}: {sorted(wanted - seen, key=str)} not covered"


def test_models_from_one_config_object_are_the_same(tmp_path):
    """TRL's trainers write the tokenizer's pad id into `model.config`, and `from_config` keeps the config
    object it is given: a second model from that object would get an embedding with `padding_idx` (the
    row zeroed at init, never trained). Each parity model is built from a copy, so every run trains the
    same model."""
    config = tiny_config("llama", tie_word_embeddings=True)
    first = build_user_model(config, torch.float64, seed=0)
    first.config.pad_token_id = 0  # what SFTTrainer, DPOTrainer and GRPOTrainer do to their model
    second = build_user_model(config, torch.float64, seed=0)
    assert second.get_input_embeddings().padding_idx is None
    for (name, a), b in zip(first.named_parameters(), second.parameters(), strict=True):
        assert torch.equal(a, b), name


def test_group_errors_and_tolerances():
    f64 = {"dtype": torch.float64}
    plain = {"model.embed_tokens.weight": torch.ones(3, **f64), "model.layers.0.mlp.up_proj.weight":
             torch.zeros(2, **f64), "model.norm.weight": torch.zeros(2, **f64),
             "model.layers.0.self_attn.q_proj.lora_A.default.weight": torch.ones(2, **f64)}
    streamed = {**plain, "model.embed_tokens.weight": torch.tensor([1.0, 1.0, 1.0 + 3e-10], **f64),
                "model.norm.weight": torch.tensor([0.0, 1e-3], **f64)}
    errors = {g.group: g.rel_error for g in group_errors(plain, streamed, tied=True)}
    assert errors == {"embedding = lm_head (tied)": pytest.approx(3e-10 / 3**0.5), "mlp": 0.0,
                      "norms": float("inf"), "lora attention": 0.0}
    assert update_tolerance("sgd", torch.float64) == 1e-10
    assert update_tolerance("adamw_torch", torch.float64) == 1e-6
    assert update_tolerance("sgd", torch.float32) == 1e-4


def test_model_directory_with_weights(tmp_path):
    """A directory with safetensors weights is loaded by `from_pretrained`, as a user loads it."""
    saved = build_user_model(tiny_config("qwen3", tie_word_embeddings=False), torch.float32, seed=1)
    saved.save_pretrained(tmp_path)
    setup = ParitySetup(trainer="sft", model=str(tmp_path), settings={"max_steps": 2, "weight_decay": 0.1})
    (result,) = run_parity(setup, ("streambp",), **STREAM)
    assert result.ok and result.tolerance == 1e-10
    assert {g.group for g in result.groups} == {"embedding", "attention", "mlp", "norms", "lm_head"}


@pytest.mark.parametrize(("settings", "named"), [
    ({"learning_rate": 0}, "learning_rate=0"),
    ({"learning_rate": 0.0, "optim": "adamw_torch"}, "learning_rate=0"),
    ({"max_steps": 0}, "max_steps=0"),
    ({"max_steps": -1, "num_train_epochs": 0}, "num_train_epochs=0 with max_steps=-1"),
])
def test_settings_that_train_nothing_are_refused(settings, named):
    """A run that moves no parameter would pass whatever a method does: refused before anything builds."""
    with pytest.raises(ConfigError, match=f"{named} trains nothing"):
        ParitySetup(trainer="sft", model="tiny/llama", settings=settings)


def test_a_reference_that_moved_nothing_or_is_not_finite_is_refused():
    moved = {"a": torch.zeros(2, dtype=torch.float64), "b": torch.tensor([0.0, 1e-300], dtype=torch.float64)}
    check_reference("plain training", moved)  # one element moved: a comparison means something
    with pytest.raises(ConfigError, match="plain training moved no parameter"):
        check_reference("plain training", {"a": torch.zeros(2), "b": torch.zeros(3)})
    for bad in (float("nan"), float("inf")):
        broken = r"single-process plain, trained to a non-finite update \(b\)"
        with pytest.raises(BrokenReference, match=broken):
            check_reference("single-process plain", {"a": torch.ones(2), "b": torch.tensor([1.0, bad])})


def test_an_optimizer_setting_torch_refuses_is_refused_before_training(monkeypatch):
    """torch builds the optimizer inside `train()`; its refusal of a hyper-parameter comes first, as a
    ConfigError naming it, and nothing trains."""
    monkeypatch.setattr("streambp_core.verify.trainer_parity.train_updates",
                        lambda *a, **k: pytest.fail("trained despite a refused optimizer setting"))
    setup = ParitySetup(trainer="sft", model="tiny/llama", settings={"optim": "adamw_torch", "adam_beta1": 2})
    with pytest.raises(ConfigError, match="SFTTrainer's optimizer: Invalid beta parameter at index 0: 2"):
        run_parity(setup, ("streambp",), **STREAM)


def test_a_plain_run_that_diverges_is_a_broken_reference():
    """A learning rate that overflows the weights makes plain's own update non-finite: the reference is
    reported broken instead of a method being judged against it."""
    setup = ParitySetup(trainer="trainer", model="tiny/llama", settings={"learning_rate": 1e300,
                                                                         "max_steps": 2})
    with pytest.raises(BrokenReference, match="the reference, plain training, trained to a non-finite"):
        run_parity(setup, ("streambp",), **STREAM)


@pytest.mark.slow
@pytest.mark.parametrize(("kind", "family", "methods"), [
    ("trainer", "qwen3.5", ("checkpoint", "mst", "streambp")),
    ("trainer", "gpt-oss", ("checkpoint", "mst", "streambp")),
    ("sft", "qwen3-moe", ("checkpoint",)),
])
def test_float64_families_with_float32_islands_train_as_plain(kind, family, methods):
    """The reference model is built as `build_model` builds it: a mixture of experts runs its per-expert
    loop in float64 (grouped matmuls refuse float64), and Qwen3.5's float32 islands (norms, linear
    attention) compute in float64 in plain training as in the streamed runs (they were 2.5e-7 apart)."""
    setup = ParitySetup(trainer=kind, model=f"tiny/{family}", settings={"max_steps": 2})
    results = run_parity(setup, methods, **STREAM)
    assert [r.method for r in results] == list(methods)
    for result in results:
        assert result.tolerance == 1e-10 and result.ok, (result.method, result.max_rel_error)
        assert all(g.plain_update_norm > 0 for g in result.groups)
