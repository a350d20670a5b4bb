"""The trainer settings for a measured step: what to pass to `stream_trainer` to train at that length.

Pure Python (no torch), so the CLI can print them next to a max-length result.
"""

from __future__ import annotations

from dataclasses import fields

from streambp_core.config import StreamConfig, check_method
from streambp_core.registry import METHOD_CLASSES, method_class
from streambp_core.tiers import Tiers

TRAINER_KINDS = ("trainer", "sft", "dpo", "grpo")
"""Trainers a parity check builds: transformers' `Trainer`, TRL's SFT, DPO and GRPO trainers."""
PARITY_DATA_KINDS = ("text", "prompt-completion")
"""Rows a parity check trains on (GRPO trains on prompts whatever is asked)."""
NOT_FOR_TRAINERS = ("objective", "baseline_attention", "keep_chunks", "baseline_loss")
"""StreamConfig fields a trainer does not take: the objective is the trainer's own loss; the others only
matter to measurement and simulation, never to a real training step."""
KNOWN_OPTIONS = {name for cls in METHOD_CLASSES for name in cls.options} | set(NOT_FOR_TRAINERS)
"""Every field a method reads (`registry.Method.options`) and every field no trainer takes."""


def trainer_settings(spec_or_method, **options) -> dict[str, object]:
    """{'method': ..., option: value, ...} for `stream_trainer(trainer, **settings)`.

    `spec_or_method` is a method name (options as keywords), a step spec (its `stream`), or any object with
    a `method` attribute and StreamConfig fields as attributes. Fields a method does not read are left out;
    so are fields at their default, except the partition sizes, which are always shown for the methods
    that read them. StreamConfig fields added later (e.g. offload) are passed on when set (a tier set as
    its canonical string). A step spec with sp > 1 adds `sequence_parallel` (`sequence_trainer`).
    """
    if isinstance(spec_or_method, str):
        method, values = spec_or_method, dict(options)
    else:
        method = spec_or_method.method
        held = getattr(spec_or_method, "stream", spec_or_method)  # a StepSpec holds its StreamConfig
        values = {f.name: getattr(held, f.name) for f in fields(StreamConfig) if hasattr(held, f.name)}
        values.update(options)
    check_method(method)
    config = StreamConfig(**values)
    read = set(method_class(method).options)
    settings: dict[str, object] = {"method": method}
    for field in fields(StreamConfig):
        value = getattr(config, field.name)
        if field.name in read:
            if value != field.default or field.name.endswith("partition_size"):
                settings[field.name] = _setting(value)
        elif field.name not in KNOWN_OPTIONS and value != field.default:
            settings[field.name] = _setting(value)
    sp = 1 if isinstance(spec_or_method, str) else getattr(spec_or_method, "sp", 1)
    if isinstance(sp, int) and sp > 1:
        settings["sequence_parallel"] = sp
    return settings


def _setting(value: object) -> object:
    """A setting as `stream_trainer` takes it: a tier set as its canonical string, anything else as is."""
    return str(value) if isinstance(value, Tiers) else value


def trainer_settings_line(spec_or_method, **options) -> str:
    """The one call to make, as text: `stream_trainer(trainer, "streambp", partition_size=2000, ...)`."""
    settings = trainer_settings(spec_or_method, **options)
    method = settings.pop("method")
    arguments = "".join(f", {name}={value!r}" for name, value in settings.items())
    return f'stream_trainer(trainer, "{method}"{arguments})'
