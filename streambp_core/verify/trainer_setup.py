"""Trainers for a parity check, built as a user builds them: the model by transformers' own
`AutoModelForCausalLM.from_pretrained` (a directory with weights) or `from_config` (a preset, a config,
a directory without weights), the trainer by its own constructor with the user's settings by name.

The data are random words over the model's vocabulary ("w17" is token 17) through a word-level tokenizer,
so any model can be checked without its tokenizer or a dataset: plain text or prompt-completion rows for
`Trainer` and SFT, preference rows (an explicit prompt, or an implicit one shared by chosen and rejected)
for DPO, prompts scored by a deterministic reward for GRPO.
"""

from __future__ import annotations

import contextlib
import copy
import random
from collections.abc import Callable
from dataclasses import dataclass, field, fields
from pathlib import Path

import torch

from streambp_core.config import ConfigError
from streambp_core.integrations.settings import PARITY_DATA_KINDS as DATA_KINDS
from streambp_core.integrations.settings import TRAINER_KINDS

SPECIAL_TOKENS = {"<pad>": 0, "<s>": 1, "</s>": 2}
DEFAULT_SETTINGS = {"max_steps": 3, "per_device_train_batch_size": 2, "learning_rate": 1e-2, "optim": "sgd",
                    "report_to": [], "save_strategy": "no", "logging_strategy": "no", "disable_tqdm": True,
                    "bf16": False, "fp16": False}
"""Trainer settings of a parity run unless the user's settings say otherwise."""
GRPO_SETTINGS = {"per_device_train_batch_size": 4, "num_generations": 4, "max_completion_length": 5}
"""GRPO settings over DEFAULT_SETTINGS: one group of 4 completions per prompt, each up to 5 tokens."""
LORA_TARGETS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "qkv_proj",
                "gate_up_proj")


@dataclass(frozen=True, kw_only=True)
class ParitySetup:
    """What to build: the trainer kind, the model, the data and the trainer's settings by name."""

    trainer: str = "sft"
    """One of TRAINER_KINDS: transformers' `Trainer` or TRL's SFT, DPO or GRPO trainer."""
    model: object = "tiny/qwen3"
    """A preset name, a local directory (with or without weights) or a transformers config."""
    dtype: torch.dtype = torch.float64
    data: str = "text"
    """One of DATA_KINDS (GRPO trains on prompts whatever this says)."""
    lora_rank: int = 0
    """0: full-parameter training; R > 0: LoRA adapters of rank R on every projection, as the trainer's
    `peft_config` (TRL) or through `peft.get_peft_model` (`Trainer`)."""
    seq_len_tokens: int = 16
    """The longest row; rows are 6 tokens to this long."""
    rows: int = 12
    seed: int = 0
    device: str = "cpu"
    settings: dict = field(default_factory=dict)
    """`TrainingArguments` / TRL config fields by name (e.g. weight_decay=0.1), over DEFAULT_SETTINGS."""
    zero3_init: bool = False
    """Under a DeepSpeed ZeRO-3 config: build each model after its trainer's arguments, so transformers
    loads it into `deepspeed.zero.Init` (partitioned as it loads, as accelerate's `zero3_init_flag: true`
    does). Needs a directory with weights (zero.Init draws other random weights than a reference built
    without it) and float32 (zero.Init casts the weights it partitions to its config's dtype)."""

    def __post_init__(self) -> None:
        if self.trainer not in TRAINER_KINDS:
            raise ConfigError(f"unknown trainer {self.trainer!r}; choose from {', '.join(TRAINER_KINDS)}")
        if self.data not in DATA_KINDS:
            raise ConfigError(f"unknown data {self.data!r}; choose from {', '.join(DATA_KINDS)}")
        if self.seq_len_tokens < 8:
            raise ConfigError(f"seq_len must be at least 8 for a parity run, got {self.seq_len_tokens}")
        if self.lora_rank < 0:
            raise ConfigError(f"lora rank must be >= 0, got {self.lora_rank}")
        _refuse_training_nothing(self.settings)
        if self.zero3_init:
            from streambp_core.models.load import has_weights

            if not (isinstance(self.model, str | Path) and has_weights(self.model)):
                raise ConfigError("zero3 init needs a model directory with weights: zero.Init draws other "
                                  "random weights than a model built without it")
            if self.dtype != torch.float32:
                raise ConfigError(f"zero3 init trains in float32 (zero.Init casts the weights it partitions "
                                  f"to its config's dtype), got {self.dtype}")


