"""`stream_trainer` on sharded engines: 2 CPU ranks (gloo) under accelerate's FSDP2 plugin and its DeepSpeed
plugin, 3 SGD steps with gradient accumulation 2, every parameter's update against single-process plain
(`integrations.sharded_parity`, its ranks started by `streambp_bench.verify.trainer_ranks`), and what a
sharded trainer cannot do exactly refused by name.

The runs with ranks (20-40 s each on 2 shared cores) are under `-m slow`, one per arming path and stage: TRL's
fused head on the streamed decoder stack under FSDP2; transformers' Trainer on the streamed loss under
DeepSpeed ZeRO-2; Trainer on ZeRO-3, whose run is prepared on the trainer's engine at each step; a model
loaded from weights under ZeRO-3. On DeepSpeed each trainable parameter is reduced exactly once per micro-step
(counted). The default run checks the plugins and refusals without ranks.
The matrix (every trainer, every method, both FSDP2 stages, ZeRO-1, 2 and 3, tied and untied heads) runs when
STREAMBP_TRAINER_MATRIX=full (or STREAMBP_DEEPSPEED_MATRIX=full) is set. The example accelerate configs are
read by accelerate's own launcher code (`accelerate launch` cannot start FSDP or DeepSpeed ranks on a CPU-only
machine) and the plugins they make are checked as `stream_trainer` checks them.
"""

from __future__ import annotations

import os
from dataclasses import replace
from pathlib import Path

import pytest
import torch

pytest.importorskip("trl", minversion="1.15")
pytest.importorskip("accelerate")

from streambp_bench.verify.trainer_ranks import run_sharded_parity  # noqa: E402
from streambp_core.config import ConfigError  # noqa: E402
from streambp_core.integrations.engines import deepspeed_refusals, fsdp2_refusals  # noqa: E402
from streambp_core.models import build_model  # noqa: E402
from streambp_core.models.load import tiny_config  # noqa: E402
from streambp_core.verify.trainer_setup import ParitySetup  # noqa: E402
from streambp_core.verify.trainer_sharded import engine_environment  # noqa: E402

EXAMPLES = Path(__file__).resolve().parents[2] / "examples" / "accelerate"
STREAM = {"partition_size": 5, "head_partition_size": 7}
FULL = "full" in (os.environ.get("STREAMBP_TRAINER_MATRIX"), os.environ.get("STREAMBP_DEEPSPEED_MATRIX"))


def deepspeed_installed() -> bool:
    try:
        import deepspeed  # noqa: F401
    except ImportError:
        return False
    return True


def setup_of(trainer: str, tied: bool = True) -> ParitySetup:
    return ParitySetup(trainer=trainer, model=tiny_config("qwen3", tie_word_embeddings=tied), rows=16)


def assert_sharded(results, methods) -> None:
    """Every method within its tolerances in every group, and every group moved in the reference."""
    assert [r.against_reference.method for r in results] == list(methods)
    for result in results:
        if result.engine == "deepspeed":  # every trainable parameter reduced once per micro-step
            assert result.reductions is not None and set(result.reductions) == {"1"}, result.reductions
            assert result.ok
        for against, parity in ((result.reference, result.against_reference),
                                ("plain on the engine", result.against_engine_plain)):
            assert {g.group for g in parity.groups} >= {"attention", "mlp", "norms"}, parity.groups
            for group in parity.groups:
                assert group.plain_update_norm > 0, f"{group.group} never moved: the comparison means nothing"
                assert group.rel_error <= parity.tolerance, (
                    f"{result.engine} {result.shard} {parity.method} {group.group}: {group.rel_error:.2e} > "
                    f"{parity.tolerance:.0e} against {against}")


@pytest.mark.slow
def test_fsdp2_sft_streambp_matches_single_process_plain():
    """TRL's SFT trainer, streamed decoder stack under TRL's fused head, FSDP2 zero3: exact against plain
    on the engine (float64), within TRL's float32 head against single-process plain."""
    results = run_sharded_parity(setup_of("sft"), engine="fsdp2", shard="zero3", nproc=2,
                                 methods=("streambp",), **STREAM)
    assert_sharded(results, ("streambp",))
    assert results[0].reference == "single-process plain"
    assert results[0].against_engine_plain.tolerance == 1e-10


