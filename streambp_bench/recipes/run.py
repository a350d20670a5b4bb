"""`plan`'s work from its settings to its document: resolve the model once, build the chains, run them
side by side (`workers.run_tasks`), rank the outcomes (`report`)."""

from __future__ import annotations

from dataclasses import dataclass

from streambp_bench.recipes import report, space
from streambp_bench.recipes.search import Context, chain_at_length, chain_frontier, chains_in_turn
from streambp_core.config import ConfigError
from streambp_core.measure.units import GIB


@dataclass(frozen=True, kw_only=True)
class Job:
    """One plan: the chains to search, what they are judged against, the settings to report."""

    chains: list
    refused: list
    context: Context
    setting: report.Setting
    settings: dict


def prepare(model: str, methods: tuple[str, ...], gpus: int, gpu_name: str, seq_len: int | None,
            budget_gib: float, host_gib: float | None, gpus_per_node: int, fields: dict) -> Job:
    """The plan's chains and context (ConfigError, one line, for a model or length nothing can run)."""
    from streambp_core.models.load import build_model, count_parameters
    from streambp_core.step.estimate.roofline import gpu_model
    from streambp_core.step.parts.resolved import ResolvedModel

    resolved = ResolvedModel(model)
    degrees = space.sp_degrees(gpus, resolved.config)
    if seq_len is not None:
        degrees = tuple((sp, why or (None if sp <= seq_len else f"sp {sp} is more ranks than the "
                                     f"{seq_len} tokens")) for sp, why in degrees)
    chains, refused = space.chains(model, methods, gpus, degrees, **fields)
    if gpus > 1:
        refused.append(("DeepSpeed ZeRO-1", "not simulated, not searched: a rank holds its whole gradients, "
                        "more than under ZeRO-2, so it fits nowhere ZeRO-2 does not"))
    if not chains:
        raise ConfigError(f"no recipe can run: {refused[0][1] if refused else 'no method given'}")
    per_node = min(gpus, gpus_per_node)
    host_share = None if host_gib is None else int(host_gib * GIB / per_node)
    context = Context(model=resolved, gpu=gpu_model(gpu_name), budget_bytes=int(budget_gib * GIB),
                      host_budget_bytes=host_share, seq_len_tokens=seq_len)
    config = resolved.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    setting = report.Setting(
        gpu=context.gpu, gpus=gpus, ranks_per_node=per_node,
        parameters=count_parameters(build_model(config, device="meta", checked=True)),
        attention_width=config.num_hidden_layers * config.num_attention_heads * head_dim)
    settings = {"model": model, "gpus": gpus, "gpu_model": gpu_name, "gpus_per_node": gpus_per_node,
                "budget_gib": budget_gib, "host_gib_per_node": "unbounded" if host_gib is None else host_gib,
                "seq_len_tokens": "max" if seq_len is None else seq_len, **fields,
                "sources": {"times": "estimated", "memory": "simulated"}}
    return Job(chains=chains, refused=refused, context=context, setting=setting, settings=settings)


def search(job: Job, progress, workers: int, context) -> dict:
    """Every chain searched (`recipes.search.chain_at_length`, or `chain_frontier` for the longest
    lengths) on up to `workers` processes, the chains of one method, head mode and sp degree in one
    process (their engines lay out the same simulated steps: `simulate` memoises them), with a progress
    line per chain; the document (`report.to_dict`)."""
    from streambp_bench.workers import Task, run_tasks

    work = chain_frontier if job.context.seq_len_tokens is None else chain_at_length
    lines = {chain.name: progress.add_task(f"{chain.name}: waiting", total=None) for chain in job.chains}

    def on_event(name: str, text: str) -> None:
        progress.update(lines[name], description=f"{name}: {text}")

    groups: dict[tuple, list] = {}
    for chain in job.chains:  # one task per step up to its stage: its engines share simulations
        groups.setdefault((chain.base.method, chain.base.stream.head_mode, chain.base.sp), []).append(chain)
    tasks = [Task(group[0].name, chains_in_turn, (work, group, job.context), sum(c.cost for c in group))
             for group in groups.values()]
    found = run_tasks(tasks, workers, context, on_event)
    outcomes = [outcome for group in found for chain_outcomes in group for outcome in chain_outcomes]
    return report.to_dict(outcomes, job.setting, job.settings, job.refused)