def _refuse_training_nothing(settings: dict) -> None:
    """ConfigError for settings under which the trainer moves no parameter (a zero learning rate, zero
    steps, or no steps and zero epochs): every update would be zero, and any method would match plain."""
    steps, epochs = settings.get("max_steps", DEFAULT_SETTINGS["max_steps"]), settings.get("num_train_epochs")
    nothing = "trains nothing (every update is zero, so any method would match plain)"
    if settings.get("learning_rate") == 0:
        raise ConfigError(f"learning_rate=0 {nothing}: give a nonzero learning rate")
    if steps == 0:
        raise ConfigError(f"max_steps=0 {nothing}: give at least one step")
    if isinstance(steps, int | float) and steps < 0 and epochs == 0:
        raise ConfigError(f"num_train_epochs=0 with max_steps={steps} {nothing}: give at least one step")


def trainer_factory(setup: ParitySetup, output_dir: str | Path) -> Callable[[], object]:
    """A function that builds a fresh trainer for `setup` each call: the same weights, data and settings."""
    trainer_class, config_class = _classes(setup.trainer)
    config = _model_config(setup.model)
    tokenizer = word_tokenizer(config.vocab_size)
    dataset = parity_dataset(setup, config.vocab_size)
    arguments = _arguments(setup, config_class, str(output_dir))

    _user_input(config_class.__name__, config_class, **arguments)  # a bad setting fails before any model

    def make():
        args = config_class(**arguments)  # first: with `zero3_init`, its ZeRO-3 config is live as models load
        model = build_user_model(setup.model, setup.dtype, setup.seed, setup.device, setup.zero3_init)
        ref_model = None
        if setup.trainer == "dpo" and not setup.lora_rank:
            ref_model = build_user_model(setup.model, setup.dtype, setup.seed, setup.device, setup.zero3_init)
        if setup.zero3_init and not all(hasattr(p, "ds_id") for p in model.parameters()):
            raise ConfigError("zero3 init: the model was not partitioned as it loaded (no DeepSpeed ZeRO-3 "
                              "config in the trainer's settings)")
        trainer = _user_input(trainer_class.__name__, _build, model, ref_model, args)
        _without_printed_logs(trainer)
        return trainer

    def _build(model, ref_model, args):
        if setup.trainer == "trainer":
            return _transformers_trainer(trainer_class, model, args, dataset, tokenizer, setup.lora_rank)
        extra = {"peft_config": lora_config(setup.lora_rank)} if setup.lora_rank else {}
        if ref_model is not None:
            extra["ref_model"] = ref_model
        if setup.trainer == "grpo":
            extra["reward_funcs"] = word_reward
        return trainer_class(model=model, args=args, train_dataset=dataset, processing_class=tokenizer,
                             **extra)

    return make


def run_parity(setup: ParitySetup, methods=None, **options) -> list:
    """`trainer_parity` on the trainers `setup` describes (outputs in a temporary directory): one
    `MethodParity` per method. ConfigError for a setting the trainer or `stream_trainer` refuses."""
    import tempfile

    from streambp_core.verify.trainer_parity import STREAM_METHODS, trainer_parity, update_tolerance

    try:
        update_tolerance("sgd", setup.dtype)
    except ValueError as error:
        raise ConfigError(str(error)) from None
    with tempfile.TemporaryDirectory(prefix="streambp-parity-") as output_dir:
        return trainer_parity(trainer_factory(setup, output_dir), methods or STREAM_METHODS, **options)


def _without_printed_logs(trainer) -> None:
    """Remove the callbacks that print the trainer's logs and progress to stdout (a parity run reports
    its own figures)."""
    from transformers.trainer_callback import PrinterCallback, ProgressCallback

    trainer.remove_callback(PrinterCallback)
    trainer.remove_callback(ProgressCallback)