@pytest.mark.slow
@pytest.mark.skipif(not deepspeed_installed(), reason="deepspeed is not installed")
def test_deepspeed_trainer_streambp_matches_single_process_plain():
    """transformers' Trainer, streamed loss, DeepSpeed ZeRO-2: the deferred reduction makes the update
    plain's on the engine; float32 masters bound it against single-process plain."""
    results = run_sharded_parity(setup_of("trainer", tied=False), engine="deepspeed", shard="zero2",
                                 nproc=2, methods=("streambp",), **STREAM)
    assert_sharded(results, ("streambp",))
    assert results[0].reference == "single-process plain on deepspeed"
    assert results[0].float64_plain_error is not None and results[0].float64_plain_error > 0


@pytest.mark.slow
@pytest.mark.skipif(not deepspeed_installed(), reason="deepspeed is not installed")
def test_deepspeed_zero3_trainer_streambp_matches_plain_on_the_engine():
    """transformers' Trainer, streamed loss, DeepSpeed ZeRO-3 (every parameter partitioned): the run is
    prepared on the trainer's engine at each step; the update is plain's on the engine, each parameter
    reduced once per micro-step (3 steps x accumulation 2 x 25 tensors)."""
    results = run_sharded_parity(setup_of("trainer", tied=False), engine="deepspeed", shard="zero3",
                                 nproc=2, methods=("streambp",), **STREAM)
    assert_sharded(results, ("streambp",))
    assert results[0].against_engine_plain.max_rel_error == 0.0
    assert results[0].reductions == {"1": 6 * 25}


@pytest.mark.slow
@pytest.mark.skipif(not deepspeed_installed(), reason="deepspeed is not installed")
@pytest.mark.parametrize("zero3_init", [False, True])
def test_deepspeed_zero3_a_model_loaded_from_weights_trains_as_plain(tmp_path, zero3_init):
    """A model directory with weights under ZeRO-3: built outside zero.Init as plain's (every run the
    same precision: zero.Init casts a float64 model it loads to float32), or, with `zero3_init`, loaded
    into zero.Init after the trainer's arguments as accelerate's `zero3_init_flag: true` does, so every
    parameter is partitioned before `stream_trainer` sees the model (float32). Each method's update is
    plain's on the engine (streambp in float32 within float32's bound: 1.1e-5 measured), each parameter
    reduced once."""
    dtype = torch.float32 if zero3_init else torch.float64
    build_model(tiny_config("qwen3", tie_word_embeddings=False), dtype=dtype, device="cpu",
                seed=0).save_pretrained(tmp_path)
    setup = ParitySetup(trainer="trainer", model=str(tmp_path), dtype=dtype, rows=16, zero3_init=zero3_init)
    methods = ("checkpoint", "streambp")
    results = run_sharded_parity(setup, engine="deepspeed", shard="zero3", nproc=2, methods=methods, **STREAM)
    assert_sharded(results, methods)
    assert results[0].against_engine_plain.max_rel_error == 0.0  # checkpoint: the same arithmetic
    if not zero3_init:  # float64 (float32 masters): streambp's chunks round below the masters' float32
        assert results[1].against_engine_plain.max_rel_error <= 1e-12
    assert all(r.reductions == {"1": 6 * 25} for r in results)


def test_zero3_init_needs_weights_and_float32(tmp_path):
    with pytest.raises(ConfigError, match="zero3 init needs a model directory with weights"):
        ParitySetup(trainer="trainer", model=tiny_config("qwen3"), dtype=torch.float32, zero3_init=True)
    build_model(tiny_config("qwen3"), dtype=torch.float32, device="cpu", seed=0).save_pretrained(tmp_path)
    with pytest.raises(ConfigError, match="zero3 init trains in float32"):
        ParitySetup(trainer="trainer", model=str(tmp_path), zero3_init=True)


MATRIX = [(engine, shard, trainer, tied) for engine, shard in (("fsdp2", "zero2"), ("fsdp2", "zero3"),
                                                              ("deepspeed", "zero1"), ("deepspeed", "zero2"),
                                                              ("deepspeed", "zero3"))
          for trainer in ("trainer", "sft", "dpo", "grpo") for tied in (True, False)]


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="the sharded trainer matrix runs with STREAMBP_TRAINER_MATRIX=full")
@pytest.mark.parametrize(("engine", "shard", "trainer", "tied"), MATRIX, ids=str)
def test_sharded_matrix(engine, shard, trainer, tied):
    if engine == "deepspeed" and not deepspeed_installed():
        pytest.skip("deepspeed is not installed")
    methods = ("checkpoint", "mst", "streambp")
    results = run_sharded_parity(setup_of(trainer, tied), engine=engine, shard=shard, nproc=2,
                                 methods=methods, **STREAM)
    assert_sharded(results, methods)


