"""Trainers with a streamed model: transformers' Trainer and TRL's SFT, DPO and GRPO trainers take the same
three optimizer steps as with plain backprop (float64, tiny Qwen3, data built here, nothing downloaded)."""

from __future__ import annotations

import importlib.util
import json
import random
from pathlib import Path

import pytest
import torch

trl = pytest.importorskip("trl", minversion="1.15")
peft = pytest.importorskip("peft")
datasets = pytest.importorskip("datasets")

from safetensors.torch import load_file  # noqa: E402

from streambp_core.config import ConfigError, StepSpec  # noqa: E402
from streambp_core.integrations import stream_trainer, trainer_settings, trainer_settings_line  # noqa: E402
from streambp_core.models.load import build_model, tiny_config  # noqa: E402
from streambp_core.verify.trainer_parity import causal_lm_loss_in_logits_dtype  # noqa: E402

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


def trained(make_trainer, streamed: bool, method: str = "streambp", **options):
    """(parameters before, after) of the trainable parameters over `trainer.train()`; a plain
    transformers Trainer computes its loss in float64 (`parity.causal_lm_loss_in_logits_dtype`), as the
    streamed run does."""
    from transformers import Trainer

    trainer = make_trainer()
    if not streamed and type(trainer) is Trainer:
        trainer.compute_loss_func = causal_lm_loss_in_logits_dtype
    before = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    if streamed:
        stream_trainer(trainer, method, **STREAM, **options)
    trainer.train()
    after = {n: p.detach().clone() for n, p in trainer.model.named_parameters() if p.requires_grad}
    return before, after, trainer


def assert_same_steps(make_trainer, method: str = "streambp", **options):
    """Streamed and plain training move every trainable parameter by the same amount (relative 1e-10)."""
    before, plain, _ = trained(make_trainer, streamed=False)
    _, streamed, trainer = trained(make_trainer, streamed=True, method=method, **options)
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


@pytest.mark.parametrize(("method", "options"), [("streambp", {}),
                                                  pytest.param("mst", {}, marks=pytest.mark.slow)])
def test_trainer_full_sgd(tmp_path, method, options):
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

    assert_same_steps(make, method, **options)


def test_sft_trainer_saves_checkpoints(tmp_path):
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


def plain_trainer(tmp_path, model=None, **overrides):
    """A transformers Trainer over a few short rows, for the refusal and undo tests."""
    from transformers import DataCollatorForLanguageModeling, Trainer, TrainingArguments

    data = datasets.Dataset.from_dict({"input_ids": [[3, 4, 5, 6], [7, 8, 9, 10]]})
    args = TrainingArguments(**common_args(tmp_path, **overrides))
    return Trainer(model=model if model is not None else tiny_model(), args=args, train_dataset=data,
                   data_collator=DataCollatorForLanguageModeling(word_tokenizer(), mlm=False))


@pytest.mark.parametrize(("setup", "named"), [
    ({"label_smoothing_factor": 0.1}, "label_smoothing_factor"),
    ({"bf16": True}, "bf16/fp16 mixed precision over float32/float64 weights"),
    ({"lora_dropout": 0.1}, "dropout (base_model.model.model.layers.0.self_attn.q_proj.lora_dropout"),
])
def test_refused_settings_are_named(tmp_path, setup, named):
    setup = dict(setup)
    model = tiny_model()
    if "lora_dropout" in setup:
        config = peft.LoraConfig(r=4, target_modules=["q_proj"], lora_dropout=setup.pop("lora_dropout"))
        model = peft.get_peft_model(model.float(), config)
    trainer = plain_trainer(tmp_path, model, **setup)
    with pytest.raises(ConfigError, match="cannot train a streambp model") as refused:
        stream_trainer(trainer, "streambp")
    assert str(refused.value).startswith(named) and "\n" not in str(refused.value)
    assert "forward" not in vars(trainer.model), "a refused trainer's model is left untouched"