def _user_input(name: str, function, *args, **kwargs):
    """`function(*args, **kwargs)`, with the ValueError/TypeError a trainer or its config raises for a
    bad setting as a ConfigError on one line starting with `name`."""
    try:
        return function(*args, **kwargs)
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{name}: {' '.join(str(error).split())}") from None


def build_user_model(model, dtype: torch.dtype, seed: int, device: str = "cpu", zero3_init: bool = False):
    """The model as a user builds it: `from_pretrained` for a directory with weights, else `from_config`
    with random weights drawn after `torch.manual_seed(seed)`, from a copy of the config. Outside
    `deepspeed.zero.Init` (`_outside_zero3_init`) unless `zero3_init` (`ParitySetup.zero3_init`).

    As `streambp_core.models.load.build_model` builds it: a mixture of experts in float64 runs the
    per-expert loop (`experts_options`: grouped matmuls refuse float64), and the float32 islands compute in
    at least float32 (`models.precision.float32_islands_widened`), so plain training, the reference, is as
    precise as the streamed runs (which widen a hybrid model's islands while they are open).

    The copy matters: `from_config` keeps the config object it is given, and TRL's trainers write the
    tokenizer's pad id into `model.config` when they are built; a second model from the same config
    object would then get an embedding with `padding_idx` (that row zeroed at init and never trained),
    so runs compared against each other would train different models.
    """
    from transformers import AutoModelForCausalLM

    from streambp_core.models.load import experts_options, has_weights
    from streambp_core.models.precision import float32_islands_widened

    config = _model_config(model)
    experts = experts_options(config, dtype)
    if isinstance(model, str | Path) and has_weights(model):
        with contextlib.nullcontext() if zero3_init else _outside_zero3_init():
            loaded = AutoModelForCausalLM.from_pretrained(str(model), dtype=dtype, local_files_only=True,
                                                          **experts)
        return float32_islands_widened(loaded if zero3_init else loaded.to(device))
    torch.manual_seed(seed)
    with torch.device(device), _outside_zero3_init():
        return float32_islands_widened(AutoModelForCausalLM.from_config(config, dtype=dtype, **experts))


@contextlib.contextmanager
def _outside_zero3_init():
    """transformers builds a model under `deepspeed.zero.Init` while a ZeRO-3 config it was given lives
    (a trainer's arguments, accelerate's plugin): zero.Init draws other initial weights than the
    reference's, and casts the weights it partitions to its config's dtype (float32 without an fp16 or
    bf16 section, whatever the weights' own), so a model loaded from weights after the first trainer's
    arguments exist would train in another precision than the one before it. Every model of a parity
    run is built without it, the config given back after."""
    from transformers.integrations import deepspeed as hf_deepspeed

    held = hf_deepspeed._hf_deepspeed_config_weak_ref
    hf_deepspeed.unset_hf_deepspeed_config()
    try:
        yield
    finally:
        hf_deepspeed._hf_deepspeed_config_weak_ref = held


def _model_config(model):
    from transformers import PretrainedConfig

    from streambp_core.models.load import check_supported, load_config

    if isinstance(model, PretrainedConfig):
        return check_supported(copy.deepcopy(model))
    return load_config(str(model))


