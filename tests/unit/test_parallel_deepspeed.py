"""DeepSpeed ZeRO as an engine. Without ranks: the version floor, the stage names, what a model under no
engine gets, and the verify command's bad input (one error line, exit 2, before any rank starts). With two
real gloo ranks on the CPU: the user's DeepSpeed loop (`prepare(engine.module, ...)`, `engine.backward`,
`engine.step`) hands its optimizer plain's gradient and applies that optimizer's step on it, with gradient
accumulation over two micro-steps, and ZeRO reduces every parameter exactly once (counted: per
micro-step on ZeRO-2, per step on ZeRO-1, which reduces at the accumulation boundary). The default run
takes one cell with ranks, streambp on ZeRO-3 (tied head: every parameter partitioned); `-m slow` ZeRO-2,
the other head, float32 parameters, DeepSpeed's offload, LoRA and MoE, and the uneven-lengths count."""

from __future__ import annotations

import os

import pytest
import torch

import streambp_core
from streambp_core.config import ConfigError
from streambp_core.engine.engines.reduction import (
    check_version,
    one_reduction_for,
    version_tuple,
    zero_stage_of,
)
from streambp_core.models import build_model, load_config
from streambp_core.parallel.launch import available_cpus
from streambp_core.tiers import Tiers
from streambp_core.verify.methods import VerifySpec

deepspeed = pytest.importorskip("deepspeed")
two_cores = pytest.mark.skipif(available_cpus() < 2, reason="needs two CPU cores for two ranks")


def test_version_floor_is_refused_by_name():
    assert version_tuple("0.19.8+cpu") == (0, 19, 8)
    assert version_tuple("0.17") == (0, 17, 0)
    check_version("0.17.0")
    with pytest.raises(ConfigError, match="deepspeed 0.16.9 is below 0.17.0"):
        check_version("0.16.9")


def test_a_model_under_no_engine_is_left_alone():
    model = build_model(load_config("tiny/llama"), dtype=torch.float64, device="cpu", seed=0)
    assert zero_stage_of(model) is None
    assert one_reduction_for(model, "streambp") is None
    with streambp_core.prepare(model, "streambp") as run:
        assert run._reduction is None


def test_zero3_marks_need_the_engine_itself():
    model = build_model(load_config("tiny/llama"), dtype=torch.float64, device="cpu", seed=0)
    for param in model.parameters():
        param.ds_id = 0  # the mark ZeRO-3 leaves on a parameter it partitions
    assert zero_stage_of(model) == 3
    assert one_reduction_for(model, "streambp") is None  # ZeRO-3: the units hand each gradient over once
    for method in ("plain", "streambp"):
        with pytest.raises(ConfigError, match="under deepspeed zero3, prepare the engine itself"):
            streambp_core.prepare(model, method)


@pytest.mark.parametrize("args, message", [
    (["deepspeed", "--nproc", "2", "--shard", "zero4"], "'zero4' is not one of 'zero1', 'zero2', 'zero3'"),
    (["deepspeed"], "Missing option '--nproc'"),
    (["deepspeed", "--nproc", "2", "--device", "cuda"], "No such option: --device"),
    (["deepspeed", "--nproc", "99999", "--shard", "zero2"], "nproc 99999 is more than"),
    (["deepspeed", "--nproc", "2", "--dtype", "bfloat16"], "exact dtypes"),
    (["deepspeed", "--nproc", "2", "--optimizer", "lamb"], "'lamb' is not one of 'adam', 'sgd'"),
    (["fsdp", "--nproc", "2", "--shard", "zero1"], "'zero1' is not one of 'zero2', 'zero3'"),
])
def test_verify_bad_input_is_one_error_line(args, message):
    from typer.testing import CliRunner

    from streambp_bench.cli import app

    subcommand, *options = args
    result = CliRunner().invoke(app, ["verify", subcommand, "-m", "tiny/llama", "--dtype", "float64",
                                      "--method", "streambp", *options])
    assert result.exit_code == 2, result.output
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and message in lines[0], result.output


def test_a_missing_or_old_deepspeed_is_refused_before_ranks(monkeypatch):
    import importlib.metadata

    from streambp_bench.verify.deepspeed import sharded_stages

    def missing(name):
        raise importlib.metadata.PackageNotFoundError(name)

    monkeypatch.setattr(importlib.metadata, "version", missing)
    with pytest.raises(ConfigError, match="engine deepspeed is not installed"):
        sharded_stages("deepspeed", "zero2")
    monkeypatch.setattr(importlib.metadata, "version", lambda name: "0.16.0")
    with pytest.raises(ConfigError, match="below 0.17.0"):
        sharded_stages("deepspeed", "zero2")


