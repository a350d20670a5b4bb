"""Cheap checks of a command's arguments, before any heavy import or work: step specs and output paths.

Everything here imports neither torch nor transformers, so bad input is refused at once.
"""

from __future__ import annotations

from pathlib import Path

from streambp_bench import options as opt
from streambp_core.config import METHODS, ConfigError, StepSpec, simulated_ranks_problem
from streambp_core.models.config_file import precheck_model
from streambp_core.tiers import Tiers, tier_label


def method_list(methods: str) -> tuple[str, ...]:
    """'all' -> every method; else the comma list, each checked (ConfigError)."""
    chosen = METHODS if methods.strip() == "all" else opt.split_list(methods)
    if not chosen:
        raise ConfigError("give at least one method, or 'all'")
    for method in chosen:
        StepSpec.of(model="-", method=method)
    return tuple(dict.fromkeys(chosen))


def step_specs(model: str, methods: str, offload: Tiers | str = Tiers.NONE, **fields: object
               ) -> tuple[StepSpec, ...]:
    """One validated `StepSpec` per method of `methods` on `model` (checked to exist), at `offload`
    (`with_offload`: 'both' gives each method with and without)."""
    precheck_model(model)
    specs = tuple(StepSpec.of(model=model, method=method, **fields) for method in method_list(methods))
    return with_offload(specs, offload, every_method=methods.strip() == "all")


def with_offload(specs: tuple[StepSpec, ...], offload: Tiers | str, *, every_method: bool = False
                 ) -> tuple[StepSpec, ...]:
    """`specs` at `offload`: a tier set (a method named that cannot take it refused by name, ConfigError;
    with `every_method`, from `--method all`, such a method is left out instead: plain has nothing to
    offload), or "both": each spec followed by its offloaded twin (plain, with nothing to offload, only
    without)."""
    if offload == "both":
        twins = ((spec, spec.replaced(offload=Tiers(checkpoints=True))) if spec.method != "plain" else (spec,)
                 for spec in specs)
        return tuple(dict.fromkeys(spec for pair in twins for spec in pair))
    if every_method and offload:
        specs = tuple(spec for spec in specs if not _method_cannot(spec, offload)) or specs
    return tuple(spec.replaced(offload=offload) for spec in specs)


def _method_cannot(spec: StepSpec, offload: Tiers) -> bool:
    """Whether `spec`'s method alone keeps it from `offload` (streambp, on the same step, could take it)."""
    def refused(method: str) -> bool:
        try:
            spec.replaced(method=method, offload=offload)
        except ConfigError:
            return True
        return False

    return refused(spec.method) and not refused("streambp")


def spec_label(spec: StepSpec) -> str:
    """How a table names the step: its method, '+ offload' when its checkpoints live in host memory,
    '+ offload <tiers>' for other tier sets (`tiers.tier_label`)."""
    return f"{spec.method} {tier_label(spec.offload)}".rstrip()


def writable_results(out: Path | None) -> Path | None:
    """`out` after `ResultsFile.check_target` (before any work: an existing file must be a results CSV of
    this schema, the folder writable; SchemaError or ConfigError otherwise); None stays None."""
    if out is None:
        return None
    from streambp_bench.results import ResultsFile

    ResultsFile(out).check_target()
    return out


def sharding(gpus: int | None, shard: object | None, device: str) -> tuple[dict[str, object], str]:
    """StepSpec fields of `--gpus`/`--shard` and the device to run on (auto -> sim when --gpus is given).

    ConfigError (one line): --shard without --gpus; --gpus on cpu or cuda (`simulated_ranks_problem`)."""
    value = getattr(shard, "value", shard)
    if value is not None and gpus is None:
        raise ConfigError("--shard needs --gpus N: the GPUs to shard the model state across")
    if gpus is None:
        return {}, device
    if (problem := simulated_ranks_problem(device, gpus=gpus, shard=value)) is not None:
        raise ConfigError(problem)
    return {"gpus": gpus, "shard": value or "none"}, "sim"


def writable_folder(out: Path, option: str = "--out") -> Path:
    """`out` when files can be written into it, checked before any work: ConfigError when it is an
    existing file rather than a folder, or when it (or its nearest existing parent, where it will be
    created) is not a writable folder."""
    import os

    folder = out.resolve()
    while not folder.exists() and folder != folder.parent:
        folder = folder.parent
    if not folder.is_dir():
        what = f"{option} {out} is a file" if folder == out.resolve() else f"{folder} is a file"
        raise ConfigError(f"{what}, not a folder: give a folder for {option} (it is created when missing)")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise ConfigError(f"cannot write into {option} {out}: no permission to write in {folder}")
    return out