@pytest.mark.slow
@pytest.mark.skipif(not FULL, reason="the sharded trainer matrix runs with STREAMBP_TRAINER_MATRIX=full")
@pytest.mark.skipif(not deepspeed_installed(), reason="deepspeed is not installed")
@pytest.mark.parametrize("trainer", ["trainer", "sft"])
def test_deepspeed_zero3_lora(trainer):
    """LoRA rank 4 on ZeRO-3 (the adapters alone trained, the base weights partitioned and frozen)."""
    methods = ("checkpoint", "mst", "streambp")
    setup = replace(setup_of(trainer, tied=False), lora_rank=4)
    results = run_sharded_parity(setup, engine="deepspeed", shard="zero3", nproc=2, methods=methods, **STREAM)
    assert [r.against_reference.method for r in results] == list(methods)
    for result in results:
        assert result.ok and set(result.reductions) == {"1"}, result.to_dict()
        assert {g.group for g in result.against_engine_plain.groups} >= {"lora attention", "lora mlp"}
        assert all(g.plain_update_norm > 0 for g in result.against_engine_plain.groups)


def fsdp_plugin(monkeypatch, **env: str):
    """accelerate's FSDP plugin as a rank of `accelerate launch` builds it from its environment."""
    from accelerate.utils import FullyShardedDataParallelPlugin

    for name, value in {**engine_environment("fsdp2", "zero3"), **env}.items():
        monkeypatch.setenv(name, value)
    return FullyShardedDataParallelPlugin()


def refused(refusals) -> list[str]:
    return [setting for is_refused, setting, _ in refusals if is_refused]


@pytest.fixture(scope="module")
def tiny_model():
    return build_model(tiny_config("qwen3"), dtype=torch.float64, device="cpu", seed=0)


def test_fsdp2_plugin_of_one_unit_per_layer_is_taken(monkeypatch, tiny_model):
    assert refused(fsdp2_refusals(fsdp_plugin(monkeypatch), tiny_model)) == []
    named = fsdp_plugin(monkeypatch, FSDP_TRANSFORMER_CLS_TO_WRAP="Qwen3DecoderLayer")
    assert refused(fsdp2_refusals(named, tiny_model)) == []


@pytest.mark.parametrize(("env", "setting"), [
    ({"FSDP_AUTO_WRAP_POLICY": "SIZE_BASED_WRAP", "FSDP_MIN_NUM_PARAMS": "1000"}, "auto wrap policy"),
    ({"FSDP_AUTO_WRAP_POLICY": "NO_WRAP"}, "auto wrap policy NO_WRAP"),
    ({"FSDP_TRANSFORMER_CLS_TO_WRAP": "Qwen3MLP"}, "Qwen3MLP"),
    ({"FSDP_OFFLOAD_PARAMS": "true"}, "CPU offload"),
    ({"FSDP_ACTIVATION_CHECKPOINTING": "true"}, "fsdp_activation_checkpointing"),
    ({"FSDP_CPU_RAM_EFFICIENT_LOADING": "true", "FSDP_SYNC_MODULE_STATES": "true"},
     "fsdp_cpu_ram_efficient_loading"),
])
def test_fsdp2_plugin_settings_the_streamed_layout_cannot_honour_are_refused(monkeypatch, tiny_model, env,
                                                                              setting):
    names = refused(fsdp2_refusals(fsdp_plugin(monkeypatch, **env), tiny_model))
    assert len(names) == 1 and setting in names[0], names


class _DeepSpeedPlugin:
    def __init__(self, zero: dict) -> None:
        self.deepspeed_config = {"zero_optimization": zero}


@pytest.mark.skipif(not deepspeed_installed(), reason="deepspeed is not installed")
@pytest.mark.parametrize(("zero", "setting"), [
    ({"stage": 1}, None), ({"stage": 2}, None), ({"stage": 3}, None),
    ({"stage": 0}, "DeepSpeed zero_stage 0"),
    ({"stage": 2, "offload_optimizer": {"device": "cpu"}}, "DeepSpeed offload_optimizer"),
])
def test_deepspeed_plugin_stages(zero, setting):
    names = refused(deepspeed_refusals(_DeepSpeedPlugin(zero)))
    assert names == ([] if setting is None else [setting])