def _verify(model, methods, shards, objective="sft", micro_steps=2, offload="none", cpu_adam=False, **step):
    from streambp_core.verify.deepspeed import verify_deepspeed

    fields = {"seq_len_tokens": 32, "batch_size": 2, "partition_size": 8, "head_partition_size": 8, **step}
    spec = VerifySpec.of(model=model, methods=methods, dtype="float64", padding="right", objective=objective,
                         **fields)
    return verify_deepspeed((spec,), nproc=2, shards=shards, micro_steps=micro_steps, offload=offload,
                            cpu_adam=cpu_adam, timeout_s=600)


def _check(results, expected):
    assert {(r.method, r.shard) for r in results} == expected
    for r in results:  # ZeRO reduces into float32 whatever the parameters' dtype: float32's bound
        assert r.grad_err <= 1e-5, (r.method, r.shard, r.grad_err, r.worst_param)
        # the engine's optimizer on the reduced gradient from its masters: the applied update to the bit
        assert r.step_err == 0.0, (r.method, r.shard, r.step_err)
        assert r.reductions and set(r.reductions) == {"1"}, (r.method, r.shard, r.reductions)
        assert r.ok


def test_a_gradient_or_update_off_plains_fails_the_check():
    """The two figures judge: a gradient reduced twice (doubled) fails the gradient's bound, an update
    that is not the optimizer's step on it fails the step's, a parameter reduced twice fails the count."""
    from collections import Counter

    from streambp_core.verify.deepspeed import EngineStep, _result

    spec = VerifySpec.of(model="tiny/llama", methods=("streambp",), dtype="float32")
    grads = {"w": torch.tensor([1.0, -2.0, 3.0])}
    update = {"w": torch.tensor([-1e-3, 1e-3, -1e-3])}

    def judged(run):
        return _result("streambp", "zero2", spec, 2, 1, run, grads, update)

    assert judged(EngineStep(grads=grads, update=update, own_step=update, reductions=Counter({"1": 1}))).ok
    doubled = EngineStep(grads={"w": 2 * grads["w"]}, update=update, own_step=update,
                         reductions=Counter({"1": 1}))
    assert not judged(doubled).ok and judged(doubled).grad_err == pytest.approx(0.5)  # |g| / (|g| + |g|)
    stale = EngineStep(grads=grads, update={"w": torch.zeros(3)}, own_step=update,
                       reductions=Counter({"1": 1}))
    assert not judged(stale).ok and judged(stale).step_err == pytest.approx(1.0)
    twice = EngineStep(grads=grads, update=update, own_step=update, reductions=Counter({"2+": 1}))
    assert not judged(twice).ok


@pytest.mark.slow
@two_cores
def test_float32_parameters_hand_the_optimizer_plains_gradient():
    """The issue's float32 figure: with float32 parameters every method's reduced gradient is within
    1e-5 of single-process plain's (float32's rounding of another summation order) and the applied
    update is the engine's Adam step on it; the update against plain's gradient stepped by Adam is only
    reported (Adam's first step divides each element by its own size)."""
    from streambp_core.verify.deepspeed import verify_deepspeed

    spec = VerifySpec.of(model="tiny/qwen3", methods=("plain", "streambp"), dtype="float32",
                         seq_len_tokens=64, partition_size=16, head_partition_size=16)
    results = verify_deepspeed((spec,), nproc=2, shards=("zero2",), micro_steps=2, timeout_s=600)
    _check(results, {("plain", "zero2"), ("streambp", "zero2")})
    assert all(r.grad_err > 0 for r in results)  # float32 sums in another order: not bitwise


@two_cores
@pytest.mark.slow
@pytest.mark.parametrize("model", ["tiny/llama", "tiny/qwen3"])  # untied and tied embedding and head
def test_streambp_on_zero2_applies_plains_update_with_one_reduction_each(model):
    _check(_verify(model, ("streambp",), ("zero2",)), {("streambp", "zero2")})


@two_cores
@pytest.mark.parametrize("model", [pytest.param("tiny/llama", marks=pytest.mark.slow), "tiny/qwen3"])
def test_streambp_on_zero3_applies_plains_update_with_one_reduction_each(model):
    _check(_verify(model, ("streambp",), ("zero3",)), {("streambp", "zero3")})


