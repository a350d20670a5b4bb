"""`plan`'s search: each chain of recipes (`recipes.space`) at one length, or at its longest, pruned.

Every figure comes from the functions `max-len` uses, on the same `StepSpec`s: a recipe at a length runs
at the largest partitions that fit (`step.search.partitions.resolve_partitions`, checked at full depth), its
peak and host pool are `simulate`'s at full depth, its time `step_estimate.estimate_step`'s; its longest
length is `step.search.probe.max_len`'s. So an answer equals what `max-len` gives for the same recipe.

At one length, per chain (stages strongest first):
1. The highest rung of the stage at the smallest partitions (extrapolated: it can only under-estimate,
   so a failure there is a failure): when it does not fit, neither does any lower rung nor any weaker
   stage (pruned, said so).
2. The rungs from the lowest a stronger stage fitted on, fewest tiers first, each at the smallest
   partitions until one fits (above it every rung does: more tiers never hold more); the first that
   fits is resolved and estimated, and so is each rung above it until one runs the largest partitions
   (the whole sequence per chunk and per head chunk): every rung above that one is dominated (same
   partitions, more copies: never faster) and left out, said so. Each partition search asks first
   about the partitions the stronger stage ran on this rung, else those the rung below ran (fewer
   simulations, the same answer).
For the longest length (`--seq-len max`), per stage the rungs from the highest down, each searched;
a rung with no length prunes the rungs below it and, on the strongest stage, the weaker stages there.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from streambp_bench.recipes.space import Chain, recipe_label
from streambp_core.config import ConfigError, StepSpec
from streambp_core.measure.units import GIB

FITS, GPU_OOM, HOST_OOM, REFUSED, PRUNED, DOMINATED = (
    "fits", "gpu-oom", "host-oom", "refused", "pruned", "dominated")


@dataclass(frozen=True, kw_only=True)
class Context:
    """What every recipe of one plan is judged against (pickled to each worker)."""

    model: object
    """The `step.parts.resolved.ResolvedModel` (a worker gets its config and starts its own memo, kept
    for every task it runs)."""
    gpu: object
    """The `step.estimate.roofline.GpuModel` the step times are estimated for."""
    budget_bytes: int
    host_budget_bytes: int | None
    """One rank's share of a node's host memory; None: reported, not bounded."""
    seq_len_tokens: int | None
    """The length every recipe runs at; None: each recipe's longest (`max_len`)."""


@dataclass(frozen=True, kw_only=True)
class Outcome:
    """One recipe's answer: at the length, whether it fits, its figures and its estimated time."""

    spec: StepSpec
    """The recipe; when it fits, at the partitions that run it."""
    status: str
    why: str = ""
    sim: object | None = None
    """The `step.simulation.simulate.SimResult` its figures are: at full depth when it fits, the one that
    missed otherwise; None where nothing was simulated (refused, pruned, dominated)."""
    estimate: object | None = None
    """The `step.estimate.roofline.StepEstimate`; None where the step-time model does not cover it (`why`)."""
    capped: bool = False
    """`--seq-len max`: the search's cap fits (the true longest is at least this)."""

    @property
    def label(self) -> str:
        return recipe_label(self.spec)

    @property
    def fits(self) -> bool:
        return self.status == FITS


def _check_small(spec: StepSpec, ctx: Context) -> Outcome | None:
    """None when `spec` fits at the smallest partitions, extrapolated (cheap; it only under-estimates, so a
    miss here is a miss); else its GPU or host OOM, or its refusal by name (ConfigError)."""
    from streambp_core.step.search.partitions import searched
    from streambp_core.step.simulation.simulate import simulate

    try:
        return _miss(spec, simulate(searched(spec), ctx.model), ctx)
    except ConfigError as error:
        return Outcome(spec=spec, status=REFUSED, why=f"refused: {error}")


def _miss(spec: StepSpec, sim, ctx: Context) -> Outcome | None:
    """A GPU or host OOM outcome when `sim` is over a budget, else None."""
    if sim.peak_bytes > ctx.budget_bytes:
        over = (sim.peak_bytes - ctx.budget_bytes) / GIB
        return Outcome(spec=spec, status=GPU_OOM, sim=sim,
                       why=f"GPU OOM by {over:,.2f} GiB ({sim.peak_bytes / GIB:,.2f} GiB at the smallest "
                           "partitions, simulated)")
    if ctx.host_budget_bytes is not None and (sim.host_peak_bytes or 0) > ctx.host_budget_bytes:
        over = ((sim.host_peak_bytes or 0) - ctx.host_budget_bytes) / GIB
        return Outcome(spec=spec, status=HOST_OOM, sim=sim,
                       why=f"host OOM by {over:,.2f} GiB per rank (simulated)")
    return None


