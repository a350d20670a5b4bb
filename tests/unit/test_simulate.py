"""The simulator: its peak against real CPU tensors, and its two shortcuts (depth, chunk thinning) exact."""

from __future__ import annotations

import pytest
import torch

from streambp_core.config import METHODS, ConfigError, StepSpec
from streambp_core.measure.tracker import MemoryTracker
from streambp_core.measure.units import GIB
from streambp_core.methods import prepare
from streambp_core.models import load_config, tiny_config
from streambp_core.step.parts.resolved import ResolvedModel
from streambp_core.step.run.setup import build_setup, resident_bytes
from streambp_core.step.run.simulation_mode import SimulationMode
from streambp_core.step.search.probe import measure_setup
from streambp_core.step.simulation.simulate import KEEP_CHUNKS, simulate

TINY = "tiny/qwen3"  # 2 layers, hidden 64, 4 heads x 32, vocab 512
SMALL = dict(partition_size=32, head_partition_size=16)


def simulate_step(model, method: str, seq_len: int, *, depth: str = "extrapolate", thin_chunks: bool = True,
                  cache: dict | None = None, **fields):
    """`simulate` of the step these arguments describe (`model`: a preset name or a config)."""
    resolved = ResolvedModel(model)
    if cache is not None:
        resolved.memo = cache
    spec = StepSpec.of(model=model if isinstance(model, str) else TINY, method=method, seq_len_tokens=seq_len,
                       **fields)
    return simulate(spec, resolved, depth=depth, keep_chunks=KEEP_CHUNKS if thin_chunks else None)


@pytest.mark.parametrize(
    ("method", "dtype", "grads"),
    [(method, "float32", "resident") for method in METHODS] + [("checkpoint", "bfloat16", "fresh")],
)
def test_simulated_peak_matches_the_tracker_on_real_cpu_tensors(method: str, dtype: str, grads: str) -> None:
    """Same step, meta vs CPU. Tolerance, with its reason: the engine's exact CPU attention kernel returns
    its output (and gradients) contiguous in (B, H, T, hd), while flash/SDPA on CUDA and the fake kernel
    return them (B, T, H, hd)-major; transformers' `reshape` then copies on CPU only, and `plain` keeps
    that copy for o_proj's backward in every layer. So CPU may exceed the simulation by up to one
    attention output, B x T x H x hd elements, per layer (one chunk's for streambp), never fall below."""
    seq_len = 100
    spec = StepSpec.of(model=TINY, method=method, seq_len_tokens=seq_len, dtype=dtype, grads=grads, **SMALL)
    config = load_config(TINY)
    simulated = simulate(spec, config)
    measured = measure_setup(build_setup(spec, config, "cpu"), "cpu")
    itemsize = torch.empty((), dtype=getattr(torch, dtype)).element_size()
    tokens = SMALL["partition_size"] if method == "streambp" else seq_len
    attention_output = tokens * config.num_attention_heads * config.head_dim * itemsize
    assert measured.status == "ok" and measured.source == "measured-cpu"
    assert 0 <= measured.peak_bytes - simulated.peak_bytes <= config.num_hidden_layers * attention_output
    assert sum(simulated.breakdown_bytes.values()) == simulated.peak_bytes


@pytest.mark.parametrize("method", METHODS)
def test_depth_extrapolation_is_exact_against_full_depth(method: str) -> None:
    """Qwen3-0.6B (28 layers) at 1k tokens (3 layer chunks of its default 500, the last one short; 11 head
    chunks): simulated with 2 and 3 layers, extrapolated; to the byte."""
    extrapolated = simulate_step("Qwen/Qwen3-0.6B", method, 1024)
    full = simulate_step("Qwen/Qwen3-0.6B", method, 1024, depth="full")
    assert extrapolated.layers_simulated == (2, 3) and full.layers_simulated == (28,)
    assert extrapolated.peak_bytes == full.peak_bytes
    assert extrapolated.breakdown_bytes == full.breakdown_bytes


