"""A user's own TRL script, written as a user writes it (not through the project's parity setup): SFTTrainer,
prompt-completion rows, gradient accumulation 3, SGD with weight decay and clipping, float64, a tied GQA
Llama from `AutoModelForCausalLM.from_config`. Trained with and without `stream_trainer`, the updates agree
to 1e-10 when each model has its own config; when the second model is built from the config object the
first trainer changed (`from_config` keeps it, the trainer aligns its pad token), the two models differ
before any method runs, and `stream_trainer` says so in one line instead of training it."""

from __future__ import annotations

import copy
import random

import pytest
import torch

pytest.importorskip("trl", minversion="1.15")
datasets = pytest.importorskip("datasets")

from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedTokenizerFast  # noqa: E402
from trl import SFTConfig, SFTTrainer  # noqa: E402

from streambp_core.config import ConfigError  # noqa: E402
from streambp_core.integrations import stream_trainer  # noqa: E402

VOCAB = 512


pytestmark = pytest.mark.usefixtures("one_thread")


def user_tokenizer() -> PreTrainedTokenizerFast:
    from tokenizers import Tokenizer, models, pre_tokenizers

    vocab = {f"w{i}": i for i in range(VOCAB - 12)} | {"<pad>": VOCAB - 12, "<eos>": VOCAB - 11,
                                                      "<unk>": VOCAB - 10}
    backend = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    backend.pre_tokenizer = pre_tokenizers.Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", eos_token="<eos>",
                                   unk_token="<unk>")


def user_rows(count: int = 12):
    rng = random.Random(0)

    def text(low: int, high: int) -> str:
        return " ".join(f"w{rng.randrange(VOCAB - 12)}" for _ in range(rng.randint(low, high)))

    rows = [{"prompt": text(5, 20), "completion": text(5, 30)} for _ in range(count)]
    return datasets.Dataset.from_list(rows)


def user_config() -> LlamaConfig:
    return LlamaConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True)


def user_trainer(config, output_dir) -> SFTTrainer:
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float64)
    args = SFTConfig(output_dir=str(output_dir), per_device_train_batch_size=2, gradient_accumulation_steps=3,
                     max_steps=2, learning_rate=0.1, optim="sgd", weight_decay=0.1, max_grad_norm=0.1,
                     lr_scheduler_type="constant", bf16=False, use_cpu=True, report_to=[],
                     save_strategy="no", logging_steps=1, disable_tqdm=True, seed=0)
    return SFTTrainer(model=model, args=args, train_dataset=user_rows(), processing_class=user_tokenizer())


def trained(trainer) -> dict[str, torch.Tensor]:
    trainer.train()
    return {name: p.detach().clone() for name, p in trainer.model.named_parameters()}


def test_the_users_script_trains_streambp_to_plains_update_with_a_config_each(tmp_path) -> None:
    config = user_config()
    before = {name: p.detach().clone() for name, p in user_trainer(copy.deepcopy(config), tmp_path)
              .model.named_parameters()}
    plain = trained(user_trainer(copy.deepcopy(config), tmp_path))
    streamed = user_trainer(copy.deepcopy(config), tmp_path)
    with stream_trainer(streamed, "streambp", partition_size=5, head_partition_size=7):
        streamed = trained(streamed)
    for name, value in plain.items():
        moved = (value - before[name]).norm()
        assert moved > 0, name  # every parameter trained
        assert (streamed[name] - value).norm() <= 1e-10 * moved, name


def test_a_model_built_from_the_config_a_first_trainer_changed_is_refused_in_one_line(tmp_path) -> None:
    config = user_config()
    first = user_trainer(config, tmp_path)  # aligns config.pad_token_id with the tokenizer's <pad>
    second = user_trainer(config, tmp_path)  # the same config object: its embedding has a padding row
    assert first.model.config is second.model.config
    for trainer, here, there in ((second, VOCAB - 12, None), (first, None, VOCAB - 12)):
        with pytest.raises(ConfigError) as refused:
            stream_trainer(trainer, "streambp", partition_size=5)
        message = str(refused.value)
        assert "\n" not in message and "copy.deepcopy(config)" in message
        assert f"padding_idx {here} here, {there} there" in message