def step_at(spec: StepSpec, ctx: Context, near: tuple[int, int] | None = None,
            at_least: tuple[int, int] | None = None) -> Outcome:
    """`spec` at its length as `max-len --at` runs it: the largest partitions that fit (full depth), its
    full-depth peak and host pool, and its estimated time (None with the reason where the step-time
    model raises ConfigError for it). `near`: the partitions the same step runs under a stronger stage;
    `at_least`: the partitions it runs with fewer tiers; asked about first (`resolve_partitions`:
    the same answer)."""
    from streambp_core.step.estimate.step_estimate import estimate_step
    from streambp_core.step.search.partitions import NOTHING_FITS, resolve_partitions
    from streambp_core.step.simulation.simulate import simulate

    try:
        run = resolve_partitions(spec, ctx.budget_bytes, ctx.model, near=near, at_least=at_least)
    except ConfigError as error:  # nothing fits, or a refusal only a simulation finds
        if not str(error).startswith(NOTHING_FITS):
            return Outcome(spec=spec, status=REFUSED, why=f"refused: {error}")
        return Outcome(spec=spec, status=GPU_OOM, why=f"GPU OOM at full depth: {error}")
    try:
        full = simulate(run, ctx.model, depth="full")
    except ConfigError as error:
        return Outcome(spec=spec, status=REFUSED, why=f"refused: {error}")
    miss = _miss(run, full, ctx)
    if miss is not None:
        return replace(miss, why=miss.why.replace("at the smallest partitions", "at full depth"))
    try:
        estimate, why = estimate_step(run, ctx.gpu, ctx.model), ""
    except ConfigError as error:
        estimate, why = None, f"no estimate: {error}"
    return Outcome(spec=run, status=FITS, why=why, estimate=estimate, sim=full)


def largest_partitions(spec: StepSpec) -> bool:
    """Whether `spec` runs the largest partitions there are (or takes none): a chunk of the whole
    sequence in every layer and in the head."""
    stream, tokens = spec.stream, spec.seq_len_tokens
    return not spec.partitioned or (stream.partition_size >= tokens and stream.head_partition_size >= tokens)


def _recipes(chain: Chain, stage: str, seq_len: int) -> list[StepSpec | str]:
    """Each rung's recipe under `stage`, or the reason it is refused (ConfigError's message)."""
    found: list[StepSpec | str] = []
    for tiers in chain.rungs:
        try:
            found.append(chain.recipe(stage, tiers, seq_len))
        except ConfigError as error:
            found.append(str(error))
    return found


def _refused(chain: Chain, stage: str, tiers, why: str, seq_len: int) -> Outcome:
    """A rung that cannot run, refused by name (its spec: the chain's step under `stage`, no tiers)."""
    spec = chain.base.replaced(seq_len_tokens=max(seq_len, chain.base.sp), shard=stage)
    return Outcome(spec=spec, status=REFUSED, why=f"refused: offload {tiers}: {why}")


def chain_at_length(chain: Chain, ctx: Context, progress) -> list[Outcome]:
    """Every recipe of `chain` at `ctx.seq_len_tokens` (module docstring, steps 1-2)."""
    seq_len = int(ctx.seq_len_tokens or 0)
    outcomes: list[Outcome] = []
    floor, dead, ran = 0, "", {}
    for stage in chain.stages:
        recipes = _recipes(chain, stage, seq_len)
        runnable = [index for index, spec in enumerate(recipes) if not isinstance(spec, str)]
        for index in (i for i in range(len(recipes)) if i not in runnable):
            outcomes.append(_refused(chain, stage, chain.rungs[index], str(recipes[index]), seq_len))
        if dead or not runnable:
            outcomes += [Outcome(spec=recipes[i], status=PRUNED, why=dead) for i in runnable if dead]
            continue
        progress(chain.name, f"{stage}: highest rung at the smallest partitions")
        miss = _check_small(recipes[runnable[-1]], ctx)
        while miss is not None and miss.status == REFUSED:  # a rung refused at run time: the next down
            outcomes.append(miss)
            runnable = runnable[:-1]
            miss = _check_small(recipes[runnable[-1]], ctx) if runnable else None
        if not runnable:
            continue
        if miss is not None:
            dead = f"pruned: {miss.label} does not fit ({miss.why}); fewer tiers or a weaker stage hold more"
            outcomes.append(miss)
            outcomes += [Outcome(spec=recipes[i], status=PRUNED, why=dead) for i in runnable[:-1]]
            continue
        floor, ran = _walk_up(chain, stage, recipes, runnable, (floor, ran), ctx, progress, outcomes)
    return outcomes