@pytest.mark.slow
@two_cores
@pytest.mark.parametrize("objective", ["sft", "grpo", "dpo"])
@pytest.mark.parametrize("model", ["tiny/llama", "tiny/qwen3"])
def test_every_method_on_every_stage(model, objective):
    """Every method, ZeRO-1/2/3, both heads, every objective: behind STREAMBP_DEEPSPEED_MATRIX=full but
    for one cell (tied head, grpo) that runs by default."""
    if (model, objective) != ("tiny/qwen3", "grpo") and os.environ.get("STREAMBP_DEEPSPEED_MATRIX") != "full":
        pytest.skip("the full DeepSpeed matrix runs with STREAMBP_DEEPSPEED_MATRIX=full")
    methods = ("plain", "checkpoint", "mst", "streambp")
    shards = ("zero1", "zero2", "zero3")
    results = _verify(model, methods, shards, objective=objective)
    _check(results, {(m, s) for m in methods for s in shards})


def test_the_offload_tiers_map_onto_deepspeeds_sections():
    from streambp_core.parallel.deepspeed import offload_sections, zero_config

    config = zero_config(3, micro_batch=1, offload="checkpoints,optimizer,params")
    zero = config["zero_optimization"]
    assert zero["offload_optimizer"] == zero["offload_param"] == {"device": "cpu"}
    assert config["zero_force_ds_cpu_optimizer"] is False  # torch's Adam steps the host partitions
    assert config["optimizer"]["params"]["torch_adam"] is True
    cpu_adam = zero_config(3, micro_batch=1, offload="optimizer", cpu_adam=True)
    assert "zero_force_ds_cpu_optimizer" not in cpu_adam and not cpu_adam["optimizer"]["params"]["torch_adam"]
    assert "offload_param" not in cpu_adam["zero_optimization"]
    assert offload_sections(Tiers(checkpoints=True), 2) == {} and offload_sections(Tiers.NONE, 3) == {}
    assert "offload_optimizer" not in zero_config(3, micro_batch=1)["zero_optimization"]
    with pytest.raises(ConfigError, match="offloads parameters under zero3 only"):
        offload_sections(Tiers(optimizer=True, params=True), 2)


def test_a_tier_under_deepspeed_is_its_section_or_refused_by_name():
    """The optimizer and params tiers under DeepSpeed are its offload sections: accepted when the
    engine's config has them on (the run then holds no host tier of its own), refused by name otherwise,
    and params below ZeRO-3 refused; checkpoints needs nothing of DeepSpeed."""
    from types import SimpleNamespace

    from streambp_core.engine.engines.deepspeed_tiers import check_deepspeed_tiers, engine_tiers

    class Engine:  # the two accessors of a DeepSpeedEngine the check reads
        def __init__(self, *tiers):
            self.tiers = tiers

        def zero_offload_optimizer(self):
            return SimpleNamespace(device="cpu") if "optimizer" in self.tiers else None

        def zero_offload_param(self):
            return SimpleNamespace(device="cpu" if "params" in self.tiers else "none")

    assert engine_tiers(Engine("optimizer", "params")) == ("optimizer", "params")
    assert engine_tiers(Engine()) == ()
    check_deepspeed_tiers("streambp", Tiers.ALL, 3, Engine("optimizer", "params"))
    check_deepspeed_tiers("streambp", Tiers(checkpoints=True), 3, None)
    with pytest.raises(ConfigError, match=r"offload params under deepspeed is DeepSpeed's own: set "
                                          r"zero_optimization.offload_param to \{device: cpu\}"):
        check_deepspeed_tiers("mst", Tiers(optimizer=True, params=True), 3, Engine("optimizer"))
    with pytest.raises(ConfigError, match="prepare the engine itself"):
        check_deepspeed_tiers("checkpoint", Tiers(optimizer=True), 2, None)
    model = build_model(load_config("tiny/llama"), dtype=torch.float64, device="cpu", seed=0)
    for param in model.parameters():
        param._hp_mapping = None  # the mark ZeRO-1/2 leave on a parameter
    with pytest.raises(ConfigError, match="DeepSpeed offloads parameters under ZeRO-3 only"):
        streambp_core.prepare(model, "streambp", offload="optimizer,params")