@pytest.mark.parametrize(
    ("method", "vocab", "seq_len", "grads"),  # vocab 512: peak in a layer's backward; 8192: in the head
    [("streambp", 512, 301, "resident"), ("streambp", 8192, 150, "fresh"), ("mst", 8192, 301, "fresh")],
)
def test_thinned_chunk_loops_give_the_same_peak(method: str, vocab: int, seq_len: int, grads: str) -> None:
    """Running only each engine chunk loop's first and last KEEP_CHUNKS chunks changes nothing, to the
    byte."""
    config = tiny_config("qwen3", vocab_size=vocab, num_hidden_layers=3, layer_types=["full_attention"] * 3)
    options = dict(grads=grads, dtype="float32", **SMALL)
    thin = simulate_step(config, method, seq_len, **options)
    every = simulate_step(config, method, seq_len, thin_chunks=False, **options)
    assert thin.peak_bytes == every.peak_bytes
    assert thin.breakdown_bytes == every.breakdown_bytes


def test_thinning_keeps_the_event_where_a_chunk_meets_its_predecessors_leftovers() -> None:
    """A GQA shape (16 heads on 4 KV heads) whose peak fell at the third backward chunk's start while the
    second chunk's leftovers were held (2 kept chunks per end missed it): 3 per end give every chunk's."""
    config = tiny_config("qwen3", hidden_size=128, num_attention_heads=16, num_key_value_heads=4, head_dim=8,
                         intermediate_size=384)  # fmt: skip
    options = dict(partition_size=64, head_partition_size=64)
    thin = simulate_step(config, "streambp", 1042, **options)
    every = simulate_step(config, "streambp", 1042, thin_chunks=False, **options)
    assert thin.peak_bytes == every.peak_bytes and thin.breakdown_bytes == every.breakdown_bytes


def _random_steps(count: int, seed: int = 7) -> list[tuple[str, dict, dict]]:
    """`count` (tiny family, config overrides, StepSpec fields) drawn at random over families, GQA shapes,
    vocabularies, lengths, partitions and every step option (the ones a StepSpec refuses are redrawn)."""
    import random

    rng = random.Random(seed)
    steps: list[tuple[str, dict, dict]] = []
    while len(steps) < count:
        family = rng.choice(["qwen3", "llama", "gemma3", "qwen3-moe", "mixtral"])
        heads = rng.choice([2, 4, 8, 16])
        overrides = dict(hidden_size=rng.choice([32, 64, 96]), num_attention_heads=heads,
                         num_key_value_heads=rng.choice([k for k in (1, 2, 4, 8) if heads % k == 0]),
                         intermediate_size=rng.choice([64, 200]), vocab_size=rng.choice([300, 512, 4096]))
        ps, method = rng.choice([16, 32, 50]), rng.choice(["streambp", "streambp", "mst"])
        fields = dict(method=method, seq_len_tokens=rng.randint(2 * ps, 30 * ps), partition_size=ps,
                      head_partition_size=rng.choice([8, 16, 64]), grads=rng.choice(["resident", "fresh"]),
                      objective=rng.choice(["sft", "grpo", "dpo"]), lora_rank=rng.choice([0, 4]),
                      optimizer=rng.choice(["none", "adamw"]), offload=rng.choice(["none", "checkpoints"]),
                      batch_size=rng.choice([1, 2]), protocol=rng.choice(["default", "trl"]))
        if method == "streambp":
            fields.update(head_mode=rng.choice(["recompute", "auto"]))
            if rng.random() < 0.3:
                fields.update(gpus=2, shard=rng.choice(["zero2", "zero3"]))
        try:
            StepSpec.of(model=f"tiny/{family}", **fields)
        except ConfigError:
            continue
        steps.append((family, overrides, fields))
    return steps


DEFAULT_DRAWS = (0, 1, 2, 3, 8)
"""The draws of `_random_steps(10)` the default run takes, the rest `-m slow`: between them every family,
both chunked methods, zero2 and zero3, offload, LoRA, AdamW, every objective and protocol, both head modes
and grads, batch 1 and 2."""


@pytest.mark.parametrize(("family", "overrides", "fields"), [
    pytest.param(*draw, marks=() if i in DEFAULT_DRAWS else pytest.mark.slow)
    for i, draw in enumerate(_random_steps(10))])