def _walk_up(chain: Chain, stage: str, recipes, runnable, stronger: tuple[int, dict], ctx: Context,
             progress, outcomes: list[Outcome]) -> tuple[int, dict]:
    """Step 2 of the module docstring for one stage. `stronger`: the lowest rung that fitted under the
    stronger stages (the floor here) and, per rung, the partitions it ran under the last of them that
    fitted it. Returns the same for the weaker stages."""
    floor, ran = stronger
    ran = dict(ran)
    lowest, reached, below = None, "", None  # below: the partitions the last rung that fitted runs
    for index in runnable:
        spec = recipes[index]
        if index < floor:
            outcomes.append(Outcome(spec=spec, status=PRUNED, why="pruned: does not fit under a stronger "
                                    "stage with these tiers"))
            continue
        if reached:
            outcomes.append(Outcome(spec=spec, status=DOMINATED, why=reached))
            continue
        progress(chain.name, f"{stage}: offload {spec.offload}")
        checked = index == runnable[-1] or (lowest is not None and ctx.host_budget_bytes is None)
        miss = None if checked else _check_small(spec, ctx)  # the top: checked; above a fit: fits
        if miss is not None:
            outcomes.append(miss)
            continue
        outcome = step_at(spec, ctx, near=ran.get(index), at_least=below)
        outcomes.append(outcome)
        if outcome.fits:
            lowest = index if lowest is None else lowest
            stream = outcome.spec.stream
            if outcome.spec.partitioned:
                below = ran[index] = (stream.partition_size, stream.head_partition_size)
            if largest_partitions(outcome.spec):
                reached = (f"dominated: {outcome.label} already runs the largest partitions; more tiers "
                           "only add copies (not evaluated)")
    return (floor if lowest is None else lowest), ran


def chains_in_turn(work, chains: list[Chain], ctx: Context, progress) -> list[list[Outcome]]:
    """`work(chain, ctx, progress)` for each of `chains` in turn, in one process: one memo for them all."""
    return [work(chain, ctx, progress) for chain in chains]


def chain_frontier(chain: Chain, ctx: Context, progress) -> list[Outcome]:
    """Every recipe of `chain` at its longest length (`step.search.probe.max_len`, as `max-len` searches it),
    with the largest partitions and the estimated step time there (module docstring)."""
    from streambp_core.step.search.partitions import searched
    from streambp_core.step.search.probe import max_len

    outcomes: list[Outcome] = []
    failed_to = -1  # rungs up to this index have no length under a stronger stage
    for stage in chain.stages:
        recipes = _recipes(chain, stage, max(2, chain.base.sp))
        for index in reversed(range(len(recipes))):
            spec = recipes[index]
            if isinstance(spec, str):
                outcomes.append(_refused(chain, stage, chain.rungs[index], spec, chain.base.sp))
                continue
            if index <= failed_to:
                outcomes.append(Outcome(spec=spec, status=PRUNED, why="pruned: no length fits with more "
                                        "tiers or under a stronger stage"))
                continue

            def report(result, ok: int, fail: int | None, spec=spec) -> None:
                progress(chain.name, f"{recipe_label(spec)}: probe {result.seq_len_tokens:,} tokens; "
                                     f"bracket [{ok:,}, {'-' if fail is None else f'{fail:,}'}]")

            try:
                search = max_len(searched(spec), ctx.budget_bytes, "sim", ctx.model, on_probe=report,
                                 host_budget_bytes=ctx.host_budget_bytes)
            except ConfigError as error:
                outcomes.append(Outcome(spec=spec, status=REFUSED, why=f"refused: {error}"))
                continue
            if search.max_len_tokens < 2:
                shortest = min(search.probes, key=lambda probe: probe.seq_len_tokens, default=None)
                peak = "" if shortest is None or shortest.peak_bytes is None else (
                    f"; {shortest.peak_bytes / GIB:,.2f} GiB at {shortest.seq_len_tokens:,} tokens")
                outcomes.append(Outcome(spec=spec, status=GPU_OOM, why=f"no length fits{peak}"))
                failed_to = max(failed_to, index)
                continue
            outcome = step_at(spec.at(search.max_len_tokens), ctx)
            outcomes.append(replace(outcome, capped=search.capped))
    return outcomes