def _check_offload(results, expected, offload):
    _check(results, expected)
    for r in results:  # the host partitions hold the same reduced gradient, to the bit
        assert r.offload == offload and r.offload_err == 0.0, (r.method, r.offload_err)


@pytest.mark.slow
@two_cores
def test_streambp_with_deepspeeds_offload_applies_the_update_without_it():
    """ZeRO-3 with `offload_optimizer` and `offload_param` on the CPU (torch's Adam on the host
    partitions): the host partitions hold the same reduced gradient as without offload, to the bit, within
    float32's rounding of single-process plain's, and the applied update is the Adam step on it, one
    reduction per parameter."""
    results = _verify("tiny/qwen3", ("streambp",), ("zero3",), offload="optimizer,params")
    _check_offload(results, {("streambp", "zero3")}, "optimizer,params")


@pytest.mark.slow
@two_cores
@pytest.mark.parametrize("cpu_adam", [False, True])
@pytest.mark.parametrize("offload", ["optimizer", "optimizer,params"])
@pytest.mark.parametrize("model", ["tiny/llama", "tiny/qwen3"])
def test_every_method_with_deepspeeds_offload(model, offload, cpu_adam):
    """Every method under ZeRO-3 with DeepSpeed's offload, torch's Adam (its step on the reduced gradient
    to the bit) or DeepSpeed's CPU Adam (compiled on first use; its own step on it, to the bit too),
    the host partitions' gradient equal to the one without offload: behind STREAMBP_DEEPSPEED_MATRIX=full."""
    if os.environ.get("STREAMBP_DEEPSPEED_MATRIX") != "full":
        pytest.skip("the full DeepSpeed matrix runs with STREAMBP_DEEPSPEED_MATRIX=full")
    methods = ("plain", "checkpoint", "mst", "streambp")
    results = _verify(model, methods, ("zero3",), objective="grpo", offload=offload, cpu_adam=cpu_adam)
    _check_offload(results, {(m, "zero3") for m in methods}, offload)


@pytest.mark.slow
@two_cores
def test_zero3_lora_and_moe_apply_plains_update_with_one_reduction_each(tmp_path):
    """LoRA adapters (frozen base weights gathered, adapters reduced) and a mixture-of-experts model
    (DeepSpeed marks its MoE blocks as leaf modules: plain and checkpoint reduce them from the block,
    streambp and mst from their units), four tokens a rank over sixteen experts."""
    from streambp_core.models.load import tiny_config

    _check(_verify("tiny/qwen3", ("streambp",), ("zero3",), lora_rank=4), {("streambp", "zero3")})
    tiny_config("qwen3-moe", num_experts=16).save_pretrained(tmp_path)
    methods = ("checkpoint", "mst", "streambp")
    results = _verify(str(tmp_path), methods, ("zero3",), seq_len_tokens=4, batch_size=1, partition_size=2,
                      head_partition_size=2)
    _check(results, {(m, "zero3") for m in methods})


@pytest.mark.slow
@two_cores
def test_zero3_chunks_issue_no_collective_so_uneven_lengths_cannot_deadlock():
    """Ranks with 2 and 6 chunks a layer: each unit (2 layers, the head) is all-gathered once for its
    forward and once for its backward on both, the same count whatever the length."""
    from streambp_core.parallel.launch import run_ranks
    from tests.unit.parallel_ranks import zero3_uneven_lengths

    per_rank = run_ranks(zero3_uneven_lengths, 2, timeout_s=300)
    assert [r["chunks"] for r in per_rank] == [2, 6]
    assert [r["units"] for r in per_rank] == [3, 3]
    assert [r["gathers"] for r in per_rank] == [6, 6]


@pytest.mark.slow
@two_cores
def test_zero3_units_gather_partitions_deepspeed_keeps_in_host_memory():
    """With DeepSpeed's `offload_param` every partition lives in DeepSpeed's host buffer (on CPU ranks
    both are host memory; the check is that the units gather from DeepSpeed's offloaded partitions):
    the units still gather once each way, whatever the length."""
    from streambp_core.parallel.launch import run_ranks
    from tests.unit.parallel_ranks import zero3_uneven_lengths

    per_rank = run_ranks(zero3_uneven_lengths, 2, args=("optimizer,params",), timeout_s=300)
    assert [r["gathers"] for r in per_rank] == [6, 6]
    assert all(r["in_host_buffer"] == r["params"] > 0 for r in per_rank), per_rank