def test_thinned_chunk_loops_give_the_same_figures_on_random_steps(family, overrides, fields) -> None:
    """Full depth, bfloat16 (what the grouped experts' meta kernel takes): thinned vs every chunk, the peak,
    its breakdown and the host pool's figures, to the byte."""
    config = tiny_config(family, **overrides)
    spec = StepSpec.of(model=f"tiny/{family}", **fields)
    thin = simulate(spec, config, depth="full")
    every = simulate(spec, config, depth="full", keep_chunks=None)
    assert (thin.peak_bytes, thin.breakdown_bytes) == (every.peak_bytes, every.breakdown_bytes)
    host = ("host_peak_bytes", "to_host_bytes", "to_device_bytes")
    assert [getattr(thin, name) for name in host] == [getattr(every, name) for name in host]


def test_memoised_meta_kernels_give_the_same_peak_as_plain_meta_kernels() -> None:
    """An empty memo per op call (every op runs its real meta kernel) vs one shared memo."""

    class NoMemo(dict):
        def __setitem__(self, key, value) -> None:  # remember nothing: every call is a first call
            pass

    shared = simulate_step(TINY, "streambp", 301, dtype="float32", **SMALL)
    fresh = simulate_step(TINY, "streambp", 301, dtype="float32", cache=NoMemo(), **SMALL)
    assert shared.peak_bytes == fresh.peak_bytes and shared.breakdown_bytes == fresh.breakdown_bytes


@pytest.mark.parametrize("method", ["streambp", "checkpoint"])
def test_simulation_mode_handing_allocations_to_its_tracker_changes_no_figure(method: str) -> None:
    """Given its tracker, SimulationMode allocates below the tracker's mode and hands it the outputs, runs
    views below it and repeats no in-place meta kernel; without it the tracker sees every op. A step with
    an AdamW update either way: the same figures, to the byte."""
    spec = StepSpec.of(model=TINY, method=method, seq_len_tokens=301, dtype="float32", optimizer="adamw",
                       **SMALL)
    figures = []
    for handed in (True, False):
        setup = build_setup(spec, load_config(TINY), "meta")
        run = prepare(setup.model, method, spec.stream)
        with MemoryTracker(setup.model, setup.optimizer, device="meta") as tracker:
            with SimulationMode(vocab_size=512, tracker=tracker if handed else None):
                run.loss(**setup.inputs).backward()
                setup.optimizer.step()
        run.close()
        result = tracker.result()
        figures.append((result.peak_bytes, result.peak_breakdown_bytes, result.end_breakdown_bytes))
    assert figures[0] == figures[1]


def test_simulation_mode_memoises_and_files_logits() -> None:
    cache: dict = {}
    with SimulationMode(vocab_size=7, cache=cache):
        a = torch.empty(3, 5, device="meta")
        first, second = a + 1, a + 1
        logits = torch.empty(3, 4, device="meta") @ torch.empty(4, 7, device="meta")
        view = torch.ops.aten._unsafe_view(a, [15])  # shares a's storage although its schema does not say
    assert first.shape == second.shape == (3, 5) and logits.shape == (3, 7)
    assert view.untyped_storage()._cdata == a.untyped_storage()._cdata
    assert sum(1 for key in cache if "add" in str(key[0])) == 1


def test_categories_of_the_paper_setting() -> None:
    """Qwen3-8B, 4k tokens: weights and grads are the paper's 30.5 GiB line; logits show where they live."""
    spec = StepSpec.of(model="Qwen/Qwen3-8B", method="streambp")
    assert round(resident_bytes(spec, load_config(spec.model)) / GIB, 1) == 30.5
    seq_len, vocab = 4096, 151936
    checkpoint = simulate_step("Qwen/Qwen3-8B", "checkpoint", seq_len)
    streambp = simulate_step("Qwen/Qwen3-8B", "streambp", seq_len)
    by_cat = checkpoint.breakdown_bytes
    assert round((by_cat["weights"] + by_cat["grads"]) / GIB, 1) == 30.5
    assert by_cat["logits"] >= seq_len * vocab * 4  # at least the float32 copy of the logits
    assert by_cat["checkpoints"] >= 36 * seq_len * 4096 * 2 * 35 // 36  # the layer inputs kept
    assert streambp.breakdown_bytes["logits"] < 100 * vocab * 4 * 4  # a few head chunks at most
    assert streambp.peak_bytes < checkpoint.peak_bytes


