"""The real `streambp-bench` app through Typer's CliRunner: help, bad input, verify."""

from __future__ import annotations

import json

import pytest

from streambp_bench import cli
from streambp_bench.cli import app
from streambp_core.models import list_presets
from streambp_core.verify import methods as verify_module
from tests.cli.errors import one_line_error

TINY_VERIFY = ["verify", "--model", "tiny/qwen3", "--seq-len", "24", "--ps", "7", "--ps-head", "5"]
TINY_FSDP = ["verify", "fsdp", *TINY_VERIFY[1:]]



def test_root_help_lists_the_commands(runner):
    result = runner.invoke(app, ["--help"])
    assert result.exit_code == 0
    assert all(command in result.output for command in ("verify", "presets", "plot"))


@pytest.mark.parametrize("command", ["verify", "presets", "plot"])
def test_each_command_help_has_example_invocations(runner, command):
    result = runner.invoke(app, [command, "--help"])
    assert result.exit_code == 0
    assert "Examples" in result.output
    assert f"streambp-bench {command}" in result.output


def test_unknown_model_error_lists_every_preset(runner):
    result = runner.invoke(app, ["verify", "--model", "Qwen/Qwen3-9000B"])
    line = one_line_error(result)
    assert all(name in line for name in list_presets())


def test_cuda_without_a_gpu_is_a_one_line_error(runner, monkeypatch):
    monkeypatch.setattr("torch.cuda.is_available", lambda: False)
    result = runner.invoke(app, [*TINY_VERIFY, "--device", "cuda"])
    assert result.exit_code == 2
    assert "cuda" in one_line_error(result)


def test_verify_json_in_float64_matches_plain_for_every_method(runner):
    result = runner.invoke(
        app, [*TINY_VERIFY, "--dtype", "float64", "--padding", "right", "-b", "2", "--json"]
    )
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    assert (report["reference"], report["dtype"], report["source"]) == ("plain", "float64", "measured-cpu")
    assert [row["method"] for row in report["results"]] == ["checkpoint", "mst", "streambp"]
    for row in report["results"]:
        assert row["ok"] is True
        assert row["max_rel_err"] <= 1e-10
        assert set(row) >= {"method", "max_rel_err", "loss_abs_err", "ok"}


def test_verify_table_says_how_it_was_measured(runner):
    result = runner.invoke(app, [*TINY_VERIFY, "--method", "streambp", "--padding", "left"])
    assert result.exit_code == 0, result.output
    assert "streambp" in result.output and "pass" in result.output
    assert "measured-cpu" in result.output


def test_verify_exits_1_when_a_method_exceeds_the_tolerance(runner, monkeypatch):
    monkeypatch.setitem(verify_module.TOLERANCE, "float32", -1.0)
    result = runner.invoke(app, [*TINY_VERIFY, "--method", "checkpoint"])
    assert result.exit_code == 1
    assert "FAIL" in result.output


def test_main_turns_a_config_error_into_exit_2(monkeypatch, capsys):
    monkeypatch.setattr("sys.argv", ["streambp-bench", "verify", "--model", "nope"])
    with pytest.raises(SystemExit) as exit_info:
        cli.main()
    assert exit_info.value.code == 2
    assert capsys.readouterr().err.startswith("error: unknown model 'nope'")


@pytest.mark.parametrize(("args", "expected"), [
    ([], "Missing option '--nproc'"),
    (["--nproc", "0"], "--nproc must be at least 1"),
    (["--nproc", "4096"], "more than the"),
    (["--nproc", "2", "--shard", "zero1"], "'zero1' is not one of 'zero2', 'zero3'"),
    (["--nproc", "2", "--dtype", "bfloat16"], "exact dtypes"),
])
def test_sharded_verify_bad_input_is_one_line_before_any_rank_starts(runner, args, expected):
    result = runner.invoke(app, [*TINY_FSDP, *args])
    assert result.exit_code == 2, result.output
    assert expected in one_line_error(result)


def test_sharded_verify_without_the_backend_is_one_line(runner, monkeypatch):
    import torch.distributed as dist

    monkeypatch.setattr(dist, "is_gloo_available", lambda: False)
    result = runner.invoke(app, [*TINY_FSDP, "--nproc", "1", "--device", "cpu"])
    assert result.exit_code == 2
    assert "backend gloo is not available" in one_line_error(result)


@pytest.mark.slow
def test_sharded_verify_two_ranks_prints_collectives_per_layer(runner):
    from streambp_core.parallel.launch import available_cpus

    if available_cpus() < 2:
        pytest.skip("needs two CPU cores for two ranks")
    result = runner.invoke(app, [*TINY_FSDP, "--dtype", "float64", "--nproc", "2", "--shard", "zero2",
                                 "--method", "streambp", "--json"])
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    (row,) = document["results"]
    assert document["source"] == "measured-cpu" and row["ok"] and row["max_rel_err"] <= 1e-10
    assert (row["all_gathers"], row["reduce_scatters"]) == (row["units"], row["units"])


