"""The simulator's two pools under the optimizer and params tiers, the results' tier columns, and the
`reproduce offload` tier grid."""

from __future__ import annotations

import csv

import pandas as pd
import pytest
import torch

from streambp_bench.paper import host_tiers
from streambp_bench.paper.shared import Settings
from streambp_bench.results import ResultRow, ResultsFile
from streambp_core.config import StepSpec
from streambp_core.models.load import build_model, load_config
from streambp_core.step.parts.host_pool import host_resident_bytes
from streambp_core.step.run.setup import resident_bytes
from streambp_core.step.simulation.simulate import simulate

BF16, F32 = 2, 4


def _spec(offload: str, method: str = "streambp") -> StepSpec:
    return StepSpec.of(model="tiny/llama", method=method, seq_len_tokens=256, optimizer="adamw",
                       offload=offload, partition_size=32, head_partition_size=16)


@pytest.fixture(scope="module")
def sizes():
    model = build_model(load_config("tiny/llama"), dtype=torch.bfloat16, device="meta")
    layer = sum(p.numel() for p in model.model.layers[0].parameters())
    return {"params": sum(p.numel() for p in model.parameters()), "layer": layer,
            "embed": model.model.embed_tokens.weight.numel(), "head": model.lm_head.weight.numel()}


def test_the_tiers_move_weights_gradients_and_states_to_the_host_pool(sizes):
    none, every = (simulate(_spec(t), depth="full") for t in ("checkpoints", "checkpoints,optimizer,params"))
    held = host_resident_bytes(_spec("checkpoints,optimizer,params"), load_config("tiny/llama"))
    assert held == {"weights": sizes["params"] * BF16, "optimizer": 3 * sizes["params"] * F32}
    # host: bf16 weights + fp32 master and moments, on top of the checkpoints
    assert every.host_peak_bytes >= none.host_peak_bytes + sum(held.values())
    # device: no optimizer state, and at the peak at most two layers and one head-sized unit of weights
    assert every.breakdown_bytes["optimizer"] == 0
    assert every.breakdown_bytes["weights"] <= (2 * sizes["layer"] + sizes["head"]) * BF16
    assert every.peak_bytes < none.peak_bytes
    # per step: every weight gathered for forward, every one but the embedding again for backward, the
    # updated masters written to the host weights; every gradient sent to the host as it is complete
    assert every.to_device_bytes - none.to_device_bytes == (2 * sizes["params"] - sizes["embed"]) * BF16
    _gradients_sent_once(every.to_host_bytes - none.to_host_bytes, sizes)


def test_optimizer_tier_alone_returns_the_updated_weights(sizes):
    base, tiered = (simulate(_spec(tiers), depth="full") for tiers in ("none", "optimizer"))
    _gradients_sent_once(tiered.to_host_bytes, sizes)
    assert tiered.to_device_bytes == sizes["params"] * BF16  # the updated weights
    assert tiered.breakdown_bytes["weights"] == base.breakdown_bytes["weights"]
    assert tiered.peak_bytes < base.peak_bytes


def _gradients_sent_once(sent_bytes: int, sizes: dict) -> None:
    """Every gradient went to the host once (a norm's too, which streambp's chunks add to several times:
    its layer hands the sum over once)."""
    assert sent_bytes == sizes["params"] * BF16


@pytest.mark.parametrize("seq_len_tokens", [256, 1024])
def test_mst_sends_each_gradient_once_whatever_its_tile_count(sizes, seq_len_tokens):
    """mst's tiled MLP adds each tile's gradient to its weights' `.grad`: the host gets the sum once, so
    the bytes sent do not depend on the tiles (8 or 32 here, of which the simulation runs the first and
    last) nor on the length."""
    spec = _spec("optimizer", "mst").at(seq_len_tokens)
    _gradients_sent_once(simulate(spec, depth="full").to_host_bytes, sizes)


def test_the_grid_reruns_only_the_selected_cells(tmp_path):
    settings = Settings(out_dir=tmp_path, quick=True)
    host_tiers.run(settings, select=lambda spec: spec.method == "plain" and str(spec.offload) == "none")
    path = tmp_path / "offload-tiers-tiny.csv"
    first = ResultsFile(path).rows()
    assert [(row.method, row.offload) for row in first] == [("plain", "none")]
    host_tiers.run(settings, select=lambda spec: spec.method == "mst" and str(spec.offload) == "optimizer")
    rows = {(row.method, row.offload): row for row in ResultsFile(path).rows()}
    assert set(rows) == {("plain", "none"), ("mst", "optimizer")}
    assert rows["plain", "none"].timestamp == first[0].timestamp  # kept, not searched again