def test_paper_protocol_holds_the_bf16_logits_through_backward() -> None:
    seq_len, vocab = 2048, 151936
    default = simulate_step("Qwen/Qwen3-0.6B", "checkpoint", seq_len)
    paper = simulate_step("Qwen/Qwen3-0.6B", "checkpoint", seq_len, protocol="paper")
    held = paper.breakdown_bytes["logits"] - default.breakdown_bytes["logits"]
    assert held == seq_len * vocab * 2
    assert paper.spec.protocol == "paper" and "extrapolated to 28" in paper.how


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        (dict(method="adam"), "unknown method"),
        (dict(seq_len=1), "seq_len"),
        (dict(depth="deep"), "depth must be"),
        (dict(grads="lazy"), "grads must be"),
        (dict(optimizer="adamw", grads="resident"), "grads resident with an optimizer"),
        (dict(optimizer="adamw", protocol="paper"), "protocol paper"),
        (dict(dtype="int8"), "dtype must be"),
        (dict(protocol="ours"), "protocol must be"),
        (dict(partition_size=0), "partition_size"),
        (dict(model="no/such-model"), "unknown model"),
    ],
)
def test_bad_input_is_a_config_error(kwargs: dict, message: str) -> None:
    call = dict(model=TINY, method="streambp", seq_len=64) | kwargs
    with pytest.raises(ConfigError, match=message):
        simulate_step(call.pop("model"), call.pop("method"), call.pop("seq_len"), **call)


def test_chunk_bounds_keep_only_thins_loops_longer_than_both_ends() -> None:
    from streambp_core.engine.chunks import chunk_bounds

    assert chunk_bounds(10, 3, keep=1) == [(0, 3), (9, 10)]
    assert chunk_bounds(10, 3, keep=2) == chunk_bounds(10, 3) == [(0, 3), (3, 6), (6, 9), (9, 10)]
    for length, size, keep in [(0, 4, 1), (1, 4, 3), (24, 4, 3), (25, 4, 3), (10_000_001, 500, 3)]:
        every = chunk_bounds(length, size)
        assert chunk_bounds(length, size, keep) == (every if len(every) <= 2 * keep
                                                    else every[:keep] + every[-keep:])


def test_keep_chunks_is_refused_on_a_real_model() -> None:
    import streambp_core
    from streambp_core.models import build_model

    model = build_model("tiny/llama", dtype=torch.float32, device="cpu")
    with pytest.raises(ConfigError, match="only on the meta device"):
        streambp_core.prepare(model, "streambp", keep_chunks=4)


@pytest.mark.parametrize("fields", [
    dict(method="streambp", optimizer="adamw", grads="fresh"),
    dict(method="checkpoint", optimizer="adamw", lora_rank=4),
    dict(method="streambp", optimizer="adamw", gpus=2, shard="zero3", offload="checkpoints"),
    dict(method="mst", optimizer="adamw", gpus=2, sp=2, shard="zero2"),
])
def test_an_optimizer_step_taken_from_the_memo_gives_its_phase_to_the_byte(fields) -> None:
    """A second step on the same model and optimizer (another length) takes the optimizer phase from the
    memo (`tracked._optimizer_phase`: no new key) and every phase's figures, at each simulated depth,
    equal those of the same step simulated on a fresh memo, whose optimizer step runs."""
    from streambp_core.step.simulation.simulate import _stepped, engine_spec

    def phases(spec, model):
        return [_stepped(engine_spec(spec), model.at_depth(depth), KEEP_CHUNKS, model.memo)
                for depth in (2, model.config.num_hidden_layers)]

    shared, fresh = ResolvedModel(TINY), ResolvedModel(TINY)
    first, second = (StepSpec.of(model=TINY, seq_len_tokens=tokens, **SMALL, **fields)
                     for tokens in (256, 384))
    phases(first, shared)
    keys = {key for key in shared.memo if isinstance(key, tuple) and key[:1] == ("optimizer phase",)}
    assert keys
    taken = phases(second, shared)
    assert {key for key in shared.memo if isinstance(key, tuple) and key[:1] == ("optimizer phase",)} == keys
    assert taken == phases(second, fresh)
    assert [phase.name for phase in taken[0].phases][-1] == "optimizer"