def test_verify_optimizer_checks_every_host_tier_against_plain_s_device_step(runner):
    """--offload checkpoints,optimizer,params needs an optimizer: with --optimizer adamw each method steps
    AdamW (on the host with the optimizer tier, onto host weights with params), and both the gradients AdamW
    receives and the update it applies equal plain's device step in float64."""
    args = [*TINY_VERIFY, "--dtype", "float64", "--method", "checkpoint,streambp", "--optimizer", "adamw",
            "--offload", "all", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert document["spec"]["optimizer"] == "adamw" and document["ok"]
    assert document["spec"]["offload"] == "checkpoints,optimizer,params"
    for entry in document["results"]:
        assert entry["max_rel_err"] <= 1e-12 and 0 <= entry["max_update_err"] <= 1e-12, entry


def test_verify_optimizer_update_err_sees_a_wrong_step(runner, monkeypatch):
    """The update is compared, not only the gradients: a host step at a different learning rate fails."""
    from streambp_core.engine.host.optimizer import HostAdamW

    step = HostAdamW.step
    monkeypatch.setattr(HostAdamW, "step", lambda self, closure=None: (
        [group.update(lr=group["lr"] * 2) for group in self.param_groups], step(self))[1])
    args = [*TINY_VERIFY, "--dtype", "float64", "--method", "streambp", "--optimizer", "adamw", "--offload",
            "optimizer", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 1, result.output
    (entry,) = json.loads(result.stdout)["results"]
    assert entry["max_rel_err"] <= 1e-12 and entry["max_update_err"] > 0.1


def test_verify_optimizer_in_bfloat16_is_refused_by_name(runner):
    one_line_error(runner.invoke(app, [*TINY_VERIFY, "--dtype", "bfloat16", "--optimizer", "adamw"]),
                   "--optimizer adamw", "float32 and float64")


@pytest.mark.parametrize(("model", "dtype"), [("tiny/olmo3", "bfloat16"), ("tiny/llama", "float16")])
def test_low_precision_verify_passes_and_says_its_reference(runner, model, dtype):
    """OLMo 3's float32 RoPE tables in a bfloat16 model, and float16, verify against plain float32 on the
    weights rounded to that precision."""
    result = runner.invoke(app, ["verify", "--model", model, "--dtype", dtype, "--method", "streambp",
                                 "--seq-len", "40", "--ps", "16", "--ps-head", "8"])
    assert result.exit_code == 0, result.output
    assert "all methods match plain" in result.stdout
    assert f"same {dtype}-rounded weights" in " ".join(result.stdout.split())


def test_verify_of_an_eager_only_family_under_sdpa_passes(runner):
    """Gemma 2 has no SDPA in transformers: --attn sdpa still runs the baselines (the engine attention's
    name never reads as SDPA to transformers)."""
    result = runner.invoke(app, ["verify", "--model", "tiny/gemma2", "--dtype", "float64", "--attn", "sdpa",
                                 "--method", "checkpoint,mst", "--seq-len", "40", "--ps", "16",
                                 "--ps-head", "8"])
    assert result.exit_code == 0, result.output
    assert "all methods match plain" in result.stdout


@pytest.mark.parametrize(("offload", "optimizer", "methods", "left_out"), [
    ("none", "none", "checkpoint,mst,streambp", ""),  # plain is the reference itself
    ("optimizer", "adamw", "plain,checkpoint,mst,streambp", ""),
    ("checkpoints", "none", "checkpoint,mst,streambp", "offload checkpoints does not apply to it"),
    ("params", "none", "checkpoint,mst,streambp", "offload params does not apply to it"),
    ("all", "adamw", "checkpoint,mst,streambp", "offload checkpoints,params does not apply to it"),
])
def test_verify_default_methods_say_when_plain_is_left_out(offload, optimizer, methods, left_out):
    from streambp_bench.commands.verify.grads import default_methods
    from streambp_core.tiers import Tiers

    chosen, notes = default_methods(Tiers.of(offload), optimizer)
    assert chosen == methods
    expected = [True] if left_out else []
    assert [left_out in note and "plain is left out" in note for note in notes] == expected


def test_verify_without_method_notes_plain_left_out_of_offloaded_checks(runner, stub_verify):
    """--offload checkpoints with the default methods: plain cannot take the tier, and a note under the
    table says it was left out and why (also in the JSON document); a --method given has no such note."""
    args = [*TINY_VERIFY, "--dtype", "float64", "--offload", "checkpoints"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    assert "note: plain is left out of the methods checked: offload checkpoints" in result.stdout
    document = json.loads(runner.invoke(app, [*args, "--json"]).stdout)
    assert [entry["method"] for entry in document["results"]] == ["checkpoint", "mst", "streambp"]
    assert len(document["notes"]) == 1 and "keeps no checkpoints" in document["notes"][0]
    named = runner.invoke(app, [*args, "--method", "checkpoint", "--json"])
    assert named.exit_code == 0 and json.loads(named.stdout)["notes"] == []
    every = ("checkpoint", "mst", "streambp")
    assert [spec.methods for spec in stub_verify] == [every, every, ("checkpoint",)]
    assert all(str(spec.step.offload) == "checkpoints" for spec in stub_verify)


def test_verify_without_method_checks_plain_with_the_optimizer_tier(runner):
    args = [*TINY_VERIFY, "--dtype", "float64", "--optimizer", "adamw", "--offload", "optimizer", "--json"]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    document = json.loads(result.stdout)
    assert [entry["method"] for entry in document["results"]] == ["plain", "checkpoint", "mst", "streambp"]
    assert document["notes"] == [] and document["ok"]
    assert all(entry["max_update_err"] <= 1e-12 for entry in document["results"])
