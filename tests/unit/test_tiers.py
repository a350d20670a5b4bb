"""Tiers: one typed tier set, normalised once from what a user writes, shown as its canonical string."""

from __future__ import annotations

import dataclasses
import json
import pickle

import pytest

from streambp_core.config import ConfigError, StepSpec, StreamConfig
from streambp_core.tiers import ALL_TIERS, OFFLOAD_MODES, TierError, Tiers, tier_label, tier_problem

UNKNOWN = ("offload must be one of none, checkpoints, optimizer, params, all or a comma list of tiers; "
           "unknown tier ")


@pytest.mark.parametrize("mode", OFFLOAD_MODES)
def test_every_canonical_string_round_trips(mode):
    tiers = Tiers.of(mode)
    assert str(tiers) == mode == f"{tiers}"
    assert Tiers.of(str(tiers)) == tiers
    assert tiers.names == (() if mode == "none" else tuple(mode.split(",")))


@pytest.mark.parametrize("value", [
    "params,checkpoints", " Params , CHECKPOINTS ", "checkpoints,,params,", ("params", "checkpoints"),
    ["checkpoints", "params", "params"], {"params", "checkpoints"}, frozenset({"checkpoints", "params"}),
])
def test_any_spelling_reads_as_the_same_set_in_canonical_order(value):
    tiers = Tiers.of(value)
    assert tiers == Tiers(checkpoints=True, params=True)
    assert str(tiers) == "checkpoints,params"
    assert (tiers.checkpoints, tiers.optimizer, tiers.params) == (True, False, True)


@pytest.mark.parametrize("value", ["none", "", " NONE ", (), [], frozenset()])
def test_none_and_nothing_are_the_empty_set(value):
    tiers = Tiers.of(value)
    assert tiers == Tiers.NONE
    assert not tiers and str(tiers) == "none" and tiers.names == ()


def test_all_is_every_tier_and_a_tiers_reads_as_itself():
    assert Tiers.of("all") == Tiers.of(" ALL ") == Tiers.of(["all"]) == Tiers.ALL
    assert str(Tiers.ALL) == ALL_TIERS == "checkpoints,optimizer,params"
    assert Tiers.of(Tiers.ALL) is Tiers.ALL
    assert all(Tiers.of(mode) for mode in OFFLOAD_MODES if mode != "none")


@pytest.mark.parametrize(("value", "named"), [
    ("checkpoints,disk", "'disk'"), ("disk, ram", "'disk', 'ram'"), (("gpu",), "'gpu'"),
    ("all,params", "'all'"), ("none,optimizer", "'none'"),
])
def test_unknown_names_raise_naming_them(value, named):
    with pytest.raises(TierError) as err:
        Tiers.of(value)
    assert str(err.value) == UNKNOWN + named


def test_what_is_not_a_tier_set_is_refused():
    with pytest.raises(TierError, match="got 3"):
        Tiers.of(3)
    with pytest.raises(TierError, match="on or off"):
        Tiers(optimizer="yes")
    with pytest.raises(dataclasses.FrozenInstanceError):
        Tiers.NONE.params = True


def test_equal_sets_are_equal_and_hash_alike_and_a_set_is_not_its_string():
    parsed = {Tiers.of(mode) for mode in OFFLOAD_MODES}
    assert len(parsed) == len(OFFLOAD_MODES) == 8
    assert Tiers.of("optimizer,params") == Tiers.of(("params", "optimizer"))
    assert hash(Tiers.of("optimizer,params")) == hash(Tiers(optimizer=True, params=True))
    assert Tiers.of("optimizer") != Tiers.of("params")
    assert Tiers.NONE != "none" and str(Tiers.NONE) == "none"  # typed: compare its string, not itself
    assert pickle.loads(pickle.dumps(Tiers.ALL)) == Tiers.ALL  # specs travel to worker processes


def test_configs_hold_the_tiers_normalised_once_and_stay_hashable():
    assert StreamConfig(offload="params , checkpoints").offload == Tiers(checkpoints=True, params=True)
    assert StreamConfig().offload is Tiers.NONE
    first = StepSpec.of(model="tiny/llama", method="streambp", offload="checkpoints,params")
    second = StepSpec.of(model="tiny/llama", method="streambp", offload=("params", "checkpoints"))
    assert first == second and hash(first) == hash(second) and len({first, second}) == 1
    assert isinstance(first.offload, Tiers) and first.offload is first.stream.offload
    assert first != first.replaced(offload="checkpoints")
    with pytest.raises(ConfigError, match="unknown tier 'disk'"):
        StreamConfig(offload="disk")


def test_a_spec_dict_writes_the_canonical_string_and_reads_back():
    spec = StepSpec.of(model="tiny/llama", method="streambp", optimizer="adamw", offload="params,optimizer")
    values = json.loads(json.dumps(spec.to_dict()))
    assert values["offload"] == "optimizer,params"
    assert StepSpec.of(**values) == spec


def test_tier_problem_and_label_take_a_tiers():
    assert "nothing to offload" in tier_problem("plain", Tiers(checkpoints=True))
    assert tier_problem("plain", Tiers.of("checkpoints,params")).startswith("offload checkpoints,params does")
    assert tier_problem("plain", Tiers(optimizer=True), "adamw") is None
    assert "needs an optimizer" in tier_problem("streambp", Tiers(optimizer=True), "none")
    assert "needs optimizer too" in tier_problem("streambp", Tiers(params=True), "adamw")
    assert tier_problem("streambp", Tiers.ALL, "adamw") is None
    assert [tier_label(Tiers.of(m)) for m in ("none", "checkpoints", "optimizer,params")] == [
        "", "+ offload", "+ offload optimizer,params"]