def test_bad_packed_positions_are_refused_at_the_forward(tmp_path):
    """Packed rows stream (`test_packed_trainers.py`); position_ids that cannot be packed rows are refused."""
    trainer = plain_trainer(tmp_path)
    stream_trainer(trainer, "streambp")
    ids = torch.tensor([[3, 4, 5, 6]])
    with pytest.raises(ConfigError, match="increase by 1 within a document"):
        trainer.model.model(input_ids=ids, position_ids=torch.tensor([[0, 1, 3, 4]]), use_cache=False)
    with torch.no_grad():  # generation-style calls keep the model's own forward
        cached = trainer.model(input_ids=ids, use_cache=True)
    assert cached.logits.shape == (1, 4, VOCAB)


def test_close_gives_the_model_back(tmp_path):
    trainer = plain_trainer(tmp_path)
    ids = torch.tensor([[3, 4, 5, 6, 7]])
    plain_loss = trainer.model(input_ids=ids, labels=ids).loss
    with stream_trainer(trainer, "streambp", **STREAM) as stream:
        assert [run.method for run in stream.runs] == ["streambp"]
        streamed = trainer.model(input_ids=ids, labels=ids)
        assert streamed.logits is None, "the streamed loss never builds the logits"
        assert torch.allclose(streamed.loss.float(), plain_loss, rtol=1e-6)
    assert "forward" not in vars(trainer.model) and "forward" not in vars(trainer.model.model)
    assert trainer.model(input_ids=ids, labels=ids).logits.shape == (1, 5, VOCAB)


def test_bf16_mixed_precision_errs_like_plain(tmp_path):
    """bf16 weights under the trainer's bf16 autocast: the streamed gradient's error against a float64
    reference is at most twice plain bf16's (the streamed parts compute in bf16 without autocast)."""
    gen = torch.Generator().manual_seed(6)
    ids = torch.randint(3, VOCAB, (2, 24), generator=gen)
    mask = torch.ones_like(ids)
    mask[1, 18:] = 0
    labels = ids.masked_fill(mask == 0, -100)

    def gradient(model, autocast: bool):
        model.zero_grad(set_to_none=True)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            model(input_ids=ids, attention_mask=mask, labels=labels).loss.backward()
        return torch.cat([p.grad.double().flatten() for p in model.parameters()])

    reference = gradient(tiny_model(), autocast=False)
    model = tiny_model().to(torch.bfloat16)
    plain = gradient(model, autocast=True)
    stream_trainer(plain_trainer(tmp_path, model, bf16=True), "streambp", **STREAM)
    streamed = gradient(model, autocast=True)
    plain_error = (plain - reference).norm() / reference.norm()
    assert 0 < (streamed - reference).norm() / reference.norm() <= 2 * plain_error


def test_trainer_settings_for_a_measured_step():
    class Step:  # what a step spec carries
        method, partition_size, head_partition_size = "streambp", 4000, 100
        attn, baseline_attention, keep_chunks, dtype = "flash", "engine", 2, "bfloat16"

    expected = {"method": "streambp", "partition_size": 4000, "head_partition_size": 100, "attn": "flash"}
    assert trainer_settings(Step()) == expected
    assert trainer_settings("checkpoint", partition_size=4000) == {"method": "checkpoint"}
    spec = StepSpec.of(model="Qwen/Qwen3-8B", method="streambp", seq_len_tokens=100_000, partition_size=2000)
    assert trainer_settings_line(spec) == (
        'stream_trainer(trainer, "streambp", partition_size=2000, head_partition_size=100)')
    spec = StepSpec.of(model="tiny/llama", method="streambp", gpus=8, sp=8, shard="zero3", partition_size=64)
    assert trainer_settings_line(spec) == ('stream_trainer(trainer, "streambp", partition_size=64, '
                                           'head_partition_size=100, sequence_parallel=8)')
    line = trainer_settings_line("mst", partition_size=2000, head_partition_size=200)
    assert line == 'stream_trainer(trainer, "mst", partition_size=2000, head_partition_size=200)'
    with pytest.raises(ConfigError, match="unknown method"):
        trainer_settings("fast")


EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
EXAMPLE_SCRIPTS = {"train_trainer": [], "train_sft": [], "train_dpo": [],
                   "train_grpo": ["--num-generations", "2", "--max-completion-length", "4"]}


