"""Trainer parity: the parameters a trainer moves with `stream_trainer` against those it moves without.

    results = trainer_parity(make_trainer, ("checkpoint", "mst", "streambp"), partition_size=64)
    for result in results:
        print(result.method, result.ok, [(g.group, g.rel_error) for g in result.groups])

`make_trainer()` builds a fresh trainer (a new model, the same initial weights and data each call). The
plain run trains one; each method trains another after `stream_trainer(trainer, method, ...)`. Each
trainable parameter's update (after - before) is compared with plain's, per group of parameters
(embedding, attention, mlp, norms, lm_head; LoRA adapters as their own groups):
error = ||update - update_plain|| / ||update_plain|| over the group's parameters taken together.

Tolerances (`update_tolerance`): with SGD an update is the learning rate times the gradient (plus weight
decay, the same in both runs), so the update error is the gradient's error: 1e-10 in float64, as
`verify`'s gradient check. Adam divides each gradient entry by sqrt(v) + eps: an entry whose gradient is
near zero (|g| ~ eps) turns an absolute rounding difference e (~1e-16 x the largest gradient in float64)
into an update difference of lr * e / eps, where SGD gives lr * e. With eps = 1e-8 and gradients of order
one, that amplification is up to 1e8, so float64 Adam runs are held to 1e-10 x 1e4 = 1e-6: far below any
real fault (a wrong gradient moves the update by percent), and above what Adam's normalisation of
near-zero gradients makes of rounding.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

import torch

from streambp_core.config import VERIFY_METHODS, ConfigError
from streambp_core.integrations.checks import check_trainer
from streambp_core.integrations.trainers import stream_trainer
from streambp_core.registry import method_class

STREAM_METHODS = VERIFY_METHODS
"""The methods a parity check compares with plain when none are named: every one but the reference."""
SGD_RTOL = {"float64": 1e-10, "float32": 1e-4}
"""Relative update tolerance with SGD: the gradient tolerance of `verify` in that dtype."""
ADAM_AMPLIFICATION = 1e4
"""How much more Adam's tolerance allows than SGD's (see the module docstring)."""
SGD_OPTIMIZERS = ("sgd",)
"""`TrainingArguments.optim` values whose update is linear in the gradient."""
GROUP_PATTERNS = (
    ("lora", r"lora_"),
    ("embedding", r"embed_tokens"),
    ("lm_head", r"lm_head"),
    ("norms", r"norm"),
    ("attention", r"self_attn"),
    ("mlp", r"mlp"),
)
"""(group, pattern) in the order they are tried against a parameter's name; the first match names it."""


@dataclass(frozen=True)
class GroupError:
    """One group of parameters: its update error against plain and the parameter that errs most."""

    group: str
    rel_error: float
    """||update - update_plain|| / ||update_plain|| over the group (inf when plain moved none of it but
    the method did; 0 when neither moved it)."""
    worst_parameter: str
    worst_rel_error: float
    plain_update_norm: float
    parameters: int
    """How many parameter tensors the group holds."""


@dataclass(frozen=True)
class MethodParity:
    """One method's run against the plain run."""

    method: str
    groups: tuple[GroupError, ...]
    tolerance: float

    @property
    def max_rel_error(self) -> float:
        return max((g.rel_error for g in self.groups), default=0.0)

    @property
    def ok(self) -> bool:
        return self.max_rel_error <= self.tolerance

    def to_dict(self) -> dict:
        return {"method": self.method, "ok": self.ok, "tolerance": self.tolerance,
                "max_rel_error": self.max_rel_error, "groups": [asdict(g) for g in self.groups]}


def update_tolerance(optim: str, dtype: torch.dtype) -> float:
    """The relative update tolerance for `optim` (a `TrainingArguments.optim` value) in `dtype`."""
    name = str(dtype).removeprefix("torch.")
    if name not in SGD_RTOL:
        raise ValueError(f"no parity tolerance for {name}: compare float64 (or float32) runs")
    sgd = SGD_RTOL[name]
    return sgd if getattr(optim, "value", optim) in SGD_OPTIMIZERS else sgd * ADAM_AMPLIFICATION