@pytest.mark.parametrize(("per_generation", "iterations", "method", "refused_setting"), [
    (2, 1, "streambp", None), (4, 1, "mst", None), (1, 2, "streambp", None),
    (1, 1, "streambp", "steps_per_generation x num_iterations = 1"), (3, 1, "mst", "= 3"),
    (1, 1, "checkpoint", None),  # no units: nothing holds DeepSpeed's hooks off between micro-steps
])
def test_zero3_refuses_generation_inside_an_optimizer_step(per_generation, iterations, method,
                                                           refused_setting):
    """GRPO generates every steps_per_generation x num_iterations micro-steps; under ZeRO-3 the run of a
    method with units is open through an optimizer step (accumulation 2 here), so generation must fall
    on step boundaries."""
    from types import SimpleNamespace

    from streambp_core.integrations.zero3_trainer import zero3_refusals

    args = SimpleNamespace(steps_per_generation=per_generation, num_iterations=iterations,
                           gradient_accumulation_steps=2)
    names = refused(zero3_refusals(SimpleNamespace(args=args), method))
    assert len(names) == (refused_setting is not None), names
    if refused_setting is not None:
        assert refused_setting in names[0] and "ZeRO-3" in names[0]
    no_generation = SimpleNamespace(args=SimpleNamespace(gradient_accumulation_steps=2))
    assert zero3_refusals(no_generation, method) == []


def launch_environment(config_file: Path) -> dict[str, str]:
    """The environment `accelerate launch --config_file FILE script.py` gives each rank, by accelerate's own
    launcher code (the config read and merged as `launch_command` does)."""
    from accelerate.commands.launch import _validate_launch_command, launch_command_parser
    from accelerate.utils.launch import prepare_deepspeed_cmd_env, prepare_multi_gpu_env

    args = launch_command_parser().parse_args(["--config_file", str(config_file), "examples/train_sft.py"])
    args, defaults, _ = _validate_launch_command(args)
    assert args.num_processes == 2 and not args.cpu
    if args.use_deepspeed:
        args.deepspeed_fields_from_accelerate_config = ",".join(defaults.deepspeed_config)
        return prepare_deepspeed_cmd_env(args)[1]
    assert args.use_fsdp
    return prepare_multi_gpu_env(args)


def test_example_fsdp2_config_launches_the_checked_plugin(monkeypatch, tiny_model):
    env = launch_environment(EXAMPLES / "fsdp2.yaml")
    checked = engine_environment("fsdp2", "zero3")
    assert {name: env.get(name) for name in checked} == checked  # what the 2-rank cells run under
    for name, value in env.items():
        if name.startswith(("FSDP_", "ACCELERATE_")):
            monkeypatch.setenv(name, value)
    from accelerate.utils import FullyShardedDataParallelPlugin

    assert refused(fsdp2_refusals(FullyShardedDataParallelPlugin(), tiny_model)) == []


@pytest.mark.skipif(not deepspeed_installed(), reason="deepspeed is not installed")
def test_example_deepspeed_config_launches_zero2(monkeypatch, tmp_path):
    env = launch_environment(EXAMPLES / "deepspeed_zero2.yaml")
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "2"
    for name, value in env.items():
        if name.startswith("ACCELERATE_"):
            monkeypatch.setenv(name, value)
    from accelerate.utils import DeepSpeedPlugin

    assert refused(deepspeed_refusals(DeepSpeedPlugin())) == []
    offload = tmp_path / "offload.yaml"
    text = (EXAMPLES / "deepspeed_zero2.yaml").read_text()
    offload.write_text(text.replace("offload_optimizer_device: none", "offload_optimizer_device: cpu"))
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE",
                       launch_environment(offload)["ACCELERATE_DEEPSPEED_OFFLOAD_OPTIMIZER_DEVICE"])
    assert refused(deepspeed_refusals(DeepSpeedPlugin())) == ["DeepSpeed offload_optimizer"]