def example(name: str, monkeypatch):
    monkeypatch.syspath_prepend(str(EXAMPLES))
    spec = importlib.util.spec_from_file_location(name, EXAMPLES / f"{name}.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.parametrize("name", EXAMPLE_SCRIPTS)
def test_example_help(name, monkeypatch, capsys):
    with pytest.raises(SystemExit) as done:
        example(name, monkeypatch).main(["--help"])
    assert done.value.code == 0
    help_text = capsys.readouterr().out
    assert "--partition-size" in help_text and f"python examples/{name}.py --model" in help_text


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A local model directory as a GPU user has one (config, safetensors, tokenizer), tiny and random."""
    path = tmp_path_factory.mktemp("model")
    build_model(tiny_config("qwen3", pad_token_id=0), dtype=torch.float32).save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    rng = random.Random(5)
    rows = [{"text": words(rng, 5, 12), "prompt": words(rng, 2, 5), "completion": words(rng, 2, 5),
             "chosen": words(rng, 2, 5), "rejected": words(rng, 2, 5), "answer": "w7"} for _ in range(4)]
    (path / "data.jsonl").write_text("\n".join(json.dumps(row) for row in rows))
    return path


@pytest.mark.parametrize("name", EXAMPLE_SCRIPTS)
def test_example_trains_a_tiny_model(name, model_dir, tmp_path, monkeypatch):
    argv = ["--model", str(model_dir), "--data", str(model_dir / "data.jsonl"), "--output-dir", str(tmp_path),
            "--dtype", "float32", "--max-steps", "1", "--grad-accum", "1", "--batch-size", "2",
            "--max-length", "32", "--partition-size", "4", "--head-partition-size", "5"]
    example(name, monkeypatch).main(argv + EXAMPLE_SCRIPTS[name])
    saved = load_file(str(tmp_path / "final" / "model.safetensors"))
    initial = load_file(str(model_dir / "model.safetensors"))
    assert saved.keys() == initial.keys()


def _sft_argv(model: str, data: Path, output: Path) -> list[str]:
    return ["--model", model, "--data", str(data), "--output-dir", str(output), "--dtype", "float32",
            "--max-steps", "1", "--grad-accum", "1", "--max-length", "32", "--partition-size", "4"]


@pytest.mark.parametrize("where", ["preset", "config-only directory"])
def test_an_example_trains_offline_with_the_byte_tokenizer_where_the_model_has_none(
        where, model_dir, tmp_path, monkeypatch, capsys):
    model = "tiny/qwen3"
    if where != "preset":
        model = str(tmp_path / "config-only")
        Path(model).mkdir()
        (Path(model) / "config.json").write_text((model_dir / "config.json").read_text())
    data = tmp_path / "text.jsonl"
    data.write_text('{"text": "héllo wörld, any UTF-8 text"}\n{"text": "日本語 too"}\n')
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    example("train_sft", monkeypatch).main(_sft_argv(model, data, tmp_path / "out"))
    notes = [line for line in capsys.readouterr().err.splitlines() if line.startswith("note:")]
    assert len(notes) == 1 and "byte tokenizer" in notes[0], notes
    assert (tmp_path / "out" / "final" / "model.safetensors").is_file()


def test_a_model_too_big_for_this_machines_ram_is_refused_before_it_is_built(
        model_dir, tmp_path, monkeypatch, capsys):
    from streambp_core.measure import host_ram

    monkeypatch.setattr(host_ram, "available_ram_bytes", lambda: 2**30)
    with pytest.raises(SystemExit) as done:
        example("train_sft", monkeypatch).main(_sft_argv("meta-llama/Llama-3.1-8B", model_dir / "data.jsonl",
                                                         tmp_path / "out"))
    lines = capsys.readouterr().err.strip().splitlines()
    assert done.value.code == 2 and lines[-1].startswith("error: --model meta-llama/Llama-3.1-8B: 8.03B")
    assert "1.0 GiB of RAM available" in lines[-1] and not (tmp_path / "out").exists()