def trainer_parity(make_trainer: Callable[[], object], methods: Sequence[str] = STREAM_METHODS, *,
                   tolerance: float | None = None, **options) -> list[MethodParity]:
    """Train plain once and with each of `methods` once (each on a trainer from `make_trainer()`), and
    compare every trainable parameter's update with plain's, per group (see the module docstring).

    `options` go to `stream_trainer` (partition_size, head_partition_size, ...). `tolerance` defaults to
    `update_tolerance` of the trainer's optimizer and the model's dtype.
    """
    probe = make_trainer()
    for method in methods:  # a refused setting fails before anything trains
        check_trainer(probe, method)
    check_optimizer(probe)
    del probe
    plain, tied, trainer = train_updates(make_trainer, None, options)
    check_reference("plain training", plain)
    if tolerance is None:
        tolerance = update_tolerance(trainer.args.optim, next(trainer.model.parameters()).dtype)
    del trainer
    results = []
    for method in methods:
        updates, _, _ = train_updates(make_trainer, method, options)
        results.append(MethodParity(method, group_errors(plain, updates, tied), tolerance))
    return results


class BrokenReference(RuntimeError):
    """The reference training's own update is not finite: no method can be judged against it."""


def check_optimizer(trainer) -> None:
    """ConfigError, before anything trains, for a setting `trainer`'s optimizer refuses (torch checks its
    hyper-parameters as it builds one: a beta outside [0, 1), a negative learning rate or epsilon). Builds
    the optimizer on `trainer`, which is then for probing only (under FSDP the trainer builds its own
    after wrapping the model)."""
    try:
        trainer.create_optimizer()
    except (ValueError, TypeError) as error:
        raise ConfigError(f"{type(trainer).__name__}'s optimizer: {' '.join(str(error).split())}") from None


def check_reference(name: str, updates: dict[str, torch.Tensor]) -> None:
    """Refuse a reference no comparison can mean anything against: ConfigError when `name` (a training the
    methods are compared with) moved no parameter at all (every update exactly zero: any method would
    match it), BrokenReference when an update holds NaN or infinity (the reference itself is broken,
    not the method)."""
    broken = next((n for n, u in updates.items() if not bool(torch.isfinite(u).all())), None)
    if broken is not None:
        raise BrokenReference(f"the reference, {name}, trained to a non-finite update ({broken}): no method "
                              "can be judged against it")
    if not any(bool(u.any()) for u in updates.values()):
        raise ConfigError(f"{name} moved no parameter (every update exactly zero), so any method would "
                          "match it: train with a nonzero learning rate for at least one step")


def train_updates(make_trainer, method: str | None, options: dict):
    """({name: update} of the trainable parameters, whether the embedding is tied, the trainer) over one
    `trainer.train()`, plain (`method` None) or with `stream_trainer(trainer, method, **options)`."""
    trainer = make_trainer()
    if method is None or not method_class(method).drives_modules:  # the model's own logits and loss
        float64_reference_loss(trainer)
    model = trainer.model
    before = full_tensors({n: p for n, p in model.named_parameters() if p.requires_grad})
    stream = None if method is None else stream_trainer(trainer, method, **options)
    try:
        trainer.train()
    finally:
        if stream is not None:
            stream.close()
    after = full_tensors({n: p for n, p in model.named_parameters() if n in before})
    updates = {n: after[n] - before[n] for n in before}
    return updates, _tied(model), trainer


def full_tensor(param: torch.Tensor) -> torch.Tensor:
    """A parameter's whole value, detached: FSDP2's sharded ones all-gathered (a collective)."""
    value = param.detach()
    return value.full_tensor() if hasattr(value, "full_tensor") else value


