"""Every family of transformers' causal-LM map answers: the engine's families through their tiny presets,
any other decoder-only text family built from a tiny config written to a directory runs plain and
checkpoint on meta, and what cannot run is refused by name (a ConfigError), never a crash. The full sweep
is slow; a handful runs by default."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
from transformers.models.auto.configuration_auto import CONFIG_MAPPING

from streambp_core.config import ConfigError, StepSpec
from streambp_core.models.catalogue import causal_families, serving
from streambp_core.step.simulation.simulate import simulate
from tests.model_dirs import config_directory

ROOT = Path(__file__).resolve().parents[2]
SIZES = {"hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
         "intermediate_size": 128, "vocab_size": 512, "head_dim": 16, "moe_intermediate_size": 32,
         "num_experts": 4, "num_local_experts": 4, "num_experts_per_tok": 2, "max_position_embeddings": 512,
         "rotary_dim": 8, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16, "kv_lora_rank": 16,
         "q_lora_rank": 32}
"""Common size fields, set where a family's config has them (hidden 64, 2 layers)."""
FAMILY_SIZES = {"glm_moe_dsa": {"num_key_value_heads": 4}, "deepseek_v32": {"num_key_value_heads": 4}}
"""Sizes a family needs beyond `SIZES`: multi-head latent attention expanded by transformers' own code has as
many key heads as query heads, as in the released models (with 2 its SDPA call fails on any device)."""
DEFAULT_FAMILIES = ("gemma4_text", "cohere", "olmoe", "mamba", "ctrl", "bart", "fuyu", "bert")
"""The default run's handful: a Gemma 4, a dense, a mixture of experts, a state-space model, one without
transformers' checkpointing, an encoder-decoder, a multimodal model and an encoder."""


def tiny_values(model_type: str, sizes: dict) -> dict:
    """config.json values of a small `model_type` model: its config class's defaults with `sizes` where it
    has those fields, token ids in the vocabulary (with `SIZES`), no dropout."""
    config_class = CONFIG_MAPPING[model_type]
    default = config_class().to_dict()
    shrink = sizes is SIZES
    values = {key: value for key, value in sizes.items()
              if key in default or key in getattr(config_class, "attribute_map", {})}
    for token in ("pad_token_id", "bos_token_id", "eos_token_id"):
        if isinstance(default.get(token), int) and shrink:
            values[token] = min(default[token], 3)
    values |= {key: 0.0 for key, value in default.items()
               if ("dropout" in key or "pdrop" in key) and isinstance(value, float)}
    return config_class(**values).to_dict()


def config_values(model_type: str) -> dict:
    """The smallest config.json values of `model_type` its config class validates: `SIZES`, else 2 layers
    (a per-layer list that the sizes leave at the default's length), else its defaults; only the model_type
    where the class rejects its own defaults (a model that needs a sub-model's config: the loader names
    the error)."""
    for sizes in (SIZES, {"num_hidden_layers": 2}, {}):
        try:
            extra = FAMILY_SIZES.get(model_type, {}) if sizes is SIZES else {}
            return tiny_values(model_type, sizes) | extra
        except Exception:  # noqa: BLE001, S112 (transformers' validation error types vary by family)
            continue
    return {"model_type": model_type}


def family_dir(tmp_path: Path, model_type: str) -> str:
    """A directory with a tiny config.json of `model_type` (`config_values`; the tiny preset of an engine
    family)."""
    if serving(model_type).path == "engine":
        from streambp_core.models.families import FAMILIES

        return "tiny/" + next((f.tiny for f in FAMILIES if f.model_type == model_type), "qwen3")
    return config_directory(tmp_path, model_type, config_values(model_type))


def answer(tmp_path: Path, model_type: str, method: str) -> str:
    """"ok" when a 64-token step of `method` simulates, else the refusal's message (ConfigError)."""
    if serving(model_type).path == "refused":
        with pytest.raises(ConfigError, match=f"architecture '{model_type}' is not supported"):
            simulate(StepSpec.of(model=family_dir(tmp_path / method, model_type), method=method,
                                 seq_len_tokens=64))
        return "refused"
    try:
        directory = family_dir(tmp_path / method, model_type)
        simulate(StepSpec.of(model=directory, method=method, seq_len_tokens=64))
    except ConfigError as error:
        return str(error)
    return "ok"