@pytest.mark.skipif(not deepspeed_installed(), reason="deepspeed is not installed")
def test_example_deepspeed_zero3_config_launches_zero3(monkeypatch):
    env = launch_environment(EXAMPLES / "deepspeed_zero3.yaml")
    assert env["ACCELERATE_USE_DEEPSPEED"] == "true" and env["ACCELERATE_DEEPSPEED_ZERO_STAGE"] == "3"
    assert {name: env[name] for name in engine_environment("deepspeed", "zero3")} == \
        engine_environment("deepspeed", "zero3")  # what the 2-rank cells run under
    for name, value in env.items():
        if name.startswith("ACCELERATE_"):
            monkeypatch.setenv(name, value)
    from accelerate.utils import DeepSpeedPlugin

    plugin = DeepSpeedPlugin()
    assert plugin.deepspeed_config["zero_optimization"]["stage"] == 3
    assert refused(deepspeed_refusals(plugin)) == []


def test_sharded_check_refuses_before_any_rank_starts():
    with pytest.raises(ConfigError, match="--shard for fsdp2 must be one of zero2, zero3"):
        run_sharded_parity(setup_of("sft"), engine="fsdp2", shard="zero1", nproc=2, methods=("streambp",))
    with pytest.raises(ConfigError, match="--engine must be one of fsdp2, deepspeed"):
        run_sharded_parity(setup_of("sft"), engine="ddp", shard="zero2", nproc=2, methods=("streambp",))
    with pytest.raises(ConfigError, match="nproc 999"):
        run_sharded_parity(setup_of("sft"), engine="fsdp2", shard="zero2", nproc=999, methods=("streambp",))


@pytest.mark.parametrize(("args", "words"), [
    (["--nproc", "2", "--engine", "deepspeed", "--shard", "zero4"], ("deepspeed shard must be one of",)),
    (["--shard", "zero2"], ("--shard needs --nproc",)),
    (["--engine", "deepspeed"], ("--engine deepspeed needs --nproc",)),
    (["--nproc", "2", "--shard", "zero1"], ("--shard for fsdp2",)),
    (["--nproc", "2", "--device", "cuda"], ("cpu ranks",)),
])
def test_cli_refuses_in_one_line_before_any_rank_starts(args, words):
    from typer.testing import CliRunner

    from streambp_bench.cli import app
    from tests.cli.errors import one_line_error

    if "deepspeed" in args and not deepspeed_installed():
        pytest.skip("deepspeed is not installed")
    result = CliRunner().invoke(app, ["verify", "trainer", "sft", "-m", "tiny/qwen3", "--dtype", "float64",
                                      *args])
    one_line_error(result, *words)


def test_an_optimizer_setting_torch_refuses_stops_before_any_rank_starts(monkeypatch):
    monkeypatch.setattr("streambp_core.parallel.launch.run_ranks",
                        lambda *a, **k: pytest.fail("ranks started despite a refused optimizer setting"))
    setup = replace(setup_of("sft"), settings={"optim": "adamw_torch", "adam_beta2": -0.5})
    with pytest.raises(ConfigError, match="SFTTrainer's optimizer: Invalid beta parameter at index 1"):
        run_sharded_parity(setup, engine="fsdp2", shard="zero2", nproc=2, methods=("streambp",))


@pytest.mark.parametrize(("broken", "named"), [
    ("single-process", "the reference, single-process plain, trained to a non-finite update"),
    ("on the engine", "the reference, plain on 2 fsdp2 ranks, trained to a non-finite update"),
])
def test_a_reference_that_is_not_finite_is_reported_broken_not_blamed_on_the_method(monkeypatch, broken,
                                                                                    named):
    """Single-process plain or plain on the engine whose own update holds NaN (as float64 eager Gemma 2
    on padded rows gave before its softmax was widened) is the reference broken, not a method failing."""
    from streambp_core.verify.trainer_parity import BrokenReference

    good = {"model.embed_tokens.weight": torch.ones(4, dtype=torch.float64)}
    nan = {"model.embed_tokens.weight": torch.tensor([1.0, float("nan"), 1.0, 1.0], dtype=torch.float64)}
    on_engine = nan if broken == "on the engine" else good
    monkeypatch.setattr("streambp_core.verify.trainer_sharded.check_settings", lambda setup: None)
    monkeypatch.setattr("streambp_core.parallel.launch.run_ranks",
                        lambda *a, **k: [({"plain": on_engine, "streambp": good}, False, None), None])
    monkeypatch.setattr("streambp_core.verify.trainer_sharded.single_process_plain",
                        lambda setup, nproc: nan if broken == "single-process" else good)
    with pytest.raises(BrokenReference, match=named):
        run_sharded_parity(setup_of("sft"), engine="fsdp2", shard="zero2", nproc=2, methods=("streambp",))