def full_tensors(params: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """{name: whole value, a detached copy on the CPU}: FSDP2's shards and DeepSpeed ZeRO-3's partitions
    all-gathered (collectives, in the same order on every rank)."""
    partitioned = [p for p in params.values() if hasattr(p, "ds_id")]
    if not partitioned:
        return {n: full_tensor(p).to("cpu", copy=True) for n, p in params.items()}
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned):
        return {n: full_tensor(p).to("cpu", copy=True) for n, p in params.items()}


def float64_reference_loss(trainer) -> None:
    """Give a plain `transformers.Trainer` on a float64 model a float64 causal-LM loss.

    transformers' causal-LM loss computes in `logits.float()` (an upcast meant for bf16), which rounds a
    float64 model's logits to float32, so its gradients are float32-accurate; the streamed loss (mst,
    streambp) computes in the weights' dtype. Plain and checkpoint runs, which keep the model's logits,
    then compute the same loss in float64. Other trainers (TRL's) compute
    their losses in the weights' dtype already; a trainer with its own `compute_loss_func` keeps it.
    """
    from transformers import Trainer

    model_dtype = next(trainer.model.parameters()).dtype
    if type(trainer) is Trainer and trainer.compute_loss_func is None and model_dtype == torch.float64:
        trainer.compute_loss_func = causal_lm_loss_in_logits_dtype


def causal_lm_loss_in_logits_dtype(outputs, labels, num_items_in_batch=None):
    """transformers' causal-LM loss (shifted labels, -100 ignored, the sum over `num_items_in_batch` when
    given, else the mean) in the logits' own dtype."""
    logits = outputs.logits[:, :-1].reshape(-1, outputs.logits.shape[-1])
    targets = labels[:, 1:].reshape(-1).to(logits.device)
    if num_items_in_batch is None:
        return torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100)
    total = torch.nn.functional.cross_entropy(logits, targets, ignore_index=-100, reduction="sum")
    return total / num_items_in_batch


def group_errors(plain: dict, updates: dict, tied: bool = False) -> tuple[GroupError, ...]:
    """Per group, the relative error of `updates` against `plain` (both {name: update tensor})."""
    groups: dict[str, list[str]] = {}
    for name in plain:
        groups.setdefault(parameter_group(name, tied), []).append(name)
    return tuple(_group_error(group, names, plain, updates) for group, names in groups.items())


def parameter_group(name: str, tied: bool = False) -> str:
    """The group a parameter's name belongs to (LoRA adapters as 'lora <group of the wrapped module>')."""
    group = next((g for g, pattern in GROUP_PATTERNS[1:] if re.search(pattern, name)), "other")
    if tied and group == "embedding":
        group = "embedding = lm_head (tied)"
    return f"lora {group}" if re.search(GROUP_PATTERNS[0][1], name) else group


def _group_error(group: str, names: list[str], plain: dict, updates: dict) -> GroupError:
    worst_name, worst = names[0], -1.0
    diff_sq = plain_sq = 0.0
    for name in names:
        step_plain, step = plain[name].double(), updates[name].double()
        d, p = float((step - step_plain).norm()) ** 2, float(step_plain.norm()) ** 2
        diff_sq, plain_sq = diff_sq + d, plain_sq + p
        error = _relative(d, p)
        if error > worst:
            worst_name, worst = name, error
    return GroupError(group, _relative(diff_sq, plain_sq), worst_name, worst, plain_sq**0.5, len(names))


def _relative(diff_sq: float, plain_sq: float) -> float:
    if plain_sq == 0:
        return 0.0 if diff_sq == 0 else float("inf")
    return (diff_sq / plain_sq) ** 0.5


def _tied(model) -> bool:
    base = model.get_base_model() if callable(getattr(model, "get_base_model", None)) else model
    head, embed = base.get_output_embeddings(), base.get_input_embeddings()
    return head is not None and head.weight is embed.weight