def named(model_type: str, method: str, result: str) -> bool:
    """Whether `result` (`answer`) is a run or a refusal by name: the tier's, the step's (naming the
    method, then the architecture or its class, and the cause), or transformers' own rejection of the
    config (naming the model_type)."""
    return (result in ("ok", "refused") or result.startswith(f"{method}: ")
            or f"architecture '{model_type}' is not supported: " in result
            or f"invalid {model_type} config: " in result)


def _docs_count() -> int:
    found = re.search(r"plain and checkpoint run (\d+) of them", " ".join(
        (ROOT / "docs" / "models.md").read_text(encoding="utf-8").split()))
    assert found
    return int(found.group(1))


def _docs_refused_baselines() -> set[str]:
    """The baselines families docs/models.md says plain or checkpoint refuse."""
    docs = " ".join((ROOT / "docs" / "models.md").read_text(encoding="utf-8").split())
    found = re.search(r"- plain or checkpoint refused by name \((\d+)\): (.*?)\. ", docs)
    assert found
    names = set(re.findall(r"`([^`]+)`", found.group(2).split("refused by checkpoint alone: ")[1]))
    assert len(names) == int(found.group(1))
    return names


@pytest.mark.parametrize("model_type", DEFAULT_FAMILIES)
def test_a_family_answers_or_is_refused_by_name(tmp_path, model_type):
    for method in ("plain", "checkpoint"):
        result = answer(tmp_path, model_type, method)
        assert named(model_type, method, result), result


def test_gemma4_simulates_the_baselines_and_streambp_and_mst_names_it(tmp_path):
    """streambp through Gemma 4's own layers (per-layer inputs, shared K/V) on meta tensors."""
    directory = family_dir(tmp_path, "gemma4_text")
    for method in ("plain", "checkpoint", "streambp"):
        assert simulate(StepSpec.of(model=directory, method=method, seq_len_tokens=64)).peak_bytes > 0
    with pytest.raises(ConfigError,
                       match="mst: architecture 'gemma4_text' changes the logits after its lm_head"):
        simulate(StepSpec.of(model=directory, method="mst", seq_len_tokens=64))


def test_checkpoint_refuses_a_model_without_transformers_checkpointing(tmp_path):
    assert answer(tmp_path, "ctrl", "checkpoint").startswith(
        "checkpoint: CTRLLMHeadModel does not support transformers' activation checkpointing")


def test_a_refusal_lists_what_each_method_accepts(tmp_path):
    with pytest.raises(ConfigError) as error:
        simulate(StepSpec.of(model=family_dir(tmp_path, "fuyu"), method="plain", seq_len_tokens=64))
    message = str(error.value)
    assert "a multimodal model" in message and "\n" not in message
    assert "plain and checkpoint run any decoder-only text *ForCausalLM" in message
    assert "gemma3, qwen3_5, qwen3_5_moe" in message


def test_the_recorded_count_is_at_least_80_and_the_readme_agrees():
    readme = " ".join((ROOT / "README.md").read_text(encoding="utf-8").split())
    assert _docs_count() >= 80
    assert f"plain and checkpoint run {_docs_count()} decoder-only text families" in readme


@pytest.mark.slow
def test_every_causal_lm_family_answers_and_the_count_is_recorded(tmp_path):
    runs, refused = [], set()
    for model_type in causal_families():
        results = {method: answer(tmp_path / model_type, model_type, method)
                   for method in ("plain", "checkpoint")}
        for method, result in results.items():
            assert named(model_type, method, result), (model_type, result)
        if all(result == "ok" for result in results.values()):
            runs.append(model_type)
        elif serving(model_type).path == "baselines":
            refused.add(model_type)
    assert len(runs) == _docs_count(), runs
    assert refused == _docs_refused_baselines()