def word_tokenizer(vocab_size: int):
    """A whitespace word-level tokenizer: 'w3 w17' <-> ids 3, 17 (0, 1, 2: pad, bos, eos)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    if vocab_size < 16:
        raise ConfigError(f"a parity run needs a vocabulary of at least 16 tokens, got {vocab_size}")
    words = {**SPECIAL_TOKENS, **{f"w{i}": i for i in range(len(SPECIAL_TOKENS), vocab_size)}}
    backend = Tokenizer(models.WordLevel(vocab=words, unk_token="<pad>"))
    backend.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    backend.decoder = decoders.WordPiece()
    return PreTrainedTokenizerFast(tokenizer_object=backend, pad_token="<pad>", bos_token="<s>",
                                   eos_token="</s>")


def parity_dataset(setup: ParitySetup, vocab_size: int):
    """The rows a `setup.trainer` trains on (see the module docstring), drawn from `setup.seed`."""
    import datasets

    rng = random.Random(setup.seed)
    low, high = len(SPECIAL_TOKENS), vocab_size
    half = max(3, setup.seq_len_tokens // 2)

    def ids(lo: int, hi: int) -> list[int]:
        return [rng.randrange(low, high) for _ in range(rng.randrange(lo, hi + 1))]

    def text(lo: int, hi: int) -> str:
        return " ".join(f"w{i}" for i in ids(lo, hi))

    rows = range(setup.rows)
    if setup.trainer == "trainer":
        prompts = [ids(2, half - 1) if setup.data == "prompt-completion" else [] for _ in rows]
        tokens = [p + ids(4, setup.seq_len_tokens - len(p)) for p in prompts]
        labels = [[-100] * len(p) + t[len(p):] for p, t in zip(prompts, tokens, strict=True)]
        return datasets.Dataset.from_dict({"input_ids": tokens, "labels": labels})
    if setup.trainer == "sft" and setup.data == "text":
        return datasets.Dataset.from_dict({"text": [text(6, setup.seq_len_tokens - 1) for _ in rows]})
    if setup.trainer == "sft":
        return datasets.Dataset.from_dict({"prompt": [text(2, half - 1) for _ in rows],
                                           "completion": [" " + text(2, half - 1) for _ in rows]})
    if setup.trainer == "grpo":
        return datasets.Dataset.from_dict({"prompt": [text(2, half - 1) for _ in rows]})
    prompts = [text(2, half - 2) for _ in rows]
    chosen = [" " + text(2, half - 1) for _ in rows]
    rejected = [" " + text(2, half - 1) for _ in rows]
    if setup.data == "text":  # the implicit prompt: TRL finds the shared prefix
        joined = {key: [p + c for p, c in zip(prompts, rows, strict=True)]
                  for key, rows in (("chosen", chosen), ("rejected", rejected))}
        return datasets.Dataset.from_dict(joined)
    return datasets.Dataset.from_dict({"prompt": prompts, "chosen": chosen, "rejected": rejected})


def word_reward(completions, **kwargs) -> list[float]:
    """A deterministic GRPO reward: how many of a completion's words have an id divisible by 3."""
    return [float(sum(int(w[1:]) % 3 == 0 for w in c.split() if w[1:].isdigit())) for c in completions]


def lora_config(rank: int):
    """LoRA of rank `rank` (alpha 2 x rank, no dropout) on every attention and MLP projection."""
    import peft

    return peft.LoraConfig(r=rank, lora_alpha=2 * rank, target_modules=list(LORA_TARGETS), lora_dropout=0.0,
                           task_type="CAUSAL_LM")


def _classes(kind: str):
    if kind == "trainer":
        from transformers import Trainer, TrainingArguments

        return Trainer, TrainingArguments
    import trl

    names = {"sft": "SFT", "dpo": "DPO", "grpo": "GRPO"}[kind]
    return getattr(trl, f"{names}Trainer"), getattr(trl, f"{names}Config")


def _arguments(setup: ParitySetup, config_class, output_dir: str) -> dict:
    known = {f.name for f in fields(config_class)}
    unknown = sorted(set(setup.settings) - known)
    if unknown:
        raise ConfigError(f"unknown {config_class.__name__} setting(s): {', '.join(unknown)}")
    grpo = GRPO_SETTINGS if setup.trainer == "grpo" else {}
    return {**DEFAULT_SETTINGS, **grpo, "seed": setup.seed, "use_cpu": setup.device == "cpu",
            **setup.settings, "output_dir": output_dir}


def _transformers_trainer(trainer_class, model, args, dataset, tokenizer, lora_rank: int):
    from transformers import DataCollatorForSeq2Seq

    if lora_rank:
        import peft

        model = peft.get_peft_model(model, lora_config(lora_rank))
    collator = DataCollatorForSeq2Seq(tokenizer, label_pad_token_id=-100)
    return trainer_class(model=model, args=args, train_dataset=dataset, data_collator=collator)
