"""Packed rows through the trainers: TRL's SFTTrainer with packing (bfd) or padding_free, and transformers'
Trainer with `DataCollatorWithFlattening`, take the same three SGD steps streamed as plain (float64)."""

from __future__ import annotations

import random

import pytest
import torch

from streambp_core.config import ConfigError
from tests.unit.test_integrations import (
    VOCAB,
    assert_same_steps,
    common_args,
    datasets,
    example,
    model_dir,  # noqa: F401 (a fixture)
    plain_trainer,
    stream_trainer,
    tiny_model,
    trl,
    word_tokenizer,
    words,
)

SGD = {"optim": "sgd", "max_grad_norm": 0.0, "gradient_checkpointing": False}


def sft_texts(seed: int):
    rng = random.Random(seed)
    return datasets.Dataset.from_dict({"text": [words(rng, 3, 14) for _ in range(12)]})


@pytest.mark.parametrize(("method", "config"), [
    ("streambp", {"packing": True, "max_length": 24}),  # best-fit decreasing: documents packed into rows
    ("streambp", {"padding_free": True, "max_length": None}),  # the batch's rows flattened into one
    ("mst", {"packing": True, "max_length": 24}),
])
def test_sft_trainer_packing(tmp_path, method, config):
    data = sft_texts(4)

    def make():
        args = trl.SFTConfig(**common_args(tmp_path, **SGD, **config))
        return trl.SFTTrainer(model=tiny_model(), args=args, train_dataset=data,
                              processing_class=word_tokenizer())

    trainer = make()
    batch = next(iter(trainer.get_train_dataloader()))
    restarts = (batch["position_ids"][:, 1:] == 0).sum()
    assert restarts >= 1, "the collator packed several documents into a row"
    assert_same_steps(make, method)


def test_trainer_with_flattening_collator(tmp_path):
    from transformers import DataCollatorWithFlattening, Trainer, TrainingArguments

    rng = random.Random(5)
    data = datasets.Dataset.from_dict(
        {"input_ids": [[rng.randrange(3, VOCAB) for _ in range(rng.randrange(2, 12))] for _ in range(12)]})

    def make():
        args = TrainingArguments(**common_args(tmp_path, optim="sgd", max_grad_norm=0.0,
                                               per_device_train_batch_size=3))
        return Trainer(model=tiny_model(), args=args, train_dataset=data,
                       data_collator=DataCollatorWithFlattening())

    assert_same_steps(make)


def test_packed_forward_matches_the_model_and_checks_offsets(tmp_path):
    """The streamed decoder stack on a packed row equals the model's own (transformers' packed path);
    flash-attn's offsets may stand in for position_ids, and must agree with them when both are given."""
    trainer = plain_trainer(tmp_path)
    ids, positions = torch.tensor([[3, 4, 5, 6, 7, 8, 9]]), torch.tensor([[0, 1, 2, 0, 1, 0, 1]])
    offsets = torch.tensor([0, 3, 5, 7], dtype=torch.int32)
    own = trainer.model.model(input_ids=ids, position_ids=positions).last_hidden_state
    with stream_trainer(trainer, "streambp", partition_size=2):
        streamed = trainer.model.model(input_ids=ids, position_ids=positions, use_cache=False)
        from_offsets = trainer.model.model(input_ids=ids, cu_seq_lens_q=offsets, cu_seq_lens_k=offsets,
                                           max_length_q=3, max_length_k=3, use_cache=False)
        with pytest.raises(ConfigError, match="describe different documents"):
            trainer.model.model(input_ids=ids, position_ids=torch.tensor([[0, 1, 0, 1, 2, 0, 1]]),
                                cu_seq_lens_q=offsets, use_cache=False)
    assert torch.allclose(streamed.last_hidden_state, own, rtol=1e-12, atol=1e-12)
    assert torch.equal(from_offsets.last_hidden_state, streamed.last_hidden_state)


def test_padding_free_refused_for_sequence_trainers(tmp_path):
    rng = random.Random(3)
    data = datasets.Dataset.from_dict(
        {key: [words(rng, 3, 9) for _ in range(4)] for key in ("prompt", "chosen", "rejected")})
    args = trl.DPOConfig(**common_args(tmp_path, gradient_checkpointing=False))
    trainer = trl.DPOTrainer(model=tiny_model(), ref_model=tiny_model(), args=args, train_dataset=data,
                             processing_class=word_tokenizer())
    trainer.args.padding_free = True  # TRL 1.16 turns it off itself; a later one may not
    with pytest.raises(ConfigError, match="padding_free or packing with DPOTrainer cannot train"):
        stream_trainer(trainer, "streambp")


def test_sft_example_packs(model_dir, tmp_path, monkeypatch):  # noqa: F811 (the fixture)
    """`examples/train_sft.py --packing` trains: its config packs, and the streamed step runs on it."""
    from safetensors.torch import load_file

    argv = ["--model", str(model_dir), "--data", str(model_dir / "data.jsonl"), "--output-dir", str(tmp_path),
            "--dtype", "float32", "--max-steps", "1", "--grad-accum", "1", "--batch-size", "2",
            "--max-length", "32", "--partition-size", "4", "--packing"]
    example("train_sft", monkeypatch).main(argv)
    saved = load_file(str(tmp_path / "final" / "model.safetensors"))
    initial = load_file(str(model_dir / "model.safetensors"))
    assert saved.keys() == initial.keys()
    assert any(not torch.equal(saved[name], initial[name]) for name in initial), "the step moved weights"