def test_resident_bytes_leave_out_what_the_tiers_hold():
    config = load_config("tiny/llama")
    full, optimizer, every = (resident_bytes(_spec(t), config)
                              for t in ("none", "optimizer", "optimizer,params"))
    assert 0 == every < optimizer < full


def test_results_carry_one_column_per_tier_and_old_files_read_none(tmp_path):
    row = ResultRow(method="streambp", model="m", seq_len_tokens=0, offload="checkpoints,optimizer,params",
                    source="simulated", metric="max_len", device_name="meta", value=1.0)
    assert (row.offload_checkpoints, row.offload_optimizer, row.offload_params) == (1, 1, 1)
    path = tmp_path / "old.csv"
    record = {k: v for k, v in row.to_record().items() if not k.startswith("offload")}
    with path.open("w", newline="") as handle:
        writer = csv.DictWriter(handle, fieldnames=list(record))
        writer.writeheader()
        writer.writerow(record)
    (old,) = ResultsFile(path).rows()
    tiers = (old.offload_checkpoints, old.offload_optimizer, old.offload_params)
    assert old.offload == "none" and tiers == (0, 0, 0)


def test_the_tier_grid_runs_each_method_with_each_tier_set_a_step_can_run():
    grid = host_tiers.cells(quick=False)
    methods = {(spec.method, str(spec.offload)) for spec, _ in grid}
    assert ("plain", "optimizer") in methods and ("plain", "checkpoints") not in methods
    assert ("streambp", "params") not in methods and ("mst", "checkpoints,optimizer,params") in methods
    assert len(grid) == 2 * 2 * (2 + 3 * 6)
    assert {round(budget, 1) for _, budget in grid} == {79.6, 140.4}


def test_the_section_compares_the_alst_recipe_and_the_targets():
    model = host_tiers.MODELS[0]
    rows = [{"metric": "max_len", "model": model, "budget_gib": budget, "method": method,
             "offload": "checkpoints,optimizer,params", "value": value, "peak_allocated_gib": 70.0,
             "host_peak_gib": 500.0, "to_host_gib": 1.0, "to_device_gib": 2.0}
            for budget, method, value in [(79.65, "streambp", 2_100_000), (79.65, "mst", 450_000),
                                          (140.4, "streambp", 3_000_000), (140.4, "mst", 2_000_000)]]
    text = "\n".join(host_tiers.section(pd.DataFrame(rows)))
    assert "streambp on one H100 80GB: 2,100,000 tokens (target >= 2,000,000: met)" in text
    assert "streambp on one H200 141GB: 3,000,000 tokens (target >= 4,000,000: not met)" in text
    assert "0.90x ALST's 500,000 (within ±25%: yes)" in text
    assert "1.67x ALST's 1,200,000 (within ±25%: no)" in text


def test_the_section_orders_the_grid_gives_the_ratio_to_alst_and_names_the_cells_not_run():
    model = host_tiers.MODELS[0]
    rows = [{"metric": "max_len", "model": model, "budget_gib": 79.65, "method": method, "offload": tiers,
             "value": value, "peak_allocated_gib": 70.0, "host_peak_gib": 500.0, "to_host_gib": 1.0,
             "to_device_gib": 2.0}
            for method, tiers, value in [("streambp", "checkpoints,optimizer,params", 2_000_000),
                                         ("plain", "optimizer", 8_000), ("mst", "none", 20_000)]]
    lines = host_tiers.section(pd.DataFrame(rows))
    table = [line for line in lines if line.startswith(f"| {model} |")]
    assert [line.split(" | ")[2] for line in table] == ["plain", "mst", "streambp"]
    assert table[-1].endswith("| 2,000,000 | 70.0 | 500.0 | 1.0 / 2.0 | 4.00 |")
    refusals = [line for line in lines if line.startswith("- ")]
    assert "- plain + offload checkpoints: offload does not apply to plain" in "\n".join(refusals)
    assert any(line.startswith("- mst, streambp + offload params: offload params with an optimizer needs "
                               "optimizer too") for line in refusals)
