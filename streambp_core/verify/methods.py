"""Check that every method's loss and parameter gradients equal plain backprop's on one model.

Steps of `verify_methods`:
1. Build the model with random weights (seeded) and a random batch with the chosen padding.
2. Run `plain` as the reference and keep its loss and gradients.
3. Run each method on the same weights and batch; compare every parameter's gradient with the
   reference, in float64, relative and absolute like `torch.testing.assert_close` (CRITERION,
   `streambp_core.verify.compare.max_grad_err`), and the loss relative to max(1, |loss|). With an
   optimizer (float32, float64) the gradients are those AdamW receives and its applied update is compared
   too, each method's tiers against plain's device AdamW (`streambp_core.verify.update`).
4. float64 and float32 pass below a fixed tolerance (a float64 model's loss is computed in float64 by
   every method, plain included). bfloat16 and float16 follow flash-attention's rule: the reference is
   plain in float32 on the same (rounded) weights, and a method passes when its error is at most 2x the
   error of plain in that precision against that reference.

Before building the model, the RAM it needs (weights and two sets of gradients, at least) is checked
against the RAM available, so a model too big for the machine is a ConfigError, not an allocation
that runs until the machine dies.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import asdict, dataclass, replace

import torch
from transformers import PreTrainedModel

import streambp_core
from streambp_core.config import VERIFY_METHODS, ConfigError, StepSpec, packing_problem, require_choice
from streambp_core.models import build_model, load_config
from streambp_core.models.lora import apply_lora
from streambp_core.step.parts.batch import (
    PADDINGS,
    Batch,
    document_lengths,
    objective_inputs,
    pack_rows,
    random_batch,
)
from streambp_core.tiers import Tiers
from streambp_core.verify.compare import Gradients, max_grad_err
from streambp_core.verify.criterion import (
    CRITERION,
    DTYPES,
    LOW_PRECISION_EPS,
    LOW_PRECISION_FACTOR,
    LOW_PRECISION_LOSS_EPS,
    TOLERANCE,
)
from streambp_core.verify.ram import check_ram
from streambp_core.verify.update import adamw_step

VERIFY_STEP = {"seq_len_tokens": 256, "partition_size": 100, "head_partition_size": 50, "dtype": "float32"}
"""Where a verification's step differs from `StepSpec`'s defaults (`VerifySpec.of`): short, small chunks."""


@dataclass(frozen=True, kw_only=True)
class VerifySpec:
    """What to verify: one step (model, shape, precision, seed, LoRA and the engine's settings) and the
    methods to compare with plain, plus what only a verification has: padding and device.

    The step's `batch_size` counts the batch's rows (dpo: chosen rows, then as many rejected)."""

    step: StepSpec
    """The step as streambp runs it (its LM head as asked); each method runs `step_of(method)`."""
    methods: tuple[str, ...] = VERIFY_METHODS
    padding: str = "none"
    device: str = "cpu"
    packing: str = ""
    """Packed rows: a document count ("3", random lengths) or lengths ("100,37,250"); "" unpacked."""

    def __post_init__(self) -> None:
        if not isinstance(self.step, StepSpec):
            raise ConfigError(f"step must be a StepSpec, got {type(self.step).__name__}")
        if not self.methods:
            raise ConfigError("give at least one method")
        for method in self.methods:
            self.step_of(method)  # each method's step is validated where every step's is
        if self.step.objective == "dpo" and self.step.batch_size % 2:
            raise ConfigError(f"dpo needs an even batch size (chosen, then rejected), "
                              f"got {self.step.batch_size}")
        require_choice("dtype", self.step.dtype, tuple(DTYPES))
        if self.step.optimizer != "none" and self.step.dtype not in TOLERANCE:
            raise ConfigError(f"--optimizer {self.step.optimizer}: verify checks the update in float32 and "
                              "float64 (in bfloat16 the optimizer tier steps float32 masters, by design not "
                              "bfloat16 AdamW's update)")
        require_choice("padding", self.padding, PADDINGS)
        _check_device(self.device)
        if self.packing:
            self.document_lengths()  # validated here
            problem = packing_problem(self.step.objective)
            if problem:
                raise ConfigError(problem)
            if self.padding != "none":
                raise ConfigError("--packing with --padding: packed rows pad their end themselves "
                                  "(give lengths summing to less than --seq-len)")

    def document_lengths(self) -> list[list[int]]:
        """Each row's packed document lengths (`batch.document_lengths`); [] when unpacked."""
        if not self.packing:
            return []
        return document_lengths(self.packing, self.step.seq_len_tokens, self.step.batch_size, self.step.seed)

    @classmethod
    def of(cls, *, model: str, methods: tuple[str, ...] = VERIFY_METHODS, padding: str = "none",
           device: str = "cpu", packing: str = "", **step: object) -> VerifySpec:
        """A verification from flat fields: `step` as `StepSpec.of` takes them (defaults `VERIFY_STEP`)."""
        return cls(step=StepSpec.of(model=model, method="streambp", **{**VERIFY_STEP, **step}),
                   methods=tuple(methods), padding=padding, device=device, packing=packing)

    def step_of(self, method: str) -> StepSpec:
        """One method's step of this check (plain with offload is refused, as every step's)."""
        return replace(self.step, method=method)

    @property
    def reference(self) -> StepSpec:
        """The reference's step: plain, its tensors on the device (offload never applies to it)."""
        return replace(self.step, method="plain", stream=replace(self.step.stream, offload=Tiers.NONE))

    def to_dict(self) -> dict[str, object]:
        """The spec, flat: the step's fields (but its method) and the stream's, methods, padding, device."""
        fields = {k: v for k, v in self.step.to_dict().items() if k != "method"}
        return {**fields, "methods": list(self.methods), "padding": self.padding, "device": self.device,
                "packing": self.packing}

    @property
    def source(self) -> str:
        """Provenance label of the numbers: measured-cpu or measured-cuda."""
        return f"measured-{torch.device(self.device).type}"


def _check_device(device: str) -> None:
    try:
        kind = torch.device(device).type
    except (RuntimeError, TypeError) as error:
        raise ConfigError(f"unknown device {device!r}: {error}") from None
    if kind not in ("cpu", "cuda"):
        raise ConfigError(f"device must be cpu or cuda, got {device!r}")
    if kind == "cuda" and not torch.cuda.is_available():
        raise ConfigError("device cuda requested but torch sees no CUDA device")


@dataclass(frozen=True, kw_only=True)
class MethodResult:
    """One method's distance from the reference."""

    method: str
    max_rel_err: float
    """max over parameters of ||g - g_ref|| / (||g_ref|| + sqrt(numel) * rms(g_ref)) (CRITERION)."""
    worst_param: str
    """Parameter where `max_rel_err` occurs."""
    loss: float
    loss_abs_err: float
    tolerance: float
    """Bound on `max_rel_err` (bfloat16, float16: 2x plain's error in that precision + eps)."""
    loss_tolerance: float
    """Bound on `loss_abs_err`."""
    baseline_rel_err: float | None = None
    """bfloat16 and float16 only: plain's max_rel_err in that precision against the float32 reference."""
    max_update_err: float | None = None
    """With an optimizer: the applied update's distance from the reference's, as `max_rel_err`'s."""
    ok: bool


@dataclass(frozen=True, kw_only=True, eq=False)
class Step:
    """Outcome of one forward+backward: the loss and every parameter's gradient."""

    loss: float
    loss_dtype: torch.dtype
    grads: Gradients
    updates: Gradients | None = None
    """With an optimizer: each weight's applied update (`verify.update`); else None."""


@dataclass(frozen=True, kw_only=True)
class Bounds:
    """What a method must stay within to pass."""

    grad_rel: float
    loss_abs: float
    baseline_rel_err: float | None = None


@dataclass(frozen=True, kw_only=True)
class VerifyReport:
    """All methods' results against the reference run."""

    spec: VerifySpec
    results: tuple[MethodResult, ...]
    reference_loss: float
    reference: str = "plain"
    reference_dtype: str
    """dtype the reference ran in: the spec's dtype, or float32 when verifying bfloat16 or float16."""

    @property
    def ok(self) -> bool:
        return all(result.ok for result in self.results)

    def to_dict(self) -> dict:
        """JSON-ready summary: reference, dtype, source, model and one entry per method."""
        return {
            "reference": self.reference,
            "dtype": self.spec.step.dtype,
            "reference_dtype": self.reference_dtype,
            "source": self.spec.source,
            "model": self.spec.step.model,
            "spec": self.spec.to_dict(),
            "reference_loss": self.reference_loss,
            "criterion": CRITERION,
            "ok": self.ok,
            "results": [asdict(result) for result in self.results],
        }


def run_step(model: PreTrainedModel, step: StepSpec, batch: Batch) -> Step:
    """One forward+backward of `step` (its method and stream) from empty grads.

    The gradients are moved out of the parameters (which are left with `grad=None`), not copied. With an
    optimizer, one AdamW step: its gradients and update, the weights left as they were (`verify.update`).
    """
    if step.optimizer != "none":
        loss, grads, updates = adamw_step(model, step, batch)
        return Step(loss=float(loss), loss_dtype=loss.dtype, grads=grads, updates=updates)
    for param in model.parameters():
        param.grad = None
    labels, inputs = objective_inputs(step.objective, batch, step.seed)
    with streambp_core.prepare(model, step.method, step.stream) as run:
        loss = run.loss(batch.input_ids, attention_mask=batch.attention_mask, labels=labels,
                        position_ids=batch.position_ids, **inputs)
        loss.backward()
    grads: Gradients = {}
    for name, param in model.named_parameters():
        if param.requires_grad:
            grads[name], param.grad = param.grad, None
    return Step(loss=float(loss.detach()), loss_dtype=loss.dtype, grads=grads)


def _check(
    model: PreTrainedModel, method: str, batch: Batch, spec: VerifySpec, reference: Step, bounds: Bounds
) -> MethodResult:
    """Run `method` and compare its loss and gradients with `reference` under `bounds`."""
    step = run_step(model, spec.step_of(method), batch)
    err, worst = max_grad_err(step.grads, reference.grads)
    loss_err = abs(step.loss - reference.loss)
    update_err = None if step.updates is None else max_grad_err(step.updates, reference.updates)[0]
    return MethodResult(
        method=method,
        max_rel_err=err,
        worst_param=worst,
        loss=step.loss,
        loss_abs_err=loss_err,
        tolerance=bounds.grad_rel,
        loss_tolerance=bounds.loss_abs,
        baseline_rel_err=bounds.baseline_rel_err,
        max_update_err=update_err,
        ok=max(err, update_err or 0.0) <= bounds.grad_rel and loss_err <= bounds.loss_abs,
    )


Progress = Callable[[str, int, int], None]
"""Called before each stage of a verification: (what runs now, stages done, stages in all)."""


def _stages(spec: VerifySpec, progress: Progress | None) -> Callable[[str], None]:
    """A `note(stage)` that reports each stage to `progress` (no-op without one), counting them."""
    low_precision = spec.step.dtype not in TOLERANCE
    total = 2 + low_precision + len(spec.methods)  # model, reference, [baseline], methods
    done = [0]

    def note(stage: str) -> None:
        if progress is not None:
            progress(stage, done[0], total)
        done[0] += 1

    return note


def _exact_bounds(spec: VerifySpec, reference: Step) -> Bounds:
    tol = TOLERANCE[spec.step.dtype]
    return Bounds(grad_rel=tol, loss_abs=tol * max(1.0, abs(reference.loss)))


def _verify_exact(model: PreTrainedModel, batch: Batch, spec: VerifySpec, note: Callable[[str], None]
                  ) -> VerifyReport:
    """float64 / float32: each method against plain in the same dtype, under a fixed tolerance."""
    note("plain (reference)")
    reference = run_step(model, spec.reference, batch)
    bounds = _exact_bounds(spec, reference)
    results = _check_methods(model, batch, spec, reference, bounds, note)
    return VerifyReport(spec=spec, results=results, reference_loss=reference.loss,
                        reference_dtype=spec.step.dtype)


def _low_precision_bounds(model: PreTrainedModel, batch: Batch, spec: VerifySpec, reference: Step) -> Bounds:
    """Run plain in low precision; its errors against the fp32 reference, doubled, bound the methods'."""
    plain = run_step(model, spec.reference, batch)
    baseline, _ = max_grad_err(plain.grads, reference.grads)
    loss_slack = LOW_PRECISION_LOSS_EPS * max(1.0, abs(reference.loss))
    return Bounds(
        grad_rel=LOW_PRECISION_FACTOR * baseline + LOW_PRECISION_EPS,
        loss_abs=LOW_PRECISION_FACTOR * abs(plain.loss - reference.loss) + loss_slack,
        baseline_rel_err=baseline,
    )


def _check_methods(model: PreTrainedModel, batch: Batch, spec: VerifySpec, reference: Step, bounds: Bounds,
                   note: Callable[[str], None]) -> tuple[MethodResult, ...]:
    """`_check` of every method of `spec`, each noted before it runs."""
    results = []
    for method in spec.methods:
        note(method)
        results.append(_check(model, method, batch, spec, reference, bounds))
    return tuple(results)


def _verify_low_precision(model: PreTrainedModel, batch: Batch, spec: VerifySpec,
                          note: Callable[[str], None]) -> VerifyReport:
    """bfloat16 or float16: each method against plain fp32 on weights rounded to that precision, bounded
    by plain's error in it.

    `model` arrives in float32; its weights are rounded to the low precision's values, the fp32 reference
    runs, then the model is cast to that precision for plain (the baseline) and the methods.
    """
    low = DTYPES[spec.step.dtype]
    with torch.no_grad():
        for param in model.parameters():
            param.copy_(param.to(low))
    note("plain float32 (reference)")
    reference = run_step(model, spec.reference, batch)
    model.to(low)
    note(f"plain {spec.step.dtype}")
    bounds = _low_precision_bounds(model, batch, spec, reference)
    results = _check_methods(model, batch, spec, reference, bounds, note)
    return VerifyReport(spec=spec, results=results, reference_loss=reference.loss, reference_dtype="float32")


def verify_spec(spec: VerifySpec, progress: Progress | None = None) -> VerifyReport:
    """Run the reference and every method of `spec`; see the module docstring for the steps. `progress`
    hears of each stage before it runs (`Progress`)."""
    note = _stages(spec, progress)
    config = load_config(spec.step.model)
    low_precision = spec.step.dtype not in TOLERANCE
    build_dtype = torch.float32 if low_precision else DTYPES[spec.step.dtype]
    if torch.device(spec.device).type == "cpu":
        check_ram(config, spec, build_dtype)
    note("building the model")
    model = build_model(config, dtype=build_dtype, device=spec.device, seed=spec.step.seed, checked=True)
    if spec.step.lora_rank:
        model = apply_lora(model, spec.step.lora_rank)
    batch = random_batch(
        vocab_size=config.vocab_size,
        seq_len=spec.step.seq_len_tokens,
        batch_size=spec.step.batch_size,
        padding=spec.padding,
        seed=spec.step.seed + 1,
        device=spec.device,
    )
    if spec.packing:
        batch = pack_rows(batch, spec.document_lengths())
    if low_precision:
        return _verify_low_precision(model, batch, spec, note)
    return _verify_exact(model, batch, spec, note)


def verify_methods(
    model_name: str,
    *,
    methods: tuple[str, ...] = VERIFY_METHODS,
    seq_len: int = 256,
    batch_size: int = 1,
    partition_size: int = 100,
    head_partition_size: int = 50,
    dtype: str = "float32",
    padding: str = "none",
    seed: int = 0,
    device: str = "cpu",
    offload: Tiers | str = Tiers.NONE,
) -> VerifyReport:
    """Verify `methods` against plain on `model_name` (preset or local directory); see `VerifySpec`."""
    spec = VerifySpec.of(
        model=model_name, methods=tuple(methods), padding=padding, device=device, seq_len_tokens=seq_len,
        batch_size=batch_size, partition_size=partition_size, head_partition_size=head_partition_size,
        dtype=dtype, seed=seed, offload=offload,
    )
    return verify_spec(spec)
