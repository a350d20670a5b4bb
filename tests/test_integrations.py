"""Trainers with a streamed model: transformers' Trainer and TRL's SFT, DPO and GRPO trainers take the same
three optimizer steps as with plain backprop (float64, tiny Qwen3, data built here, nothing downloaded)."""

from __future__ import annotations

import random

import pytest
import torch

trl = pytest.importorskip("trl", minversion="1.15")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

from streambp_core.integrations import stream_trainer  # noqa: E402
from streambp_core.models.load import build_model, tiny_config  # noqa: E402

VOCAB = 512
UPDATE_RTOL = 1e-10
STREAM = {"partition_size": 5, "head_partition_size": 7}  # several chunks per layer and head at these lengths


def word_tokenizer():
    """A whitespace word-level tokenizer over the tiny vocabulary: 'w3 w17 ...' <-> ids 3, 17, ..."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    words = {"<pad>": 0, "<s>": 1, "</s>": 2, **{f"w{i}": i for i in range(3, VOCAB)}}
    backend = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")


def words(rng: random.Random, low: int, high: int) -> str:
    return " ".join(f"w{rng.randrange(3, VOCAB)}" for _ in range(rng.randrange(low, high)))


def tiny_model(lora: bool = False):
    model = build_model(tiny_config("qwen3", pad_token_id=0), dtype=torch.float64, seed=0)
    if lora:
        config = peft.LoraConfig(r=4, lora_alpha=8, target_modules=["q_proj", "v_proj", "down_proj"],
                                 lora_dropout=0.0)
        model = peft.get_peft_model(model, config)
    return model


def common_args(tmp_path, **overrides) -> dict:
    args = dict(output_dir=str(tmp_path), per_device_train_batch_size=2, max_steps=3, learning_rate=1e-2,
                report_to=[], use_cpu=True, bf16=False, save_strategy="no", seed=0, disable_tqdm=True,
                logging_strategy="no")
    return {**args, **overrides}


def trained(make_trainer, streamed: bool, method: str = "streambp"):
    """(parameters before, after) of the trainable parameters over `trainer.train()`."""
    trainer = make_trainer()
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    if streamed:
        stream_trainer(trainer, method, **STREAM)
    trainer.train()
    after = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return before, after, trainer


def assert_same_steps(make_trainer, method: str = "streambp"):
    """Streamed and plain training move every trainable parameter by the same amount (relative 1e-10)."""
    before, plain, _ = trained(make_trainer, streamed=False)
    _, streamed, trainer = trained(make_trainer, streamed=True, method=method)
    moved = [n for n in before if not torch.equal(plain[n], before[n])]
    assert len(moved) >= len(before) // 2, "too few parameters moved for the comparison to mean anything"
    for name in before:
        step_plain, step_streamed = plain[name] - before[name], streamed[name] - before[name]
        error = (step_streamed - step_plain).norm() / step_plain.norm().clamp(min=1e-300)
        assert error <= UPDATE_RTOL or step_plain.norm() == step_streamed.norm() == 0, f"{name}: {error:.2e}"
    return trainer


def test_trainer_with_lora_and_accumulation(tmp_path):
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    rng = random.Random(0)
    data = datasets.Dataset.from_dict(
        {"input_ids": [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(6, 16))] for _ in range(12)]})
    collator = DataCollatorForLanguageModeling(word_tokenizer(), mlm=False)

    def make():
        args = TrainingArguments(**common_args(tmp_path, gradient_accumulation_steps=2, max_grad_norm=0.5))
        return Trainer(model=tiny_model(lora=True), args=args, train_dataset=data, data_collator=collator)

    assert_same_steps(make)


@pytest.mark.parametrize("method", ["streambp", "mst"])
def test_trainer_full_sgd(tmp_path, method):
    """SGD without clipping: a wrong loss scale (e.g. under accumulation) would show in every update."""
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    rng = random.Random(1)
    data = datasets.Dataset.from_dict(
        {"input_ids": [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(6, 16))] for _ in range(12)]})
    collator = DataCollatorForLanguageModeling(word_tokenizer(), mlm=False)

    def make():
        args = TrainingArguments(**common_args(tmp_path, gradient_accumulation_steps=2, optim="sgd",
                                               max_grad_norm=0.0))
        return Trainer(model=tiny_model(), args=args, train_dataset=data, data_collator=collator)

    assert_same_steps(make, method)


def test_sft_trainer_saves_checkpoints(tmp_path):
    from safetensors.torch import load_file

    rng = random.Random(2)
    data = datasets.Dataset.from_dict({"text": [words(rng, 6, 16) for _ in range(12)]})

    def make():
        args = trl.SFTConfig(**common_args(tmp_path / "out", gradient_checkpointing=False, max_grad_norm=1.0,
                                           save_strategy="steps", save_steps=3))
        return trl.SFTTrainer(model=tiny_model(), args=args, train_dataset=data,
                              processing_class=word_tokenizer())

    trainer = assert_same_steps(make)
    saved = load_file(str(tmp_path / "out" / "checkpoint-3" / "model.safetensors"))
    for name, param in trainer.model.named_parameters():
        assert torch.equal(saved[name], param.detach()), name


def test_dpo_trainer_with_accumulation(tmp_path):
    rng = random.Random(3)
    data = datasets.Dataset.from_dict(
        {key: [words(rng, 3, 9) for _ in range(8)] for key in ("prompt", "chosen", "rejected")})

    def make():
        args = trl.DPOConfig(**common_args(tmp_path, gradient_accumulation_steps=2, optim="sgd",
                                           gradient_checkpointing=False, max_grad_norm=0.0))
        return trl.DPOTrainer(model=tiny_model(), ref_model=tiny_model(), args=args, train_dataset=data,
                              processing_class=word_tokenizer())

    trainer = assert_same_steps(make)
    assert "forward" in vars(trainer.ref_model.model), "the frozen reference model's forward is streamed too"


def grpo_reward(completions, **kwargs):
    """Deterministic: how many of the completion's words have an id divisible by 3."""
    return [float(sum(int(w[1:]) % 3 == 0 for w in c.split() if w[1:].isdigit())) for c in completions]


def test_grpo_trainer_with_lora_accumulation_and_kl(tmp_path):
    """Sampling is seeded by the trainer, so both runs generate the same completions; beta > 0 scores them
    under the reference (the adapter disabled) through the streamed layers as well."""
    rng = random.Random(4)
    data = datasets.Dataset.from_dict({"prompt": [words(rng, 2, 6) for _ in range(8)]})

    def make():
        args = trl.GRPOConfig(**common_args(tmp_path, per_device_train_batch_size=4, num_generations=4,
                                            gradient_accumulation_steps=2, max_completion_length=5, beta=0.1,
                                            gradient_checkpointing=False, optim="sgd", max_grad_norm=0.0))
        return trl.GRPOTrainer(model=tiny_model(lora=True), reward_funcs=grpo_reward, args=args,
                               train_dataset=data, processing_class=word_tokenizer())

    assert_same_steps(make)
